"""AttentionAsOneKernel: `softmax(q @ k.T) @ v` in one CPU kernel, its queries down the lanes.

Matches, in a dataflow block (the steps marked ? are optional):

    s = matmul(q, kt)                    q [..., L, D], kt [..., D, L2], float32, static
    s = reshape(s) ?    s = multiply(s, c) or divide(s, c) ?    s = reshape(s) ?
    y = softmax(s, axis=-1)  or  torch's _safe_softmax of s (the converter's pattern,
                                   relay_passes/safe_softmax.py)
    y = reshape(y) ?
    o = matmul(y, v)                     v [..., L2, Dv], the same batch dims (no broadcast)

and, when nothing else reads s, y or the steps between them (a softmax gradient that reads y
keeps them all), replaces `o` by

    o = call_tir(attention, (q, kt, v))[:, :L]           batch dims flattened, then restored

with `attention` the kernel of tvmgraph/schedules/attention.py (what it computes, and why the
queries run along the vectors); it returns its queries padded to whole vectors, hence the crop
(which fuses into o's reader). A ViT of 65 tokens and 4 heads of 32 (batch 16) spent 0.65 ms
a layer in the two products and the softmax on a 2-vCPU Xeon; the kernel takes 0.26-0.35 ms.
Masked attention (a mask added to or filled into s, a causal SDPA) does not match, nor do
sequences whose scores of one batch would not stay in L2 (MAX_SCORES_BYTES).

CPU (llvm) targets only. Position: after autodiff and SimplifyBroadcastMatmul, before
SafeSoftmaxAsOneKernel (which would take the softmax) and LegalizeOps.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_on_cpu
from relay_passes.bindings import read_counts
from relay_passes.rebind import BoundRewriter
from relay_passes.tensor_sizes import static_shape
from relay_passes.safe_softmax_pattern import call_of, reduces_last_axis, safe_softmax_parts, scalar_value
from tvmgraph.schedules.attention import attention_kernel, padded_queries

R = relax.op
# A batch's scores and exponentials (keys x padded queries, float32, two of them) above this
# leave L2; measured up to 128 x 128 (the transformer's heads, 128 KiB): longer sequences keep
# the products and the softmax.
MAX_SCORES_BYTES = 256 * 1024


def _static(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a float32 tensor of 3 or more dimensions."""
    shape = static_shape(expr, "float32")
    return shape if shape is not None and len(shape) >= 3 else None


@mutator
class _Fuser(BoundRewriter):
    def __init__(self, mod: tvm.IRModule, uses: Counter[relax.Var], lanes: int) -> None:
        super().__init__(mod)
        self.uses = uses
        self.lanes = lanes

    def _once(self, var: relax.Expr) -> bool:
        return isinstance(var, relax.Var) and self.uses[var] == 1

    def _through_reshapes(self, var: relax.Expr) -> relax.Expr:
        """The value `var` is a reshape of (through reshapes each read only there)."""
        while self._once(var) and (reshape := call_of(self._bound(var), "relax.reshape")) is not None:
            var = reshape.args[0]
        return var

    def _softmax_input(self, probs: relax.Expr) -> tuple[relax.Expr, bool] | None:
        """(x, safe) for `probs` = softmax(x, -1) or torch's _safe_softmax of x, when `probs`
        and the softmax inside a _safe_softmax are read nowhere else."""
        if not self._once(probs):
            return None
        value = self._bound(probs)
        softmax = call_of(value, "relax.nn.softmax")
        if softmax is not None:
            return (softmax.args[0], False) if reduces_last_axis(softmax) else None
        parts = safe_softmax_parts(call_of(value, "relax.where"), self._bound)
        return (parts[0], True) if parts is not None and self._once(parts[1]) else None

    def _scores(self, x: relax.Expr, safe: bool) -> tuple[relax.Call, float | None, bool] | None:
        """(matmul(q, kt), scale, divide) of the softmax's input `x`, when `x` is read by the
        softmax only (and by its empty-row test: twice) and each step before it once."""
        if not isinstance(x, relax.Var) or self.uses[x] != (2 if safe else 1):
            return None
        reshape = call_of(self._bound(x), "relax.reshape")
        s = self._through_reshapes(reshape.args[0]) if reshape is not None else x
        scale, divide = None, False
        value = self._bound(s)
        op = call_of(value, "relax.multiply")
        if op is None:
            op = call_of(value, "relax.divide")
        factor = scalar_value(op.args[1], "float32") if op is not None else None
        if factor is not None and (s is x or self._once(s)):
            scale, divide = factor, op.op.name == "relax.divide"
            s = self._through_reshapes(op.args[0])
        matmul = call_of(self._bound(s), "relax.matmul") if (s is x or self._once(s)) else None
        return (matmul, scale, divide) if matmul is not None else None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        matmul = call_of(call, "relax.matmul")
        if matmul is None:
            return call
        probs, v = matmul.args
        found = self._softmax_input(self._through_reshapes(probs))
        if found is None:
            return call
        x, safe = found
        scores = self._scores(x, safe)
        if scores is None:
            return call
        product, scale, divide = scores
        q, kt = product.args
        shapes = [_static(t) for t in (q, kt, v, probs, x)]
        if any(shape is None for shape in shapes):
            return call
        (*lead, queries, depth), kt_shape, v_shape, p_shape, x_shape = shapes
        keys, features = kt_shape[-1], v_shape[-1]
        # Batch dimensions equal (no broadcast); reshapes keep the elements in order, so with
        # the same trailing (queries, keys) on both sides of the softmax every row of scores
        # is the row the softmax and v see.
        if (kt_shape != (*lead, depth, keys) or v_shape != (*lead, keys, features)
                or p_shape != (*lead, queries, keys) or x_shape[-2:] != (queries, keys)):
            return call
        padded = padded_queries(queries, self.lanes)
        if 2 * keys * padded * 4 > MAX_SCORES_BYTES:
            return call
        batch = math.prod(lead)
        bb = self.builder_
        if len(lead) > 1:
            q, kt, v = (bb.emit(R.reshape(t, (batch, *shape[-2:]))) for t, shape in
                        ((q, (queries, depth)), (kt, (depth, keys)), (v, (keys, features))))
        out = self._rewrite(q, kt, v, (batch, queries, padded, depth, keys, features), scale, divide, safe)
        return R.reshape(bb.emit(out), (*lead, queries, features)) if len(lead) > 1 else out

    def _rewrite(self, q: relax.Expr, kt: relax.Expr, v: relax.Expr, dims: tuple[int, ...],
                 scale: float | None, divide: bool, safe: bool) -> relax.Expr:
        batch, queries, padded, depth, keys, features = dims
        kernel = attention_kernel(batch, keys, queries, depth, features, self.lanes, scale, divide, safe)
        gv = self.builder_.add_func(kernel, "attention")
        self.counts[f"{'safe ' if safe else ''}softmax over {keys} keys, {queries} queries of {depth}"] += 1
        out = relax.call_tir(gv, [q, kt, v], relax.TensorType((batch, padded, features), "float32"))
        if padded == queries:
            return out
        return R.strided_slice(self.builder_.emit(out), axes=[1], begin=[0], end=[queries])


@tvm.transform.module_pass(opt_level=0, name="AttentionAsOneKernel")
class AttentionAsOneKernel:
    """Compute each `softmax(q @ k.T) @ v` whose intermediates nothing else reads as one
    kernel (CPU only)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_on_cpu(mod, "AttentionAsOneKernel", self.report,
                              lambda cpu: _Fuser(mod, read_counts(mod), cpu.lanes("float32")), drop_unused=True)

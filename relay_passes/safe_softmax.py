"""SafeSoftmaxAsOneKernel: torch's `_safe_softmax` (attention's softmax) is one kernel.

The converter (tvmgraph/converters_nn.py, `safe_softmax`) writes `_safe_softmax(x, -1)`, a
softmax that gives 0 on rows that are all -inf, as

    finite = astype(not_equal(x, -inf), "int32")
    empty = equal(max(finite, axis=[-1], keepdims=True), 0)
    probs = softmax(x, axis=-1)                  (or softmax(where(empty, 0, x), axis=-1))
    y = where(empty, 0, probs)

which is two kernels: the test for empty rows, a reduction of its own that reads all of x
(one int at a time), then the softmax with the select. A ViT's attention (64 heads of 65 x 65,
16 x 4) spent 0.30 ms a layer in the pair on a Xeon, where a softmax alone takes 0.11. This pass
replaces `y` by one kernel (`call_tir` of a TE softmax, over rows padded with -inf to whole
vectors when no vector divides them, as PadRaggedSoftmax does) that reads the empty rows off the
softmax's own row max:

    m = max(row)              (TVM's max starts at the lowest finite float, -FLT_MAX)
    y[i] = 0 if m == -FLT_MAX and x[i] == -inf else exp(x[i] - m) / sum(exp(row - m))

Exact: a row whose max is -FLT_MAX holds only -inf and -FLT_MAX; its -inf elements are 0 in
torch's softmax too, and in an empty row every element is -inf. A row holding NaN has max NaN
(PropagateNaN) and gives NaN, as torch's does; +inf gives NaN too.

Rewritten only where nothing else reads the softmax (a training graph's softmax gradient reads
`probs`: left as it is) and for float32/float64 rows of static length on CPU targets.
Position: after autodiff (the kernel has no gradient), before PadRaggedSoftmax and LegalizeOps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_on_cpu
from relay_passes.bindings import read_counts
from relay_passes.pad_ragged_softmax import padded_extent, padded_rows
from relay_passes.rebind import BoundRewriter
from relay_passes.safe_softmax_pattern import call_of, safe_softmax_parts


@mutator
class _Fuser(BoundRewriter):
    def __init__(self, mod: tvm.IRModule, uses: Counter[relax.Var], lanes: Callable[[str], int]) -> None:
        super().__init__(mod)
        self.uses = uses
        self.lanes = lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        parts = safe_softmax_parts(call_of(call, "relax.where"), self._bound)
        if parts is None or self.uses[parts[1]] != 1:
            return call
        x = parts[0]
        ty = x.ty
        if not isinstance(ty, relax.TensorType) or str(ty.dtype) not in ("float32", "float64") \
                or ty.shape is None or not isinstance(ty.shape.values[-1], tirx.IntImm):
            return call
        extent = int(ty.shape.values[-1])
        padded = padded_extent(extent, self.lanes(str(ty.dtype))) or extent
        self.counts[f"rows of {extent}" + (f" padded to {padded}" if padded != extent else "")] += 1
        return self.builder_.call_te(_safe_softmax, x, padded, primfunc_name_hint="safe_softmax")


def _safe_softmax(x: te.Tensor, padded: int) -> te.Tensor:
    """Softmax over the last axis of `x` (rows padded to `padded` with -inf), 0 on the rows
    that are all -inf (see the module docstring)."""
    neg_inf = tirx.const(float("-inf"), x.dtype)
    rows = padded_rows(x, padded)
    row_max = topi.max(rows, axis=-1)
    exp = te.compute(rows.shape, lambda *i: te.exp(rows[i] - row_max[i[:-1]]), name="exp")
    total = topi.sum(exp, axis=-1)
    lowest = tirx.min_value(x.dtype)
    return te.compute(
        x.shape,
        lambda *i: tirx.Select(tirx.all(row_max[i[:-1]] == lowest, x[i] == neg_inf),
                               tirx.const(0.0, x.dtype), exp[i] / total[i[:-1]]),
        name="safe_softmax")


@tvm.transform.module_pass(opt_level=0, name="SafeSoftmaxAsOneKernel")
class SafeSoftmaxAsOneKernel:
    """Compute each `where(empty rows, 0, softmax(x))` as one kernel (CPU only)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_on_cpu(mod, "SafeSoftmaxAsOneKernel", self.report,
                              lambda cpu: _Fuser(mod, read_counts(mod), cpu.lanes), drop_unused=True)

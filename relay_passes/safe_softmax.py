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

import math
from collections import Counter
from collections.abc import Callable

import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes import current_cpu, graph_functions, mutate_graph_functions, report_counts
from relay_passes.bindings import vars_in
from relay_passes.pad_ragged_softmax import padded_extent, padded_rows
from relay_passes.rebind import rebind


def _call(expr: relax.Expr | None, name: str) -> relax.Call | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name:
        return expr
    return None


def _is_const(expr: relax.Expr, value: float) -> bool:
    if not isinstance(expr, tvm.ir.expr.GenericConst):
        return False
    data = expr.value.numpy()
    return data.shape == () and float(data) == value


def _last_axis(call: relax.Call) -> bool:
    """Whether the call's `axis` attribute is the last axis of its first argument, alone."""
    axes = call.attrs.axis
    ndim = call.args[0].ty.ndim
    axes = [axes] if isinstance(axes, (int, tvm.tirx.IntImm)) else list(axes or [])
    return len(axes) == 1 and int(axes[0]) % ndim == ndim - 1


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, uses: Counter[relax.Var], lanes: Callable[[str], int]) -> None:
        super().__init__(mod)
        self.uses = uses
        self.lanes = lanes
        self.counts: Counter[str] = Counter()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        rebind(self, binding, self.visit_expr(binding.value))

    def _bound(self, expr: relax.Expr) -> relax.Expr | None:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else None

    def _empty_rows_of(self, cond: relax.Expr) -> relax.Expr | None:
        """The x of `equal(max(astype(not_equal(x, -inf), int32), [-1], keepdims), 0)`."""
        equal = _call(self._bound(cond), "relax.equal")
        if equal is None or not _is_const(equal.args[1], 0):
            return None
        reduced = _call(self._bound(equal.args[0]), "relax.max")
        if reduced is None or not bool(reduced.attrs.keepdims) or not _last_axis(reduced):
            return None
        cast = _call(self._bound(reduced.args[0]), "relax.astype")
        finite = _call(self._bound(cast.args[0]), "relax.not_equal") if cast is not None else None
        if finite is None or not _is_const(finite.args[1], -math.inf):
            return None
        return finite.args[0]

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        where = _call(call, "relax.where")
        if where is None or not _is_const(where.args[1], 0.0):
            return call
        cond, probs = where.args[0], where.args[2]
        softmax = _call(self._bound(probs), "relax.nn.softmax")
        if softmax is None or self.uses[probs] != 1 or not _last_axis(softmax):
            return call
        x = self._empty_rows_of(cond)
        logits = softmax.args[0]
        masked = _call(self._bound(logits), "relax.where")
        if masked is not None and masked.args[0].same_as(cond) and _is_const(masked.args[1], 0.0):
            logits = masked.args[2]  # softmax(where(empty, 0, x)): the same rows of x
        if x is None or not logits.same_as(x):
            return call
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


def _uses(mod: tvm.IRModule) -> Counter[relax.Var]:
    """How many times each variable of the graph functions is read."""
    uses: Counter[relax.Var] = Counter()
    for _, func in graph_functions(mod):
        for block in func.body.blocks:
            for binding in block.bindings:
                uses.update(vars_in(binding.value))
        uses.update(vars_in(func.body.body))
    return uses


@tvm.transform.module_pass(opt_level=0, name="SafeSoftmaxAsOneKernel")
class SafeSoftmaxAsOneKernel:
    """Compute each `where(empty rows, 0, softmax(x))` as one kernel (CPU only)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        cpu = current_cpu()
        if cpu is None:
            return mod
        fuser = _Fuser(mod, _uses(mod), cpu.lanes)
        out = mutate_graph_functions(fuser, mod, drop_unused=True)
        report_counts(self.report, "SafeSoftmaxAsOneKernel", fuser.counts)
        return out if fuser.counts else mod

"""UnitSumsAsReshapes: a sum over axes of extent 1 only is a reshape.

    dx = R.collapse_sum_to(dy, R.shape([16, 512]))    ->    dx = R.reshape(dy, R.shape([16, 512]))
         (dy: (1, 16, 512))

Autodiff writes the gradient of a broadcast operand as `collapse_sum_to` its shape, also when
the broadcast only added axes of extent 1: an RNN's time step `x_t + h @ W` adds a (16, 512)
slice of the precomputed input projection to a (1, 16, 512) product. Legalized, such a sum
is a kernel that copies its input (one per time step, 32 in an LSTM's backward pass); a
reshape is a view (RewriteDataflowReshape), no kernel. Rewritten: `collapse_sum_to`,
`collapse_sum_like` and `sum` whose summed axes all have extent 1. Exact: each output element
is its one input element.

Position: before LegalizeOps (it rewrites Relax ops).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter
from tvmgraph.ragged_sums import collapsed_axes, reduced_axes


def _is_one(extent: tvm.ir.PrimExpr) -> bool:
    return isinstance(extent, tvm.tirx.IntImm) and int(extent) == 1


def summed_axes(call: relax.Call) -> list[int] | None:
    """The axes of its input that a sum call reduces, or None for another call or unknown shapes."""
    name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
    source = call.args[0].ty.shape if call.args and isinstance(call.args[0].ty, relax.TensorType) else None
    if source is None or name not in ("relax.collapse_sum_to", "relax.collapse_sum_like", "relax.sum"):
        return None
    source = list(source)
    if name == "relax.sum":
        return reduced_axes(len(source), call.attrs.axis)
    if call.ty.shape is None or len(call.ty.shape) > len(source):
        return None
    return collapsed_axes(source, list(call.ty.shape))


@mutator
class _Rewriter(BoundRewriter):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        axes = summed_axes(call)
        if axes is None or call.ty.shape is None or call.ty.dtype != call.args[0].ty.dtype:
            return call
        source = call.args[0].ty.shape
        if not all(_is_one(source[a]) for a in axes):
            return call
        self.counts[f"{call.op.name.removeprefix('relax.')} over unit axes"] += 1
        return relax.op.reshape(call.args[0], call.ty.shape)


@tvm.transform.module_pass(opt_level=0, name="UnitSumsAsReshapes")
class UnitSumsAsReshapes:
    """Rewrite each sum over axes of extent 1 only as a reshape."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "UnitSumsAsReshapes", self.report, _Rewriter(mod))

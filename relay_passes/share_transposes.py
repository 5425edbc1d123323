"""ShareTransposes: the same transpose of one tensor, repeated, is computed once.

    w1 = R.permute_dims(w_hh, [1, 0])            w1 = R.permute_dims(w_hh, [1, 0])
    y1 = R.matmul(h1, w1)                 ->     y1 = R.matmul(h1, w1)
    w2 = R.permute_dims(w_hh, [1, 0])            y2 = R.matmul(h2, w1)
    y2 = R.matmul(h2, w2)

torch.export writes an RNN's recurrent product `h @ W_hh.T` with a transpose of its own at
every time step (an LSTM: 32). FuseEpilogue takes each of them into its matmul's kernel, which
then reads W_hh across its rows and packs it into panels: the whole weight transposed again at
every step (LSTM inference at batch 16, hidden 128: 27 us a step, 78 GFLOP/s). Shared, the
transpose has several readers, so FuseEpilogue leaves it out of the groups: one transpose
kernel, and every step reads W_hh.T along its rows, in place.

Only transposes of the same variable with the same axes, within one dataflow block (a dataflow
variable is not visible outside its block). Exact: both compute the same tensor.

Position: before FuseEpilogue (which decides what goes into the matmul kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter, rebind

_PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")


def _transpose_key(value: relax.Expr) -> tuple[relax.Var, tuple[int, ...] | None] | None:
    """(source variable, axes) of a permute_dims of a variable; None for any other value."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_PERMUTE_DIMS)
            and isinstance(value.args[0], relax.Var)):
        return None
    axes = value.attrs.axes
    return value.args[0], None if axes is None else tuple(int(a) for a in axes)


@mutator
class _Sharer(BoundRewriter):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self._seen: dict[tuple[relax.Var, tuple[int, ...] | None], relax.Var] = {}

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        self._seen = {}
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        key = _transpose_key(value)
        if key is not None and isinstance(binding.var, relax.DataflowVar):
            if key in self._seen:
                self.counts["repeated transpose"] += 1
                rebind(self, binding, self._seen[key])  # a dataflow var: remapped, not emitted
                return
            self._seen[key] = rebind(self, binding, value)
            return
        rebind(self, binding, value)


@tvm.transform.module_pass(opt_level=0, name="ShareTransposes")
class ShareTransposes:
    """Compute each repeated transpose of a variable once per dataflow block."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "ShareTransposes", self.report, _Sharer(mod))

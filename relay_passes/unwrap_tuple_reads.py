"""UnwrapTupleReads: `(x, y)[0]` becomes `x`, and a tuple literal nothing reads is dropped.

    lv = R.call_tir(reshape, (a,), ...)              lv = R.call_tir(reshape, (a,), ...)
    i = (lv,)[0]                             ->      out = R.call_tir(adv_index, (dy, lv), ...)
    out = R.call_tir(adv_index, (dy, i), ...)

The same for a variable bound to a tuple literal (`t = (y, y, y); x = t[0]`: x = y).

Why: LegalizeOps reads the indices of `index_tensor` (the gradient of `index_put`: max_unpool,
`x[idx] = v`) through a tuple literal. FuseOps then fused `lv`'s producer into a kernel and
lost its binding, as `lv` was read only inside the tuple: the module was ill-formed ("DataflowVar
lv24_again is not defined") and the training graph failed to compile.

A tuple literal nothing reads is dropped: LegalizeOps leaves one behind each `concat` of a
tuple variable (the gradient of a `split`: `t = (di, df, dg, do)`, `R.concat(t)`) when it
passes the fields to the kernel directly. FuseOps counted the dead tuple as a reader of each
field, so no field fused into the concatenation: an LSTM's backward step ran its four gate
gradients as four kernels and a fifth to concatenate them (one, fused).

A group norm's converter (tvmgraph/converters_nn.py) binds torch's (out, mean, rstd) as such a
tuple, `(y, y, y)` when nothing reads the statistics; FuseOps fused nothing through it: a U-Net's
SiLU after each group norm was a kernel of its own, which read the norm's output again.

Position: right after LegalizeOps, before FuseOps.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes import graph_functions

from .bindings import rewrite_dataflow_blocks, vars_in
from .rebind import rebind


@mutator
class _Unwrap(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.count = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        # `x = y` is not emitted: x's readers read y (FuseOps fuses nothing through an alias).
        value = self.visit_expr(binding.value)
        if isinstance(value, relax.Var) and isinstance(binding.var, relax.DataflowVar):
            self.count += 1
        rebind(self, binding, value)

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        tup = self.visit_expr(op.tuple_value)
        bound = self.lookup_binding(tup) if isinstance(tup, relax.Var) else None
        if isinstance(bound, relax.Tuple):
            tup = bound
        if isinstance(tup, relax.Tuple):
            self.count += 1
            return tup.fields[op.index]
        return relax.TupleGetItem(tup, op.index) if not tup.same_as(op.tuple_value) else op


@tvm.transform.module_pass(opt_level=0, name="UnwrapTupleReads")
class UnwrapTupleReads:
    """Read a tuple literal's field directly in every Relax function; drop the tuple literals
    no binding reads."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in list(graph_functions(mod)):
            unwrap = _Unwrap(mod)
            rewritten = unwrap.visit_expr(func)
            if unwrap.count:
                mod[gv] = rewritten
        mod, _ = rewrite_dataflow_blocks(mod, lambda block: [_without_unread_tuples(block)])
        return mod


def _without_unread_tuples(block: relax.DataflowBlock) -> relax.DataflowBlock:
    """`block` without the tuple literals bound to dataflow variables nothing reads (a block
    output is read after the block, so it stays)."""
    read = {v for b in block.bindings for v in vars_in(b.value)}
    kept = [b for b in block.bindings
            if not (isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Tuple)
                    and isinstance(b.var, relax.DataflowVar) and b.var not in read)]
    return block if len(kept) == len(block.bindings) else relax.DataflowBlock(kept)

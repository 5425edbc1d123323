"""UnwrapTupleReads: `(x, y)[0]` becomes `x`.

    lv = R.call_tir(reshape, (a,), ...)              lv = R.call_tir(reshape, (a,), ...)
    i = (lv,)[0]                             ->      i = lv
    out = R.call_tir(adv_index, (dy, i), ...)        out = R.call_tir(adv_index, (dy, i), ...)

Why: LegalizeOps reads the indices of `index_tensor` (the gradient of `index_put`: max_unpool,
`x[idx] = v`) through a tuple literal. FuseOps then fused `lv`'s producer into a kernel and
lost its binding, as `lv` was read only inside the tuple: the module was ill-formed ("DataflowVar
lv24_again is not defined") and the training graph failed to compile.

Position: right after LegalizeOps, before FuseOps.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes import graph_functions


@mutator
class _Unwrap(PyExprMutator):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.count = 0

    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        tup = self.visit_expr(op.tuple_value)
        if isinstance(tup, relax.Tuple):
            self.count += 1
            return tup.fields[op.index]
        return relax.TupleGetItem(tup, op.index) if not tup.same_as(op.tuple_value) else op


@tvm.transform.module_pass(opt_level=0, name="UnwrapTupleReads")
class UnwrapTupleReads:
    """Read a tuple literal's field directly in every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        for gv, func in list(graph_functions(mod)):
            unwrap = _Unwrap(mod)
            rewritten = unwrap.visit_expr(func)
            if unwrap.count:
                mod[gv] = rewritten
        return mod

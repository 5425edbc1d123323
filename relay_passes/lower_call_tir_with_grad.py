"""LowerCallTIRWithGrad: `R.call_tir_with_grad(f, args)` -> `R.call_tir(f, args)`.

`call_tir_with_grad` only tells `relax.transform.Gradient` which TE function differentiates a
call; after autodiff (or in a program that is never differentiated) it is a plain `call_tir`,
which is the only form the VM code generator accepts. Put this pass before LegalizeOps.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

_WITH_GRAD = tvm.ir.Op.get("relax.call_tir_with_grad")


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op.same_as(_WITH_GRAD):
            return relax.call_tir(call.args[0], call.args[1], call.ty_args[0] if len(call.ty_args) == 1 else call.ty_args)
        return call


@tvm.transform.module_pass(opt_level=0, name="LowerCallTIRWithGrad")
class LowerCallTIRWithGrad:
    """Replace every call_tir_with_grad with the equivalent call_tir."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()

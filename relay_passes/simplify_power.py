"""SimplifyPower: `x ** 2` becomes `x * x`, and arithmetic on two scalar constants is folded.

MSELoss is `mean((a - b) ** 2)`, and autodiff differentiates the power as

    R.power(x, R.subtract(R.const(2), R.const(1))) * (2 * dy)

Neither power vectorizes: TIR's `pow` with a runtime exponent is a libm call per element (1.7 ms
for 8 x 128 x 256 floats, 30x an element-wise multiply), and without FoldConstant (not in our
pipeline, see pipeline.py) the exponent stays a runtime value. This pass rewrites

    add/subtract/multiply/divide(c1, c2)      -> c     (float scalar constants, computed here)
    power(x, 1)                               -> x
    power(x, 2)                               -> multiply(x, x)

Both power rewrites are exact (pow(x, 2) is correctly rounded, as is x * x).

Position: before LegalizeOps (anywhere in the Relax part of the pipeline).
Limits: only scalar constants of float dtype; other exponents keep the libm call.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter

_FOLD: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "relax.add": operator.add,
    "relax.subtract": operator.sub,
    "relax.multiply": operator.mul,
    "relax.divide": operator.truediv,
}


def _scalar(expr: relax.Expr) -> np.ndarray | None:
    """The value of a 0-d float constant, else None."""
    if not isinstance(expr, tvm.ir.expr.GenericConst):
        return None
    value = expr.value.numpy()
    return value if value.ndim == 0 and value.dtype.kind == "f" else None


@mutator
class _Simplifier(BoundRewriter):
    def _constant(self, expr: relax.Expr) -> np.ndarray | None:
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            expr = bound if bound is not None else expr
        return _scalar(expr)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        name = call.op.name
        if name in _FOLD and len(call.args) == 2:
            a, b = (self._constant(arg) for arg in call.args)
            if a is not None and b is not None and a.dtype == b.dtype:
                self.counts["constant folded"] += 1
                return relax.const(_FOLD[name](a, b).astype(a.dtype), str(a.dtype))
        if name == "relax.power":
            exponent = self._constant(call.args[1])
            x = call.args[0]
            if exponent is not None and x.ty.dtype == call.ty.dtype:
                if exponent == 1:
                    self.counts["x ** 1"] += 1
                    return x
                if exponent == 2:
                    self.counts["x ** 2"] += 1
                    return relax.op.multiply(x, x)
        return call


@tvm.transform.module_pass(opt_level=0, name="SimplifyPower")
class SimplifyPower:
    """Fold scalar constant arithmetic; turn powers 1 and 2 into a copy and a multiply."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "SimplifyPower", self.report, _Simplifier(mod), drop_unused=True)

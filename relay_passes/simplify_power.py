"""SimplifyPower: `x ** 2` becomes `x * x`, and arithmetic on two scalar constants is folded.

MSELoss is `mean((a - b) ** 2)`, and autodiff differentiates the power as

    R.power(x, R.subtract(R.const(2), R.const(1))) * (2 * dy)

Neither power vectorizes: TIR's `pow` with a runtime exponent is a libm call per element (1.7 ms
for 8 x 128 x 256 floats, 30x an element-wise multiply), and without FoldConstant (not in our
pipeline, see pipeline.py) the exponent stays a runtime value. This pass rewrites

    add/subtract/multiply/divide(c1, c2)      -> c     (float scalar constants, computed here)
    power(x, 1)                               -> x
    power(x, 2)                               -> multiply(x, x)
    power(x, 3), power(x, 0.5), (-0.5), (-1), (-2) -> x * x * x, sqrt(x), 1 / sqrt(x), 1 / x, 1 / (x * x)

as torch's pow kernel computes those exponents (the same operations in the same order, so the
same numbers, also where libm's pow differs: pow(-inf, 0.5) is inf, torch's sqrt gives NaN).
In bfloat16 and float16 only the one-operation forms (float16: not 0.5, which torch takes
through std::pow there); the others stay a power, computed in float32 and rounded once
(AccumulateFloat32), as torch does.

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


def _one(dtype: str) -> relax.Expr:
    return relax.const(1.0, dtype)


# The exponents torch's pow kernel computes without std::pow (aten/src/ATen/native/cpu/
# PowKernel.cpp), in its order of operations: the same numbers, also at inf and -0.0 (libm's
# pow(-inf, 0.5) is inf, torch's sqrt NaN), and vector instructions instead of a libm call.
_TORCH_POWERS: dict[float, Callable[[relax.Expr, str], relax.Expr]] = {
    1.0: lambda x, dtype: x,
    2.0: lambda x, dtype: relax.op.multiply(x, x),
    3.0: lambda x, dtype: relax.op.multiply(relax.op.multiply(x, x), x),
    0.5: lambda x, dtype: relax.op.sqrt(x),
    -0.5: lambda x, dtype: relax.op.divide(_one(dtype), relax.op.sqrt(x)),
    -1.0: lambda x, dtype: relax.op.divide(_one(dtype), x),
    -2.0: lambda x, dtype: relax.op.divide(_one(dtype), relax.op.multiply(x, x)),
}


def _scalar(expr: relax.Expr) -> np.ndarray | None:
    """The value of a 0-d float constant, else None."""
    if not isinstance(expr, tvm.ir.expr.GenericConst):
        return None
    value = expr.value.numpy()
    floating = value.dtype.kind == "f" or value.dtype.name == "bfloat16"  # ml_dtypes' bfloat16 is kind V
    return value if value.ndim == 0 and floating else None


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
                rewrite = _TORCH_POWERS.get(float(exponent))
                if float(exponent) in (0.5, -0.5) and str(exponent.dtype) == "float16":
                    rewrite = None  # torch's float16 pow takes std::pow here: (-inf) ** 0.5 = inf
                if float(exponent) not in (1.0, 2.0, 0.5, -1.0) and str(exponent.dtype) in ("bfloat16", "float16"):
                    rewrite = None  # two 16-bit roundings where torch rounds a float result once
                if rewrite is not None:
                    self.counts[f"x ** {float(exponent):g}"] += 1
                    return rewrite(x, str(exponent.dtype))
        return call


@tvm.transform.module_pass(opt_level=0, name="SimplifyPower")
class SimplifyPower:
    """Fold scalar constant arithmetic; turn powers 1 and 2 into a copy and a multiply."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "SimplifyPower", self.report, _Simplifier(mod), drop_unused=True)

"""ZeroOperands: a product with, or a division by or of, a constant zero keeps IEEE's inf and NaN.

TVM builds `x * c` and `x / c` of a constant `c` with the constant as an immediate, and its
expression builder folds it there: `x * 0.0` becomes `0.0` (eager: NaN where x is inf or NaN),
`0.0 / x` becomes `0.0` (eager: NaN where x is 0 or NaN), and `x / 0.0` stops the compile
(`Divide by zero`, a TVM check). A loss term switched off with `* 0.0` hid a NaN that eager
shows; `torch.cov` with no degrees of freedom, `x / 0.0` did not compile. Each such call, its
constant all zeros (a scalar or tensor constant of float dtype; for a division also a value
of `zeros`/`ones`/`full` calls, constants, + - and *, which TIR folds: `x / (torch.ones(n) - 1)`
stopped the compile), becomes what IEEE gives:

    x * 0, 0 * x   ->  where(isfinite(x), 0, NaN)
    x / 0          ->  where(x == 0 or isnan(x), NaN, where(x > 0, inf, -inf))   (signs flipped by -0.0)
    x // 0         ->  the same (floor of +-inf)
    0 / x          ->  where(x == 0 or isnan(x), NaN, 0)
    x % 0, fmod(x, 0)  ->  NaN (`torch.remainder(x, 0.0)` stopped the compile too)

broadcast to the call's shape. Zeros keep no sign (IEEE's `-2 * 0` is -0.0; here +0.0).

Position: before LegalizeOps (after SimplifyPower, which folds constant arithmetic first).
Limits: float results only (an integer `x * 0` is exactly 0). A product with a `zeros` call
(`x * torch.zeros(n)`) keeps TVM's 0: autodiff multiplies its zero adjoints the same way, where
eager computes nothing, and there 0 is eager's number.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter

op = relax.op


_ARITHMETIC = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply}


@mutator
class _Rewriter(BoundRewriter):
    def _zeros_of(self, expr: relax.Expr, calls: bool) -> np.ndarray | None:
        """The zeros `expr` is bound to (either sign): a float constant, or with `calls` a value
        computed from zeros/ones/full calls and constants (`torch.ones(n) - 1`), which TIR folds
        to a zero."""
        value = self._constant_value(expr, depth=4 if calls else 0)
        if value is None or value.size == 0 or np.any(value != 0):
            return None
        return value

    def _bound(self, expr: relax.Expr) -> relax.Expr:
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            return bound if bound is not None else expr
        return expr

    def _constant_value(self, expr: relax.Expr, depth: int) -> np.ndarray | None:
        """The float32 value of a float `expr` made of constants, fills and + - *, else None."""
        expr = self._bound(expr)
        if isinstance(expr, tvm.ir.expr.GenericConst):
            value = expr.value.numpy()
            floating = value.dtype.kind == "f" or value.dtype.name == "bfloat16"  # ml_dtypes' bfloat16 is kind V
            return value.astype("float32") if floating else None
        if depth == 0 or not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
            return None
        name, dtype = expr.op.name, getattr(getattr(expr.ty, "dtype", None), "dtype", "")
        if not dtype.startswith(("float", "bfloat")):
            return None
        if name in ("relax.zeros", "relax.zeros_like"):
            return np.zeros((), "float32")
        if name in ("relax.ones", "relax.ones_like"):
            return np.ones((), "float32")
        if name in ("relax.full", "relax.full_like"):
            return self._constant_value(expr.args[1], 0)
        if name in _ARITHMETIC:
            a, b = (self._constant_value(arg, depth - 1) for arg in expr.args)
            return None if a is None or b is None else _ARITHMETIC[name](a, b).astype("float32")
        return None

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or len(call.args) != 2:
            return call
        name = call.op.name
        dtype = getattr(getattr(call.ty, "dtype", None), "dtype", None)
        if name not in ("relax.multiply", "relax.divide", "relax.floor_divide", "relax.floor_mod", "relax.mod") \
                or dtype is None \
                or not dtype.startswith(("float", "bfloat")):
            return call
        x, y = call.args
        # A product with a zeros call is left alone: autodiff multiplies its zero adjoints too,
        # where eager computes nothing (a masked -inf score times a zero adjoint must stay 0).
        calls = name != "relax.multiply"
        left, right = self._zeros_of(x, calls), self._zeros_of(y, calls)
        if left is not None and right is not None:
            return call  # both constant: nothing reads a value at run time
        nan, zero = relax.const(np.nan, dtype), relax.const(0.0, dtype)
        if name == "relax.multiply" and (left is not None or right is not None):
            value, _ = self._testable(y if left is not None else x, dtype)
            self.counts["x * 0"] += 1
            return self._shaped(op.where(op.isfinite(value), zero, nan), call)
        if right is not None and name in ("relax.floor_mod", "relax.mod"):  # x % 0
            self.counts["x % 0"] += 1
            return op.full(call.ty.shape, nan, dtype)
        if right is not None:  # x / 0, x // 0
            self.counts["x / 0"] += 1
            x, test_zero = self._testable(x, dtype)
            infinity = relax.const(np.where(np.signbit(right), -np.inf, np.inf).astype("float32"), dtype)
            signed = op.where(op.greater(x, test_zero), infinity, op.negative(infinity))
            undefined = op.logical_or(op.equal(x, test_zero), op.isnan(x))
            return self._shaped(op.where(undefined, nan, signed), call)
        if left is not None and name == "relax.divide":  # 0 / x
            self.counts["0 / x"] += 1
            y, test_zero = self._testable(y, dtype)
            undefined = op.logical_or(op.equal(y, test_zero), op.isnan(y))
            return self._shaped(op.where(undefined, nan, zero), call)
        return call

    @staticmethod
    def _testable(x: relax.Expr, dtype: str) -> tuple[relax.Expr, relax.Expr]:
        """(x, a zero of its dtype) to test x with: in float32 when bfloat16 (TVM legalizes no
        isnan/isfinite of bfloat16; the cast is exact)."""
        if dtype == "bfloat16":
            return op.astype(x, "float32"), relax.const(0.0, "float32")
        return x, relax.const(0.0, dtype)

    def _shaped(self, value: relax.Expr, call: relax.Call) -> relax.Expr:
        """`value` broadcast to the call's result shape (a zero tensor may be the larger operand)."""
        value = self.builder_.normalize(value)
        if value.ty.shape is not None and call.ty.shape is not None \
                and not tvm_ffi.structural_equal(value.ty.shape, call.ty.shape):
            return op.broadcast_to(value, call.ty.shape)
        return value


@tvm.transform.module_pass(opt_level=0, name="ZeroOperands")
class ZeroOperands:
    """Products with and divisions by or of constant zeros as IEEE computes them."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "ZeroOperands", self.report, _Rewriter(mod), drop_unused=True)

"""FloatDivisionByZero: a float division by a divisor that is a constant zero gives IEEE's
result (inf, -inf or NaN) instead of stopping the build.

TVM's constant folder refuses `a / 0.0` for floats (`Check failed: fb->value != 0 ...: Divide
by zero`) wherever its simplifier meets one, and every build simplifies: a training step on a
batch of zero rows failed to compile, its loss's mean dividing by `float32(int64(0))` (eager
gives a NaN loss and leaves the parameters as they were). Here each float division whose
divisor is a constant expression equal to zero becomes

    a / 0.0  ->  select(isnan(a) or a == 0, nan, select(a > 0, inf, -inf))

(signs swapped for -0.0), what the hardware's division gives. Divisors that read a buffer or a
variable are left alone: they are divided at run time, by the hardware.

Position: after the schedules, on every target (the folding is TVM's, not LLVM's).
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.sym import Analyzer
from tvm.ir.expr import TensorLoad
from tvm_ffi.structural import StructuralMutator, structural_mutate, structural_visit

from .loops import rewrite_prim_funcs


def _constant(expr: tirx.PrimExpr) -> bool:
    """True for an expression of literals only (no variable, no buffer read)."""
    found = []
    structural_visit(expr, [(kind, lambda node, visitor: found.append(node)) for kind in (TensorLoad, tirx.Var)])
    return not found


def _zero_sign(divisor: tirx.PrimExpr) -> float | None:
    """+1.0 or -1.0 for a divisor that folds to +0.0 or -0.0; None for any other."""
    if not _constant(divisor):
        return None
    value = Analyzer().simplify(divisor)
    if isinstance(value, tirx.IntImm) and value.value == 0:
        return 1.0
    if isinstance(value, tirx.FloatImm) and value.value == 0.0:
        return math.copysign(1.0, value.value)
    return None


def float_division_by_zero(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every float division by a constant zero written as its IEEE result."""

    def division(node: tirx.PrimExpr, mutator: StructuralMutator) -> tirx.PrimExpr:
        node = mutator.default_mutate(node)
        dtype = str(node.ty)
        if not dtype.startswith(("float", "bfloat")) or (sign := _zero_sign(node.b)) is None:
            return node
        a = node.a
        nan, zero = tirx.const(math.nan, dtype), tirx.const(0.0, dtype)
        inf, minus_inf = tirx.const(math.inf * sign, dtype), tirx.const(-math.inf * sign, dtype)
        return tirx.Select(tirx.Or(tirx.isnan(a), a == zero), nan, tirx.Select(a > zero, inf, minus_inf))

    return structural_mutate(func, [(tirx.Div, division)])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.FloatDivisionByZero")
class FloatDivisionByZero:
    """Apply `float_division_by_zero` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, float_division_by_zero)

"""SafeIntegerDivision: an integer division by a zero read from a tensor gives 0 instead of
killing the process.

torch raises `RuntimeError: ZeroDivisionError` for `a // b`, `a % b`, `torch.div(a, b,
rounding_mode=...)` and `torch.fmod` of integer tensors when b holds a zero. A compiled kernel
has no way to raise: x86's `idiv` traps, and the whole Python process died of SIGFPE ("Floating
point exception"), the user's training state with it. Here every integer division or remainder
whose divisor reads a buffer becomes

    a / b  ->  select(b == 0, 0, a / select(b == 0, 1, b))

(numpy's result for a zero divisor, 0 for the quotient and the remainder alike). A signed
divisor of -1 traps too when a is the dtype's minimum (`idiv` overflows: -128 // -1 of int8
killed the process): there the quotient is -a, wrapped as torch's (-128), and the remainder 0.
Divisions by
constants and by shape variables (index arithmetic) are left as they are: they are never zero
at run time, and their selects would cost the loops their simplification.

Position: after the schedules, with the other CPU fixes of the kernels' arithmetic (AArch64's
`sdiv` gives 0 without trapping; it costs a select there, on rare integer divisions only).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm_ffi.structural import StructuralMutator, structural_mutate, structural_visit

from .loops import rewrite_prim_funcs

_DIVISIONS = (tirx.Div, tirx.FloorDiv, tirx.Mod, tirx.FloorMod)


def _reads_a_buffer(expr: tirx.PrimExpr) -> bool:
    found = []
    structural_visit(expr, [(TensorLoad, lambda node, visitor: found.append(node))])
    return bool(found)


def _wrapping_negative(a: tirx.PrimExpr) -> tirx.PrimExpr:
    """-a with two's-complement wrapping (-INT_MIN is INT_MIN, as torch): ~a + 1 as unsigned,
    since TVM's signed arithmetic is `nsw` (an overflow is undefined to LLVM), and its
    simplifier took an unsigned `0 - a` for 0."""
    unsigned = "u" + str(a.ty)
    return tirx.Cast(str(a.ty), tirx.bitwise_not(tirx.Cast(unsigned, a)) + tirx.const(1, unsigned))


def safe_integer_division(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every integer division by a divisor read from a buffer safe from zero."""

    def division(node: tirx.PrimExpr, mutator: StructuralMutator) -> tirx.PrimExpr:
        node = mutator.default_mutate(node)
        if not isinstance(node, _DIVISIONS) or not str(node.ty).startswith(("int", "uint")) \
                or not _reads_a_buffer(node.b):
            return node
        dtype = str(node.ty)
        zero, one = tirx.const(0, dtype), tirx.const(1, dtype)
        is_zero = node.b == zero
        if dtype.startswith("uint"):
            divided = type(node)(node.a, tirx.Select(is_zero, one, node.b))
            return tirx.Select(is_zero, zero, divided)
        is_minus_one = node.b == tirx.const(-1, dtype)
        divided = type(node)(node.a, tirx.Select(is_zero | is_minus_one, one, node.b))
        if isinstance(node, (tirx.Mod, tirx.FloorMod)):
            return tirx.Select(is_zero | is_minus_one, zero, divided)
        return tirx.Select(is_zero, zero, tirx.Select(is_minus_one, _wrapping_negative(node.a), divided))

    return structural_mutate(func, [(kind, division) for kind in _DIVISIONS])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.SafeIntegerDivision")
class SafeIntegerDivision:
    """Apply `safe_integer_division` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, safe_integer_division)

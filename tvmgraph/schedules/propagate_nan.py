"""PropagateNaN: a float max or min with a NaN operand is NaN, and a float `!=` with one is true,
as in torch.

TVM's `max(a, b)` becomes a compare-and-select on CPU, which returns the other operand when `a`
is NaN: relu, relu6, clamp, hardtanh, maximum and minimum turned NaN into a number (relu(NaN)
was 0, clamp(NaN, -1, 1) was 1), and so did every kernel built on a clamp (the fast exp behind
sigmoid and softmax: sigmoid(NaN) was 0) and max pooling over a window holding NaN. A model
whose activations went NaN then trained on with a finite loss, where eager shows NaN at once.

The pass rewrites every float max and min of every kernel. On AArch64 into LLVM's IEEE 754-2019
`llvm.maximum`/`llvm.minimum` (one instruction). On x86, where LLVM expands those into a max,
compares and blends for NaN and for signed zeros, a max/min of loads, variables and constants
(a reduction's accumulator and element, relu of a load) into selects:

    max(a, b) -> select(isnan(b), b, select(a < b, b, a))      (min: a > b)

The inner select is one vmaxps with a's NaN kept (the compare is false), the outer adds b's;
with a constant operand the inner one is all there is. Other operands stay llvm.maximum.
A softmax over 64 x 65 x 65 floats took 0.26 ms with llvm.maximum, 0.17 ms so, 0.12 ms with
no NaN kept at all (2-vCPU Xeon). BitwiseIsNaN then makes the isnan a vector test of bits.
16-bit floats, which TVM widens to float32 only later, get `select(isnan(a), a, select(isnan(b),
b, max(a, b)))`, leaving out the test of a constant operand.

TVM's float `a != b` is LLVM's ordered `fcmp one`, false where either is NaN (IEEE and torch:
true): `x != 0` of a NaN was False, `count_nonzero` skipped NaN, `where(x != 0, ...)` took the
other branch. Each becomes `a != b or isnan(a) or isnan(b)` (no test of a constant operand).

The converters of amax/amin and argmax/argmin also put right the all -inf rows, which no max
can (tvmgraph/converters_reduce.py). On CPU targets only (CUDA's fmaxf drops NaN too, and its
cross-thread reductions match their reducer: not done here).

Position: after the schedules (tuning logs and default schedules), so tuned kernels and
default ones both get it, tuning records still match the kernels they were made for, and the
schedules still see TVM's own max reducers.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm_ffi.structural import StructuralMutator, structural_mutate

from .loops import rewrite_prim_funcs

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _nan_of(expr: tirx.PrimExpr) -> tirx.PrimExpr | None:
    """isnan(expr) (of its float32 value for 16-bit floats, which TVM's isnan rejects; it
    simplifies `expr != expr` to False), or None for a constant (never NaN in a clamp)."""
    if isinstance(expr, (tirx.FloatImm, tirx.IntImm)):
        return None
    return tirx.isnan(tirx.Cast("float32", expr) if str(expr.ty) in ("float16", "bfloat16") else expr)


def _is_leaf(expr: tirx.PrimExpr) -> bool:
    """A constant, a variable or a buffer load: read twice by the selects at no cost. (Any other
    operand stays an llvm.maximum: the fast erf's clamp, copied into each of its ~25 uses in an
    inlined GELU gradient, made an expression whose bfloat16 build never ended.)"""
    return isinstance(expr, (tirx.FloatImm, tirx.IntImm, tirx.Var, TensorLoad))


def _propagating(node: tirx.Max | tirx.Min, ieee_intrinsics: bool) -> tirx.PrimExpr:
    """The NaN-propagating form of `node` (see the module docstring)."""
    dtype = str(node.ty)
    if dtype in ("float32", "float64") and not ieee_intrinsics and _is_leaf(node.a) and _is_leaf(node.b):
        a, b = (node.b, node.a) if _nan_of(node.a) is None else (node.a, node.b)  # a constant as b
        out: tirx.PrimExpr = tirx.Select(a < b if isinstance(node, tirx.Max) else a > b, b, a)
        nan = _nan_of(b)
        return out if nan is None else tirx.Select(nan, b, out)
    if dtype in ("float32", "float64"):
        name = "llvm.maximum" if isinstance(node, tirx.Max) else "llvm.minimum"
        return tirx.call_llvm_pure_intrin(dtype, name, node.a, node.b)
    out = node
    for operand in (node.b, node.a):
        nan = _nan_of(operand)
        if nan is not None:
            out = tirx.Select(nan, operand, out)
    return out


def _unordered(node: tirx.NE) -> tirx.PrimExpr:
    """`a != b` true where either is NaN (IEEE's and torch's), for float operands."""
    out: tirx.PrimExpr = node
    for operand in (node.a, node.b):
        nan = _nan_of(operand)
        if nan is not None:
            out = tirx.Or(out, nan)
    return out


def propagate_nan(func: tirx.PrimFunc, ieee_intrinsics: bool = False) -> tirx.PrimFunc:
    """`func` with every float max/min NaN-propagating (`ieee_intrinsics`: as llvm.maximum and
    llvm.minimum, for AArch64) and every float `!=` true for NaN."""

    def extremum(node: tirx.Max | tirx.Min, mutator: StructuralMutator) -> tirx.PrimExpr:
        node = mutator.default_mutate(node)
        if not isinstance(node, (tirx.Max, tirx.Min)) or str(node.ty) not in _FLOATS:
            return node
        return _propagating(node, ieee_intrinsics)

    def not_equal(node: tirx.NE, mutator: StructuralMutator) -> tirx.PrimExpr:
        node = mutator.default_mutate(node)
        if not isinstance(node, tirx.NE) or str(node.a.ty).split("x")[0] not in _FLOATS:
            return node
        return _unordered(node)

    return structural_mutate(func, [(tirx.Max, extremum), (tirx.Min, extremum), (tirx.NE, not_equal)])


def has_one_instruction_maximum(target: tvm.target.Target) -> bool:
    """Whether `target` computes llvm.maximum in one instruction (AArch64's fmax)."""
    return str(target.attrs.get("mtriple", "")).startswith(("aarch64", "arm64"))


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.PropagateNaN")
class PropagateNaN:
    """Apply `propagate_nan` to every PrimFunc of the module."""

    def __init__(self, ieee_intrinsics: bool = False) -> None:
        self.ieee_intrinsics = ieee_intrinsics

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, lambda func: propagate_nan(func, self.ieee_intrinsics))

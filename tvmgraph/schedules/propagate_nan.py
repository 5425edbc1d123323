"""PropagateNaN: a float max or min with a NaN operand is NaN, as in torch.

TVM's `max(a, b)` becomes a compare-and-select on CPU, which returns the other operand when `a`
is NaN: relu, relu6, clamp, hardtanh, maximum and minimum turned NaN into a number (relu(NaN)
was 0, clamp(NaN, -1, 1) was 1), and so did every kernel built on a clamp (the fast exp behind
sigmoid and softmax: sigmoid(NaN) was 0) and max pooling over a window holding NaN. A model
whose activations went NaN then trained on with a finite loss, where eager shows NaN at once.

The pass rewrites every float max and min of every kernel into LLVM's IEEE 754-2019
`llvm.maximum`/`llvm.minimum`, which return NaN when either operand is NaN and vectorize
(one instruction on AArch64; a max, an unordered compare and a blend on x86). 16-bit floats,
which TVM widens to float32 only later, get `select(isnan(a), a, select(isnan(b), b, max(a, b)))`
instead, leaving out the test of a constant operand (relu's 0).

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
from tvm_ffi.structural import StructuralMutator, structural_mutate

from .loops import rewrite_prim_funcs

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _nan_of(expr: tirx.PrimExpr) -> tirx.PrimExpr | None:
    """isnan(expr) (of its float32 value for 16-bit floats, which TVM's isnan rejects; it
    simplifies `expr != expr` to False), or None for a constant (never NaN in a clamp)."""
    if isinstance(expr, (tirx.FloatImm, tirx.IntImm)):
        return None
    return tirx.isnan(tirx.Cast("float32", expr) if str(expr.ty) in ("float16", "bfloat16") else expr)


def _propagating(node: tirx.Max | tirx.Min) -> tirx.PrimExpr:
    """The NaN-propagating form of `node`."""
    dtype = str(node.ty)
    if dtype in ("float32", "float64"):
        name = "llvm.maximum" if isinstance(node, tirx.Max) else "llvm.minimum"
        return tirx.call_llvm_pure_intrin(dtype, name, node.a, node.b)
    out: tirx.PrimExpr = node
    for operand in (node.b, node.a):
        nan = _nan_of(operand)
        if nan is not None:
            out = tirx.Select(nan, operand, out)
    return out


def _extremum(node: tirx.Max | tirx.Min, mutator: StructuralMutator) -> tirx.PrimExpr:
    node = mutator.default_mutate(node)
    if not isinstance(node, (tirx.Max, tirx.Min)) or str(node.ty) not in _FLOATS:
        return node
    return _propagating(node)


def propagate_nan(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every float max/min NaN-propagating."""
    return structural_mutate(func, [(tirx.Max, _extremum), (tirx.Min, _extremum)])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.PropagateNaN")
class PropagateNaN:
    """Apply `propagate_nan` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, propagate_nan)

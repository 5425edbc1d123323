"""BoolOrder: max, min and the comparisons of booleans as logic.

TVM 0.27's LLVM code generator compares `bool` values as floats (its order checks a float type
and raises "Check failed: t.MatchesCode(kDLFloat)"; `==` emits an `fcmp` of `i1`, which LLVM
rejects): `torch.clamp`, `clamp_min`, `clamp_max`, `heaviside` and `index_reduce` (amax, amin)
of bool tensors failed to compile (the bool OpInfo sweep). With False < True:

    max(a, b) = a or b        min(a, b) = a and b
    a < b = not a and b       a <= b = not a or b       (a > b, a >= b: the same, swapped)
    a != b = (a and not b) or (not a and b)             a == b = not (a != b)

Any target, after the schedules (a scheduled reduction keeps TVM's own max reducer).
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm_ffi.structural import StructuralMutator, structural_mutate

from .loops import rewrite_prim_funcs


def _bools(node: tirx.PrimExpr) -> bool:
    return str(node.a.ty).startswith("bool") and str(node.b.ty).startswith("bool")


def _as_logic(node: tirx.PrimExpr) -> tirx.PrimExpr:
    a, b = node.a, node.b
    if isinstance(node, tirx.Max):
        return tirx.Or(a, b)
    if isinstance(node, tirx.Min):
        return tirx.And(a, b)
    if isinstance(node, (tirx.NE, tirx.EQ)):
        differ = tirx.Or(tirx.And(a, tirx.Not(b)), tirx.And(tirx.Not(a), b))
        return differ if isinstance(node, tirx.NE) else tirx.Not(differ)
    if isinstance(node, (tirx.GT, tirx.GE)):
        a, b = b, a
    return tirx.And(tirx.Not(a), b) if isinstance(node, (tirx.LT, tirx.GT)) else tirx.Or(tirx.Not(a), b)


def _rewrite(node: tirx.PrimExpr, mutator: StructuralMutator) -> tirx.PrimExpr:
    node = mutator.default_mutate(node)
    return _as_logic(node) if isinstance(node, _ORDERED) and _bools(node) else node


_ORDERED = (tirx.Max, tirx.Min, tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ, tirx.NE)


def bool_order(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each max, min and comparison of booleans written as logic."""
    return structural_mutate(func, [(kind, _rewrite) for kind in _ORDERED])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.BoolOrder")
class BoolOrder:
    """Apply `bool_order` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, bool_order)

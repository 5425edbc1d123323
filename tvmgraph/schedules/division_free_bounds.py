"""DivisionFreeBounds: `x // c < n` becomes `x < c * n`, so that a bounds test vectorizes.

A matmul or convolution over a dynamic batch pads its symbolic axis to whole register tiles and
stores the tile back under a predicate that the padding names by the output's first index:
`(j // 64) < n` for a (n, 192, 8, 8) result read as J = n * 64. With a constant n TVM's simplifier
turns that into `j < 4096`, then into a test on the vector's base index alone; with a symbolic n
it keeps the division, the test depends on every lane, and the vectorized store runs one lane at
a time: a CNN's dynamic-batch convolution gradients took 2-4x their static time.

For an integer c > 0 and any integer n, `x // c < n` holds exactly when `x < c * n` (floor
division), and `x // c >= n` exactly when `x >= c * n`. CPU targets, after the schedules.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm_ffi.structural import StructuralMutator, structural_mutate

from .loops import rewrite_prim_funcs


def _positive_divisor(expr: tirx.PrimExpr) -> tuple[tirx.PrimExpr, tirx.IntImm] | None:
    """(x, c) when `expr` is `x // c` (floor division) with a constant c > 0."""
    if isinstance(expr, tirx.FloorDiv) and isinstance(expr.b, tirx.IntImm) and int(expr.b) > 0:
        return expr.a, expr.b
    return None


def _compare(node: tirx.LT | tirx.GE, mutator: StructuralMutator) -> tirx.PrimExpr:
    node = mutator.default_mutate(node)
    if not isinstance(node, (tirx.LT, tirx.GE)):
        return node
    division = _positive_divisor(node.a)
    if division is None:
        return node
    x, c = division
    bound = c * node.b
    return tirx.LT(x, bound) if isinstance(node, tirx.LT) else tirx.GE(x, bound)


def division_free_bounds(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every `x // c < n` (and `>=`) a comparison of x itself."""
    return structural_mutate(func, [(tirx.LT, _compare), (tirx.GE, _compare)])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.DivisionFreeBounds")
class DivisionFreeBounds:
    """Apply `division_free_bounds` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, division_free_bounds)

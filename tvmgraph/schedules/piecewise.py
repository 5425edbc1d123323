"""Piecewise rows: a spatial block whose value switches between operands at constant points of
its last axis runs as one vectorized loop per piece.

A concatenation along the last axis, and the gradient of a split written as padded slices
added (`pad(dq) + pad(dk) + pad(dv)` for a fused QKV projection), lower to one block whose
value is a sum or chain of `if_then_else(128 <= j and j < 256, ..., 0)` on its last index
`j`. Vectorized as it stands, each lane would take a different branch; TVM's elementwise
schedule left the ViT's (1040, 384) QKV gradient serial: 351 us, 17% of the memory bandwidth.
Cut at 128 and 256 (`loop_partition` of the vector loop), every piece has conditions that
hold or fail for all of it, which TVM's simplifier folds before it vectorizes: 72 us, same
numbers.

Applies when every condition in the value that mentions `j` is a conjunction of comparisons
of `j` with constants, the points fall on whole vectors, the output is contiguous along `j`
and other loops run in parallel around it (a 1-D concatenation is left whole, parallel); any
other block is left to `loops.schedule_spatial`.
"""

from __future__ import annotations

import tvm.ir.expr as E
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV
from tvm_ffi.structural import structural_visit

from .loops import iter_kinds, parallelize, row_iterator, static_extent, vars_in

_IF_THEN_ELSE = ("tirx.if_then_else", "prim.if_then_else")
# (comparison, constant on the right) -> the first index of the next piece, for `j OP c`
_CUT_RIGHT = {tirx.LT: 0, tirx.GE: 0, tirx.LE: 1, tirx.GT: 1}
# `c OP j`: c < j starts at c + 1, c <= j at c
_CUT_LEFT = {tirx.LT: 1, tirx.LE: 0, tirx.GT: 0, tirx.GE: 1}


def schedule_piecewise(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> bool:
    """Schedule `block` piece by piece along its last loop (see the module docstring); False,
    changing nothing, when it does not apply."""
    kinds = iter_kinds(sch, block)
    loops = sch.get_loops(block)
    # One loop alone would run serial: its rows are what the parallel loop splits.
    if kinds is None or "R" in kinds or len(loops) < 2 or len(sch.get(block).writes) != 1:
        return False
    extent = static_extent(sch, loops[-1])
    var = row_iterator(sch, block, loops[-1])
    if extent is None or var is None or extent % lanes or extent < 2 * lanes:
        return False
    cuts = _cuts(sch.get(block).body, var, extent)
    if not cuts or any(cut % lanes for cut in cuts):
        return False
    bounds = [0, *cuts, extent]
    vectors = [(hi - lo) // lanes for lo, hi in zip(bounds, bounds[1:])]
    trial = sch.copy()  # a primitive that fails halfway must not leave the block half cut
    try:
        _cut(trial, block, lanes, vectors)
    except s_tir.ScheduleError:
        return False
    _cut(sch, block, lanes, vectors)
    return True


def _cut(sch: s_tir.Schedule, block: SBlockRV, lanes: int, vectors: list[int]) -> None:
    loops = sch.get_loops(block)
    parallelize(sch, loops[:-1], static_extent(sch, loops[-1]) or 1)
    outer, lane = sch.split(sch.get_loops(block)[-1], [None, lanes])
    sch.vectorize(lane)
    sch.loop_partition(outer, factors=[*vectors[:-1], None])


def _cuts(body: tirx.Stmt, var: tirx.Var, extent: int) -> list[int] | None:
    """The points strictly inside (0, extent) where a condition on `var` changes, or None when
    some condition on `var` is not a conjunction of comparisons with constants."""
    conditions: list[tirx.PrimExpr] = []

    def on_call(node: E.Call, visitor) -> None:
        if getattr(node.op, "name", "") in _IF_THEN_ELSE:
            conditions.append(node.args[0])
        visitor.default_visit(node)

    def on_select(node: tirx.Select, visitor) -> None:
        conditions.append(node.condition)
        visitor.default_visit(node)

    structural_visit(body, [(E.Call, on_call), (tirx.Select, on_select)])
    cuts: set[int] = set()
    for condition in conditions:
        for atom in _conjuncts(condition):
            if not _mentions(atom, var):
                continue
            cut = _cut_point(atom, var)
            if cut is None:
                return None
            if 0 < cut < extent:
                cuts.add(cut)
    return sorted(cuts)


def _conjuncts(expr: tirx.PrimExpr) -> list[tirx.PrimExpr]:
    if isinstance(expr, tirx.And):
        return _conjuncts(expr.a) + _conjuncts(expr.b)
    return [expr]


def _mentions(expr: tirx.PrimExpr, var: tirx.Var) -> bool:
    return any(used.same_as(var) for used in vars_in(expr))


def _cut_point(atom: tirx.PrimExpr, var: tirx.Var) -> int | None:
    """`var OP c` or `c OP var` with a constant c: the index where the comparison flips."""
    for kind in _CUT_RIGHT:
        if isinstance(atom, kind):
            if atom.a.same_as(var) and isinstance(atom.b, tirx.IntImm):
                return int(atom.b.value) + _CUT_RIGHT[kind]
            if atom.b.same_as(var) and isinstance(atom.a, tirx.IntImm):
                return int(atom.a.value) + _CUT_LEFT[kind]
    return None

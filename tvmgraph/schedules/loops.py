"""Loop-nest helpers shared by the CPU rules: inspect a block's loops, inline, parallelize, vectorize.

Every helper works on a block that sits directly under the root block with one loop per block
iterator (a "trivial binding"), which is how `LegalizeOps` and `FuseTIR` emit them. Helpers that
transform loops skip blocks that do not have that shape instead of failing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import tvm
import tvm.ir.expr as E
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.dlight.analysis import collect_vars_used_in_prim_expr, get_root_block
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.sym import Analyzer
from tvm_ffi.structural import VisitInterrupt, structural_mutate, structural_walk

# Below this many elements a parallel region costs more than it saves: waking the TVM thread
# pool takes 6-10 us on the 2-core Zen 5 test machine, while one core adds 256K floats to
# 256K floats in about 30 us (measured with benchmarks/kernels.py's harness).
MIN_PARALLEL_ELEMENTS = 1 << 18


def element_bytes(dtype: object) -> int:
    """Bytes per element of a buffer's dtype."""
    return tvm.DataType(str(dtype)).bits // 8


def enough_per_thread(iterations: int, per_thread: int, threads: int | None = None) -> bool:
    """Whether a parallel loop of `iterations` unequal ones gives each of `threads` (default:
    this machine's CPUs) at least `per_thread` of them."""
    return iterations >= per_thread * (threads or os.cpu_count() or 1)


def root_blocks(sch: s_tir.Schedule) -> list[SBlockRV]:
    """The blocks directly under the root block of `sch`'s main function, in program order."""
    return sch.get_child_blocks(get_root_block(sch))


def is_spatial(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """True when every iterator of `block` is data-parallel."""
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def static_extent(sch: s_tir.Schedule, loop: LoopRV) -> int | None:
    """The loop's trip count when it is a constant, else None."""
    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


# A symbolic size (a dynamic batch) is weighed at this value of its variable wherever a number is
# needed: by the schedules (work for threads, a tile, panels), so that a dynamic graph's kernels
# at batch 64 are scheduled as the static graph's (counted as 1, its batch-norm statistics ran on
# one core), and by the memory passes (live bytes, the plan to beat). The batch the benchmarks use.
REFERENCE_BATCH = 64


def at_reference_batch(size: tirx.PrimExpr) -> int | None:
    """`size` with every symbolic variable at REFERENCE_BATCH (n * 1024 -> 65536); None when it
    does not simplify to a constant."""
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(size):
        analyzer.bind(var, tirx.IntImm("int64", REFERENCE_BATCH))  # Relax shape variables are int64
    value = analyzer.simplify(size)
    return int(value) if isinstance(value, tirx.IntImm) else None


def work_extent(sch: s_tir.Schedule, loop: LoopRV) -> int:
    """The loop's trip count for estimates: its constant extent, else its extent at
    REFERENCE_BATCH."""
    extent = sch.get(loop).extent
    if isinstance(extent, tirx.IntImm):
        return int(extent)
    value = at_reference_batch(extent)
    return REFERENCE_BATCH if value is None else max(1, value)


def iter_kinds(sch: s_tir.Schedule, block: SBlockRV) -> str | None:
    """'S'/'R' per loop of a block bound one loop per iterator, e.g. "SSR"; None otherwise."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    if not loops or len(loops) != len(stmt.iter_vars):
        return None
    realize = sch.get(loops[-1]).body
    if not isinstance(realize, s_tir.SBlockRealize) or not realize.block.same_as(stmt):
        return None
    kinds = []
    for loop, value, iv in zip(loops, realize.iter_values, stmt.iter_vars):
        if not value.same_as(sch.get(loop).loop_var):
            return None
        if iv.iter_type == tirx.IterVar.DataPar:
            kinds.append("S")
        elif iv.iter_type == tirx.IterVar.CommReduce:
            kinds.append("R")
        else:
            return None
    return "".join(kinds)


def loop_binding(sch: s_tir.Schedule, block: SBlockRV, var: tirx.Var) -> LoopRV | None:
    """The innermost loop around `block` whose variable the binding of iterator `var` uses."""
    loops = sch.get_loops(block)
    if not loops:
        return None
    realize = sch.get(loops[-1]).body
    if not isinstance(realize, s_tir.SBlockRealize):
        return None
    stmt = sch.get(block)
    for iv, value in zip(stmt.iter_vars, realize.iter_values):
        if iv.var.same_as(var):
            used = vars_in(value)
            for loop in reversed(loops):
                if sch.get(loop).loop_var in used:
                    return loop
    return None


def is_scheduled(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """True when some loop around `block` is already parallel, vectorized or unrolled."""
    plain = (tirx.ForKind.SERIAL,)
    return any(sch.get(loop).kind not in plain for loop in sch.get_loops(block))


def reads_at_its_own_indices(sch: s_tir.Schedule, block: SBlockRV, producers: list[SBlockRV]) -> bool:
    """Whether `block` reads every buffer that `producers` write at plain block variables (in
    any order): then `reverse_compute_at` of it into a tile of the producers covers exactly the
    elements the tile computed. Through a reshape, `(i * 5 + j) % 10` of a product padded to
    whole tiles of 6 rows, TVM's cover missed most of them (even simplified to `i * 5 + j`:
    rows 0-5 are no rectangle in (i, j)), and the output was never written there (a Linear on
    flattened rows, reshaped back, with the pre-reshape value also a result of the kernel)."""
    written = [region.source for p in producers for region in sch.get(p).writes]
    stmt = sch.get(block)
    for region in stmt.reads:
        if not any(region.source.same_as(b) for b in written):
            continue
        if not all(is_own_iterator(axis.min, stmt) for axis in region.region):
            return False
    return True


def is_own_iterator(index: tirx.PrimExpr, block: s_tir.SBlock) -> bool:
    """Whether `index` is one of `block`'s iterators itself (not an expression of them)."""
    return isinstance(index, tirx.Var) and any(index.same_as(iv.var) for iv in block.iter_vars)


def inline_spatial_blocks(
    sch: s_tir.Schedule, keep: tuple[SBlockRV, ...] = (), into_reductions: bool = False
) -> None:
    """Inline every spatial block that can be inlined (into consumers first, then producers).

    Blocks listed in `keep` stay. With `into_reductions`, a block also goes into a reduction
    that is its only consumer and reads it element for element (each value is still computed
    once); otherwise reductions get nothing inlined. Repeats until nothing changes, so chains
    of element-wise blocks collapse into the block writing the output.
    """
    kept = [sch.get(b) for b in keep]
    changed = True
    while changed:
        changed = False
        for block in root_blocks(sch):
            if any(sch.get(block).same_as(k) for k in kept) or not is_spatial(sch, block):
                continue
            if _try_inline(sch, block, into_reductions):
                changed = True
                break


# Inlining copies a block's expression into each read of its result. A chain of element-wise
# steps that each read the previous one several times (`h = sigmoid(h) * h + x[:, t]` in a
# Python loop, a CTC recursion) then grows exponentially: 8 such steps never finished
# compiling. When a block of more than MAX_COPIED_NODES nodes is read more than once, the rules
# give the function up (InliningBlowUp): it is built as written, each block computed into its
# own buffer, serial. Materializing only that block was not enough: the blocks after it grew
# again, and LLVM's code generation never finished.
MAX_COPIED_NODES = 2000
MAX_WALKED_NODES = 20_000


class InliningBlowUp(Exception):
    """Inlining a block would copy a large expression into several reads."""


def _try_inline(sch: s_tir.Schedule, block: SBlockRV, into_reductions: bool) -> bool:
    consumers = sch.get_consumers(block)
    if _inlining_copies_too_much(sch, block, consumers):
        raise InliningBlowUp(f"block {sch.get(block).name_hint} has over {MAX_COPIED_NODES} nodes and is read "
                             f"more than once: inlining it would copy them into each read")
    spatial = all(is_spatial(sch, c) for c in consumers)
    if spatial or (into_reductions and _read_pointwise_once(sch, block, consumers)):
        try:
            sch.compute_inline(block)
            return True
        except s_tir.ScheduleError:
            pass
    try:
        sch.reverse_compute_inline(block)
        return True
    except s_tir.ScheduleError:
        return False


def _inlining_copies_too_much(sch: s_tir.Schedule, block: SBlockRV, consumers: list[SBlockRV]) -> bool:
    """Whether `block`'s expression has more than MAX_COPIED_NODES nodes and `consumers` read
    it more than once. The consumers are walked as trees, which shared subexpressions can make
    exponential: past MAX_WALKED_NODES nodes, a consumer counts as reading it again."""
    store = sch.get(block).body
    if not isinstance(store, tirx.BufferStore) or not _has_more_nodes(store.value, MAX_COPIED_NODES):
        return False
    buffer, reads, walked = store.buffer, 0, 0

    def on_node(node: object) -> VisitInterrupt | None:
        nonlocal reads, walked
        walked += 1
        reads += isinstance(node, TensorLoad) and node.source.same_as(buffer)
        return VisitInterrupt() if reads > 1 or walked > MAX_WALKED_NODES else None

    return any(structural_walk(sch.get(consumer).body, on_node, order="pre") is not None for consumer in consumers)


def _has_more_nodes(expr: tirx.PrimExpr, limit: int) -> bool:
    """Whether `expr`, as a tree, has more than `limit` nodes (stops counting there)."""
    count = 0

    def on_node(_node: object) -> VisitInterrupt | None:
        nonlocal count
        count += 1
        return VisitInterrupt() if count > limit else None

    return structural_walk(expr, on_node, order="pre") is not None


def _read_pointwise_once(sch: s_tir.Schedule, block: SBlockRV, consumers: list[SBlockRV]) -> bool:
    """A single consumer that indexes `block`'s output with plain iterators only."""
    if len(consumers) != 1:
        return False
    written = sch.get(block).writes
    if len(written) != 1:
        return False
    for region in sch.get(consumers[0]).reads:
        if region.source.same_as(written[0].source):
            if not all(isinstance(r.min, (tirx.Var, tirx.IntImm)) for r in region.region):
                return False
    return True


def inline_copies_into(sch: s_tir.Schedule, main: SBlockRV) -> None:
    """Inline producers of `main` that only copy (a 1x1 convolution's zero-width padding, a
    dilation by 1, a reshape) into it, even when `main` reduces: it then reads their source in
    place. Repeats, so chains of copies collapse too."""
    changed = True
    while changed:
        changed = False
        for block in sch.get_producers(main):
            stmt = sch.get(block)
            if not (is_spatial(sch, block) and isinstance(stmt.body, tirx.BufferStore)
                    and isinstance(stmt.body.value, TensorLoad)):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                continue
            changed = True
            break


def vectorize_innermost(sch: s_tir.Schedule, loop: LoopRV, lanes: int) -> LoopRV | None:
    """Vectorize `loop` by `lanes` (splitting it first); the outer part is returned.

    Falls back to the widest power of two that divides the extent, and leaves the loop alone
    when that is below 4 lanes: a partial vector would need a tail loop.
    """
    extent = static_extent(sch, loop)
    if extent is None:
        return None
    width = lanes
    while width >= 4 and extent % width:
        width //= 2
    if width < 4:
        return None
    if extent == width:
        sch.vectorize(loop)
        return None
    outer, inner = sch.split(loop, [None, width])
    sch.vectorize(inner)
    return outer


def row_iterator(sch: s_tir.Schedule, block: SBlockRV, loop: LoopRV) -> tirx.Var | None:
    """The block iterator that `loop` alone drives and that indexes the last axis of the block's
    (first) output: the output is contiguous along the loop. None if there is none."""
    stmt = sch.get(block)
    realize = sch.get(loop).body
    if not isinstance(realize, s_tir.SBlockRealize) or not stmt.writes:
        return None
    bound = {iv.var: value for iv, value in zip(stmt.iter_vars, realize.iter_values)}
    last = stmt.writes[0].region[-1].min
    if isinstance(last, tirx.Var) and last in bound and bound[last].same_as(sch.get(loop).loop_var):
        return last
    return None


def vectorize_tails(sch: s_tir.Schedule, lanes_of) -> None:
    """Vectorize the rows that `vectorize_innermost` left serial because no vector divides
    them: the innermost loop of a spatial block, with a static extent above two vectors
    and not a multiple of it, that walks the block's output contiguously. The loop is cut
    (`loop_partition`) into whole vectors, vectorized, and a serial tail of fewer than `lanes`.

    Rows of such lengths are common: a ViT's 65 tokens (64 patches and a class token), whose
    softmax computed every exp one float at a time. Call it last: the cut wraps the block's
    two parts in blocks of their own, which other primitives do not see through.
    """
    for block in root_blocks(sch):
        stmt = sch.get(block)
        loops = sch.get_loops(block)
        if not loops or not stmt.writes or any(iv.iter_type != tirx.IterVar.DataPar for iv in stmt.iter_vars):
            continue
        loop = sch.get(loops[-1])
        lanes = lanes_of(block)
        extent = static_extent(sch, loops[-1])
        # NOTE: rows of at most two vectors stay serial: TVM's loop_partition failed inside on a
        # 10-class log_softmax (a buffer rank check), and there is little to win.
        if (loop.kind != tirx.ForKind.SERIAL or extent is None or extent <= 2 * lanes
                or extent % lanes == 0 or not isinstance(loop.body, s_tir.SBlockRealize)):
            continue
        # Contiguous: the output's last index is the block iterator this loop alone drives.
        if row_iterator(sch, block, loops[-1]) is None:
            continue
        try:
            vectors, _ = sch.loop_partition(loops[-1], factors=[extent - extent % lanes, None])
            _, lane = sch.split(vectors, [None, lanes])
            sch.vectorize(lane)
        except s_tir.ScheduleError:  # a failing primitive changes nothing; a cut left serial computes the same
            continue


def parallelize(sch: s_tir.Schedule, loops: list[LoopRV], work_per_iter: int) -> LoopRV | None:
    """Fuse `loops` (outermost first) and mark the result parallel if there is enough work."""
    if not loops:
        return None
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    extent = static_extent(sch, fused)
    if extent is not None and (extent < 2 or extent * work_per_iter < MIN_PARALLEL_ELEMENTS):
        return fused
    sch.parallel(fused)
    return fused


def schedule_spatial(sch: s_tir.Schedule, block: SBlockRV, lanes: int, by_rows: bool = False) -> bool:
    """Fuse all loops of an all-spatial block, vectorize the tail, parallelize the head.

    A block that reads some buffer transposed (a transpose, or an add of a transposed
    operand) is tiled instead; see `_schedule_transposed`. With `by_rows`, rows that no vector
    divides and along which some operand is constant (a per-channel scale) are left serial,
    their heads parallel, for `vectorize_tails` to cut: see `_broadcast_along_ragged_rows`.
    """
    kinds = iter_kinds(sch, block)
    if kinds is None or "R" in kinds:
        return False
    loops = sch.get_loops(block)
    if is_padding(sch, block):
        # A zero fill, then a branch-free copy of the interior: both vectorize.
        try:
            fill = sch.decompose_padding(block, loops[0])
        except s_tir.ScheduleError:
            pass
        else:
            schedule_spatial(sch, fill, lanes)
            return schedule_spatial(sch, block, lanes)
    axis = _transposed_axis(sch, block)
    if axis is not None:
        _schedule_transposed(sch, block, axis, lanes)
        return True
    # Fuse just enough trailing loops to fill whole vectors: the index arithmetic of a short
    # fused tail stays simple enough for the vectorizer to see contiguous accesses.
    extents = [static_extent(sch, loop) for loop in loops]
    if by_rows and _broadcast_along_ragged_rows(sch, block, extents[-1], lanes):
        parallelize(sch, loops[:-1], extents[-1] or 1)
        return True
    split = len(loops) - 1
    tail = extents[-1] or 0
    while split > 0 and extents[split - 1] is not None and (tail < lanes or tail % lanes):
        split -= 1
        tail *= extents[split]
    inner = sch.fuse(*loops[split:]) if len(loops) - split > 1 else loops[split]
    outer = vectorize_innermost(sch, inner, lanes)
    heads = sch.get_loops(block)[: split + (1 if outer is not None else 0)]
    if outer is None and sch.get(inner).kind != tirx.ForKind.VECTORIZED:
        heads = sch.get_loops(block)
    work = work_extent(sch, sch.get_loops(block)[-1])
    parallelize(sch, list(heads), work)
    return True


def _broadcast_along_ragged_rows(sch: s_tir.Schedule, block: SBlockRV, row: int | None, lanes: int) -> bool:
    """Rows of more than two vectors that no vector divides, and an operand read at the same
    index all along a row (a batch norm's per-channel mean and scale over (N, C, L) rows).
    Fused across rows to fill whole vectors, that operand's index changes within a vector and
    each lane gathers it: a raw-audio net's batch norm + ReLU over (16, 32, 1981) ran at 25% of
    the memory bandwidth. Row by row it is one broadcast."""
    if row is None or row <= 2 * lanes or row % lanes == 0:
        return False
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    realize = sch.get(loops[-1]).body
    if not isinstance(realize, s_tir.SBlockRealize):
        return False
    along = {iv.var for iv, value in zip(stmt.iter_vars, realize.iter_values)
             if sch.get(loops[-1]).loop_var in vars_in(value)}
    return any(not any(along & vars_in(axis.min) for axis in read.region) for read in stmt.reads)


def is_padding(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """out[...] = if_then_else(in bounds, in[...], constant): a padding block."""
    body = sch.get(block).body
    if not isinstance(body, tirx.BufferStore):
        return False
    value = body.value
    return (
        isinstance(value, E.Call)
        and getattr(value.op, "name", "") in ("tirx.if_then_else", "prim.if_then_else")
        and isinstance(value.args[2], (tirx.FloatImm, tirx.IntImm))
    )


def schedule_leading_spatial(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Parallelize the spatial loops in front of a reduction block's first reduction loop."""
    kinds = iter_kinds(sch, block)
    if kinds is None:
        return False
    loops = sch.get_loops(block)
    leading = len(kinds) - len(kinds.lstrip("S"))
    if leading == 0:
        return False
    inner = 1
    for loop in loops[leading:]:
        inner *= work_extent(sch, loop)
    parallelize(sch, loops[:leading], inner)
    return True


def with_functions(mod: tvm.IRModule, updates: dict[tvm.ir.GlobalVar, tvm.ir.BaseFunc]) -> tvm.IRModule:
    """A new module: `mod`'s functions with `updates` in place (`mod` itself when empty).
    NOTE: `mod[gvar] = func` would change the caller's module in place."""
    if not updates:
        return mod
    return tvm.IRModule({**dict(mod.functions_items()), **updates}, attrs=mod.attrs, global_infos=mod.global_infos)


def rewrite_prim_funcs(mod: tvm.IRModule, rewrite) -> tvm.IRModule:
    """`mod` with `rewrite(func)` in place of each PrimFunc (`mod` itself when none changed)."""
    updates = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            new = rewrite(func)
            if not new.same_as(func):
                updates[gvar] = new
    return with_functions(mod, updates)


def simplify_indices(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every block's indices simplified under its iterators' ranges.

    Legalized reshapes index with `(i * 64 + j) // 2048`-style expressions that only simplify
    once the ranges of i and j are known; inlining a chain of reshapes and transposes stacks
    them, and the rules' layout checks (which loop a read is contiguous along) then fail.
    """
    return _SIMPLIFY(tvm.IRModule({"main": func}))["main"]


_SIMPLIFY = s_tir.transform.StmtSimplify()


def contains(node: object, kind: type, test: Callable[[object], bool] | None = None) -> bool:
    """Whether the TIR expression or statement `node` holds a node of type `kind` (a load, a `%`)
    for which `test` holds (any, without one); the search goes on inside those it fails."""
    found = []

    def visit(sub, mutator):
        if test is not None and not test(sub):
            return mutator.default_mutate(sub)
        found.append(sub)
        return sub

    structural_mutate(node, [(kind, visit)])
    return bool(found)


def vars_in(expr: tirx.PrimExpr) -> set[tirx.Var]:
    """The variables `expr` uses."""
    return collect_vars_used_in_prim_expr(expr)


def _transposed_axis(sch: s_tir.Schedule, block: SBlockRV) -> int | None:
    """Loop position p such that some read walks the innermost loop with a stride and is
    contiguous along loop p instead (read[..., v_last, ..., v_p]); None if no read does."""
    stmt = sch.get(block)
    ivars = [iv.var for iv in stmt.iter_vars]
    if len(ivars) < 2:
        return None
    inner = ivars[-1]
    for region in stmt.reads:
        indices = [r.min for r in region.region]
        if not indices:
            continue
        last_vars = vars_in(indices[-1])
        if inner in last_vars or not any(inner in vars_in(i) for i in indices[:-1]):
            continue
        # The innermost iterator in the read's last index is the one it is contiguous along
        # (a merged-heads index such as h * 64 + d names h too).
        for pos in range(len(ivars) - 2, -1, -1):
            if ivars[pos] in last_vars:
                return pos
    return None


# A transpose moves TILE x TILE squares: TILE rows of the source stay in L1 while the
# destination is written one vector row at a time.
TRANSPOSE_TILE = 16


def _schedule_transposed(sch: s_tir.Schedule, block: SBlockRV, axis: int, lanes: int) -> None:
    """Tile loops `axis` and innermost by TRANSPOSE_TILE, vectorize the innermost tile loop."""
    loops = sch.get_loops(block)
    tile = TRANSPOSE_TILE
    a_ext, z_ext = static_extent(sch, loops[axis]), static_extent(sch, loops[-1])
    if a_ext is None or z_ext is None or a_ext % tile or z_ext < tile:
        parallelize(sch, loops[:-1], work_extent(sch, loops[-1]))
        return
    ao, ai = sch.split(loops[axis], [None, tile])
    zo, zi = sch.split(loops[-1], [None, tile])
    others = [l for n, l in enumerate(loops[:-1]) if n != axis]
    sch.reorder(*others, ao, zo, ai, zi)
    if z_ext % tile:
        # A ragged last column of tiles (a ViT's 65 tokens): the whole tiles are cut off from
        # it and vectorized, the last one runs serial. Untiled, the 64 x 32 x 65 transpose of
        # its attention's keys took 0.5 ms, each read a page away from the one before.
        parallelize(sch, [*others, ao], tile * z_ext)
        whole, _ = sch.loop_partition(zo, factors=[z_ext // tile, None])
        (block,) = sch.get_child_blocks(whole)
        zi = sch.get_loops(block)[-1]
    else:
        parallelize(sch, [*others, ao, zo], tile * tile)
    if tile % lanes == 0 or lanes % tile == 0:
        sch.vectorize(zi) if lanes >= tile else sch.vectorize(sch.split(zi, [None, lanes])[1])

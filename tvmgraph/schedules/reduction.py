"""Reductions: softmax, layer_norm, mean/sum/max along any axes, batch-norm statistics.

Matches any PrimFunc with a reduction block that the matmul and convolution rules left alone.
Spatial blocks are first inlined into spatial consumers, and into a reduction when it is their
only consumer and reads them element for element (so `(x - mean)^2` folds into the variance
sum, but the `exp` of a softmax, read twice, stays materialized). Then one of three schedules:

Row fusion (softmax, layer_norm, mean over trailing axes): when every block starts with the
same spatial "row" loops, the rows run in parallel and every block is computed at the row
loop, so a row is read from cache by each block in turn. Reductions along the row are
vectorized with rfactor: up to ROW_CHAINS vectors of partial results (independent chains of
additions), added into one vector, whose lanes are summed at the end.

Channel by channel (training batch-norm: its mean and variance over N, H, W of NCHW and the
normalization, all reading x): when every reduction keeps one axis, every other block reads
their results at that axis, and some block reads again an input an earlier one read, all the
blocks run under one parallel loop over that axis (`_schedule_channels`), so each channel's
data comes from memory once and from cache after.

Block by block (everything else, e.g. a channel mean applied to another tensor, and bias
gradients summed over the batch axis): each loop nest is scheduled on its own. A
reduction whose input is contiguous along a reduced axis gets the rfactor vectorization; one
whose input is contiguous along a kept axis ("column" reduction, `dy.sum(0)`) loops over the
reduced axes outside and vectorizes the kept axis inside, parallel over chunks of it (a kept
extent that no vector divides, a 1-D max pooling's 495 windows: whole vectors, then a serial
tail). A column over at least CHUNKED_FROM rows is first summed in chunks of about sqrt(rows)
rows (`_column_chunks`), in parallel, then the chunks' sums.

Long sums keep their digits: one chain of float32 additions over 1e5-1e6 values far from zero
loses them (`x.var(0)` of (1e6, 4) values of 1e3 + randn came out 80 for 1). Besides the
columns' chunks, a row whose chains would each add more than LONG_CHAINS_FROM elements is
first cut into chunks (`_chunk_long_row`), and a row of RAGGED_ROWS_FROM or more that no vector
divides is still summed in chains, the last vector partial (`_rfactor_row`; block by block,
since TVM's compute_at drops the predicate that this takes).

A reduction of a whole tensor to one value (a loss) is first cut into chunks of about
sqrt(lanes * n) elements (`_chunk_partials`): each chunk is then a row, summed as above, in
parallel, and the chunks' sums are added at the end. One chain of float32 additions over the
tensor (or `lanes` chains) lost digits: an MSE loss was off by 5e-5 of its value.

Last, every element-wise row that no vector divides (a softmax's exp over a ViT's 65 tokens)
is cut into whole vectors and a serial tail (`loops.vectorize_tails`).

Limits: rfactor needs the contiguous reduced extent to be a multiple of 4 below
RAGGED_ROWS_FROM (a row of 65 is summed serially); a symbolic reduced axis (a dynamic batch)
must come before the static ones that the vector runs along, and is neither chunked in rows
nor in columns; a long row that no divisor cuts into chunks keeps long chains (a ragged row of
500009: 15,600 additions per chain, 9e-5 of the layer norm's output off; eager 7e-6).
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.sym import Analyzer
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.target import Target

from .unchecked import Schedule
from .chunk_sizes import divisor_between
from .cpu_target import CPUTarget, is_cpu
from .loops import (
    REFERENCE_BATCH,
    element_bytes,
    enough_per_thread,
    inline_spatial_blocks,
    is_padding,
    is_spatial,
    iter_kinds,
    loop_binding,
    parallelize,
    root_blocks,
    schedule_leading_spatial,
    schedule_spatial,
    static_extent,
    vars_in,
    vectorize_innermost,
    vectorize_tails,
    work_extent,
)


class Reduction(ScheduleRule):
    """Parallel, vectorized reductions, fused per row when the blocks allow it."""

    # Schedules only a kernel with a reduction block (ApplyCPUSchedules tries it on no other).
    needs_reduction = True

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when the PrimFunc has no reduction block."""
        if not is_cpu(target):
            return None
        cpu = CPUTarget.from_target(target)
        sch = _scheduled(func, cpu)
        if sch is not None:
            vectorize_tails(sch, lambda block: _lanes(sch, block, cpu))
        return sch


def _scheduled(func: tirx.PrimFunc, cpu: CPUTarget) -> s_tir.Schedule | None:
    """One of the module docstring's three schedules, or None without a reduction."""
    sch = _prepared(func)
    if sch is None:
        return None
    # NOTE: both fusions leave `sch` untouched when they return False; only a failure
    # half-way needs a fresh one.
    try:
        if _schedule_rows(sch, cpu):
            return sch
    except s_tir.ScheduleError:
        sch = _prepared(func)
    try:
        if _schedule_channels(sch, cpu):
            return sch
    # NOTE: not only ScheduleError: TVM's rfactor has raised InternalError on shapes this
    # rule did not foresee; the block-by-block schedule below is the fallback for any.
    except Exception:  # noqa: BLE001
        sch = _prepared(func)
    for block in root_blocks(sch):
        lanes = _lanes(sch, block, cpu)
        if is_spatial(sch, block):
            # (a layer norm's normalization over rows no vector divides, left out of the row
            # fusion: fused across rows, each lane gathered its row's mean; 3x slower)
            schedule_spatial(sch, block, lanes, by_rows=True)
        else:
            schedule_reduction(sch, block, lanes)
    return sch


def _prepared(func: tirx.PrimFunc) -> s_tir.Schedule | None:
    sch = Schedule(func)
    if all(is_spatial(sch, b) for b in root_blocks(sch)):
        return None
    inline_spatial_blocks(sch, into_reductions=True)
    for block in root_blocks(sch):
        if not sch.get_loops(block):
            # NOTE: rfactor of another block fails on a root block without a loop (`mean`'s
            # final divide: "Check failed: block_realize == old_block_realize_"), and the
            # reduction fell back to one serial chain.
            sch.add_unit_loop(block)
    return sch


def _lanes(sch: s_tir.Schedule, block: SBlockRV, cpu: CPUTarget) -> int:
    writes = sch.get(block).writes
    return cpu.lanes(writes[0].source.dtype if writes else "float32")


def _leading_spatial(kinds: str) -> int:
    return len(kinds) - len(kinds.lstrip("S"))


def _schedule_rows(sch: s_tir.Schedule, cpu: CPUTarget) -> bool:
    """Compute every block at the shared row loop of the output block; False, with `sch`
    untouched, if not shaped so."""
    blocks = root_blocks(sch)
    if len(blocks) < 2 or not is_spatial(sch, blocks[-1]):
        return False
    kinds = [iter_kinds(sch, b) for b in blocks]
    if any(k is None for k in kinds):
        return False
    n_rows = min(_leading_spatial(k) for k in kinds)  # type: ignore[arg-type]
    if n_rows == 0:
        return False
    row_extents = [static_extent(sch, l) for l in sch.get_loops(blocks[-1])[:n_rows]]
    for block, k in zip(blocks, kinds):
        extents = [static_extent(sch, l) for l in sch.get_loops(block)[:n_rows]]
        if extents != row_extents or None in extents:
            return False
        if not is_spatial(sch, block):
            if "S" in k[n_rows:]:  # type: ignore[index]
                return False  # a reduction that keeps a non-row axis is not a row reduction
            if not _reduces_contiguously(sch, block):
                return False  # summing down columns: better block by block
            if _is_ragged_row(sch, block, n_rows, _lanes(sch, block, cpu)):
                return False  # its chains cannot move under the row (`_rfactor_row`)
    # A row's work is all its blocks' (a batch-norm running-mean update writes one value per
    # channel after summing 16384: counting the output block alone, 144 channels of it ran on
    # one core).
    row_work = sum(math.prod(work_extent(sch, loop) for loop in sch.get_loops(block)[n_rows:]) for block in blocks)
    partials = []
    for block in blocks[:-1]:
        if not is_spatial(sch, block):
            partials += _row_partials(sch, block, n_rows, _lanes(sch, block, cpu))[1]
    last = blocks[-1]
    loops = sch.get_loops(last)
    row = sch.fuse(*loops[:n_rows]) if n_rows > 1 else loops[0]
    _vectorize_tail(sch, last, 1, _lanes(sch, last, cpu))
    for block in reversed(root_blocks(sch)[:-1]):
        sch.compute_at(block, row, preserve_unit_loops=True)
    parallelize(sch, [row], row_work)
    # The row loop is a root-level loop: every block under it has it as its first loop.
    for block in sch.get_child_blocks(row):
        if is_spatial(sch, block) and _is_plain(sch, block, depth=1):
            if is_padding(sch, block) and len(sch.get_loops(block)) > 1:
                # A row padded to whole vectors (relay_passes/pad_ragged_softmax.py): a vector
                # fill, then a copy of the row (vectorize_tails takes it); vectorized as one
                # block, its bounds test made every element a scalar select.
                fill = sch.decompose_padding(block, sch.get_loops(block)[1])
                _vectorize_tail(sch, fill, 1, _lanes(sch, fill, cpu))
                continue
            _vectorize_tail(sch, block, 1, _lanes(sch, block, cpu))
    # NOTE: last, because splitting off the inits makes later primitives on the row refuse.
    for partial in partials:
        _vectorize_partial(sch, partial)
    return True


# A channel's data is read by every block in turn (batch-norm's mean, variance and
# normalization): at most this much of it, so that the second and third reads come from L2.
CHANNEL_BYTES = 256 << 10
CHANNELS_PER_THREAD = 4


def _schedule_channels(sch: s_tir.Schedule, cpu: CPUTarget) -> bool:
    """Run every block one channel at a time: the reductions that keep one axis (a channel:
    batch-norm statistics over N, H, W of NCHW) and the blocks that read their results at that
    channel (the normalization, the running statistics), under one parallel loop over the
    channels. Each channel's data then goes through memory once and is read again from cache,
    where block by block every block read the whole tensor from memory. False, with `sch`
    untouched, if the function is not shaped so."""
    blocks = root_blocks(sch)
    if len(blocks) < 2:
        return False

    def is_one(extent: tirx.PrimExpr) -> bool:
        return isinstance(extent, tirx.IntImm) and extent.value == 1

    channel = {}  # block -> its channel iterator
    writes = {}  # an intermediate buffer -> (its block, the axis that is the channel)
    for block in blocks:
        stmt = sch.get(block)
        kinds = iter_kinds(sch, block)
        if kinds is None or len(stmt.writes) != 1:
            return False
        if not is_spatial(sch, block):
            spatial = [iv.var for iv, k in zip(stmt.iter_vars, kinds)
                       if k == "S" and not is_one(iv.dom.extent)]  # keepdims' unit axes aside
            if len(spatial) != 1 or not _reduces_contiguously(sch, block):
                return False
            if _is_ragged_row(sch, block, 1, _lanes(sch, block, cpu)):
                return False  # its chains cannot move under the channel (`_rfactor_row`)
            channel[block] = spatial[0]
    if not channel:
        return False
    for block in blocks:
        stmt = sch.get(block)
        own = {iv.var for iv in stmt.iter_vars}
        analyzer = Analyzer()
        for iv in stmt.iter_vars:
            analyzer.bind(iv.var, iv.dom)
        for read in stmt.reads:
            if read.source in writes:
                producer, axis = writes[read.source]
                # (a legalized batch_norm reads its mean at `(c + 0 + 0) % C`)
                index = analyzer.simplify(read.region[axis].min)
                var = index if isinstance(index, tirx.Var) and index in own else None
                if var is None or not channel.setdefault(block, var).same_as(var):
                    return False
        if block not in channel:
            return False  # reads no channel's result: it has no channel to run under
        axis = [i for i, r in enumerate(stmt.writes[0].region) if r.min.same_as(channel[block])]
        if len(axis) != 1:
            return False
        writes[stmt.writes[0].source] = (block, axis[0])
    # Per channel, a block would run before a later block's writes to the other channels: no
    # block may read a buffer that a block of the function writes, other than as above.
    written = {w.source for b in blocks for w in sch.get(b).writes}
    if any(r.source in written and r.source not in writes for b in blocks for r in sch.get(b).reads):
        return False
    # Worth it only when a block reads again what an earlier one read (batch-norm's x, read by
    # its mean, its variance and its normalization): a product of the mean with another
    # tensor, run per channel, was 25% slower than block by block.
    inputs = [{r.source for r in sch.get(b).reads if r.source not in writes} for b in blocks]
    if not any(inputs[i] & inputs[j] for i in range(len(blocks)) for j in range(i)):
        return False
    loops = [loop_binding(sch, block, channel[block]) for block in blocks]
    extents = {static_extent(sch, loop) for loop in loops if loop is not None}
    if None in loops or len(extents) != 1 or None in extents:
        return False
    (channels,) = extents
    largest = max(math.prod(work_extent(sch, l) for l in sch.get_loops(b)) for b in blocks)
    itemsize = max(element_bytes(sch.get(b).writes[0].source.dtype) for b in blocks)
    if largest // channels * itemsize > CHANNEL_BYTES or not enough_per_thread(channels, CHANNELS_PER_THREAD):
        return False
    # Only now does the schedule change.
    partials = []
    for block, loop in zip(blocks, loops):
        others = [l for l in sch.get_loops(block) if not sch.get(l).same_as(sch.get(loop))]
        sch.reorder(loop, *others)
        if not is_spatial(sch, block):
            # NOTE: each reduction on its own loop nest, before the merge: rfactor of a block
            # that shares its loop with another fails inside TVM.
            added, vectorized = _row_partials(sch, block, 1, _lanes(sch, block, cpu))
            for partial in reversed(added):
                sch.compute_at(partial, sch.get_loops(block)[0], preserve_unit_loops=True)
            partials += vectorized
    merged = sch.merge(*[sch.get_loops(block)[0] for block in blocks])
    parallelize(sch, [merged], largest // channels)
    for block in sch.get_child_blocks(merged):
        inner = sch.get_loops(block)[1:]
        if inner and is_spatial(sch, block) and _is_plain(sch, block, depth=1):
            # The innermost loop only: vectors cut from the fused image axes index with
            # divisions (the normalization ran 10% slower so).
            vectorize_innermost(sch, inner[-1], _lanes(sch, block, cpu))
    for partial in partials:
        _vectorize_partial(sch, partial)
    return True


def _is_plain(sch: s_tir.Schedule, block: SBlockRV, depth: int) -> bool:
    """True when the loops of `block` below the first `depth` ones are all still serial."""
    return all(sch.get(l).kind == tirx.ForKind.SERIAL for l in sch.get_loops(block)[depth:])


def _vectorize_tail(sch: s_tir.Schedule, block: SBlockRV, depth: int, lanes: int) -> None:
    """Fuse the loops of `block` below the first `depth` ones and vectorize them."""
    loops = sch.get_loops(block)[depth:]
    if not loops:
        return
    inner = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    vectorize_innermost(sch, inner, lanes)


# Vectors of partial sums per reduction: one vector is one chain of dependent additions, each
# waiting for the last (3-4 cycles), so a row of 256 floats summed into one vector of 8 took 32
# additions in sequence; four chains keep the adder busy. Zen 3, interleaved medians: a
# layer_norm over 1024 x 256 0.22 -> 0.048 ms (torch 0.075), softmax over 32 x 128 x 128
# 0.41 -> 0.25 ms (torch 0.38).
ROW_CHAINS = 4
# A row at least this long that no vector divides is still summed in chains (`_rfactor_row`);
# shorter ones (a ViT's 197 tokens) stay serial, where a chain's rounding error is small.
RAGGED_ROWS_FROM = 1 << 12


# A row whose chains (`_rfactor_row`) would each add more than this many elements is first cut
# into chunks (`_chunk_long_row`).
LONG_CHAINS_FROM = 1 << 12


def _chunk_long_row(sch: s_tir.Schedule, block: SBlockRV, n_rows: int,
                    lanes: int) -> tuple[SBlockRV, int] | None:
    """A row too long for its chains cut into chunks of about sqrt(lanes * ROW_CHAINS * n)
    elements, each summed on its own: `rfactor` on its outermost reduced loop (past keepdims'
    loops of extent 1), split at a divisor (no predicate: the callers move the chunks' block
    with compute_at). Returns (the chunks' block, how many of its loops precede the rest of
    the row: the rows' and the chunk's); `block` then adds the chunks' sums. None for a row
    short enough, or one no divisor cuts.

    Why: a chain per vector lane over a whole row, a training batch norm over (16, C, 250000)
    of mean 1e3 came out 1e-3 off (eager 7e-6): 125,000 float32 additions per chain.

    A row whose outermost reduced loop is a dynamic batch's, the rest static, takes a chunk per
    batch item, when the row at REFERENCE_BATCH is that long and an item fills the chains: a
    training batch norm's statistics over (batch, C, 128, 128) had been summed in 64 chains of
    batch * 256 additions (3x the static graph's error)."""
    if not _reduces_contiguously(sch, block):
        return None
    loops = sch.get_loops(block)
    reduce_loops = _static_reduce_loops(sch, block, n_rows)
    symbolic = loops[n_rows:len(loops) - len(reduce_loops)]
    if len(symbolic) > 1 or any(static_extent(sch, l) is None for l in reduce_loops):
        return None
    chained = lanes * ROW_CHAINS
    if symbolic:
        (loop,) = symbolic
        per_item = math.prod(static_extent(sch, l) for l in reduce_loops)
        if per_item < chained or per_item * work_extent(sch, loop) <= chained * LONG_CHAINS_FROM:
            return None
    else:
        while reduce_loops and static_extent(sch, reduce_loops[0]) == 1:
            reduce_loops = reduce_loops[1:]
        extents = [static_extent(sch, l) for l in reduce_loops]
        n = math.prod(extents) if extents else 0
        if n <= chained * LONG_CHAINS_FROM:
            return None
        target = math.isqrt(chained * n)
        outer, rest = extents[0], n // extents[0]
        loop = reduce_loops[0]
        if rest < target // 2:
            # The chunk takes whole iterations of the outer loop: a divisor of it near the
            # target, at whole vectors when the outer loop is the row itself.
            whole = 1 if len(reduce_loops) > 1 else chained
            per_chunk = math.ceil(target / rest)
            size = divisor_between(outer, per_chunk, min(outer // 2, 4 * per_chunk), whole)
            if size is None:
                return None
            loop, _ = sch.split(loop, [None, size])
    depth = [sch.get(l).same_as(sch.get(loop)) for l in sch.get_loops(block)].index(True) + 1
    try:
        return sch.rfactor(loop, factor_axis=len(sch.get(block).writes[0].region)), depth
    except s_tir.ScheduleError:  # a reducer rfactor does not know: the chains stay long
        return None


def _row_partials(sch: s_tir.Schedule, block: SBlockRV, n_rows: int, lanes: int,
                  ragged: bool = False) -> tuple[list[SBlockRV], list[SBlockRV]]:
    """`_rfactor_row` of `block`, or of its chunks (`_chunk_long_row`): (the blocks added
    before `block`, in the order they run; those of them that `_vectorize_partial` takes)."""
    chunked = _chunk_long_row(sch, block, n_rows, lanes)
    if chunked is None:
        partials = _rfactor_row(sch, block, n_rows, lanes, ragged)
        return partials, partials
    chunks, depth = chunked
    partials = _rfactor_row(sch, chunks, depth, lanes, ragged)
    return [*partials, chunks], partials


def _static_reduce_loops(sch: s_tir.Schedule, block: SBlockRV, n_rows: int) -> list[LoopRV]:
    """The block's reduced loops after its first `n_rows`, from the first static one on: a
    symbolic reduced extent (a dynamic batch: batch-norm statistics over N, H, W) stays a
    serial loop outside, and the static trailing loops form the vector."""
    reduce_loops = sch.get_loops(block)[n_rows:]
    while reduce_loops and static_extent(sch, reduce_loops[0]) is None:
        reduce_loops = reduce_loops[1:]
    return reduce_loops


def _is_ragged_row(sch: s_tir.Schedule, block: SBlockRV, n_rows: int, lanes: int) -> bool:
    """Whether `block` sums a contiguous row at least RAGGED_ROWS_FROM long that no vector
    divides (`_rfactor_row` cuts it only when asked: its partial sums have a predicate)."""
    if is_spatial(sch, block) or not _reduces_contiguously(sch, block):
        return False
    extents = [static_extent(sch, l) for l in _static_reduce_loops(sch, block, n_rows)]
    return bool(extents) and _vector_suffix(extents, lanes) is None and extents[-1] >= RAGGED_ROWS_FROM


def _rfactor_row(
    sch: s_tir.Schedule, block: SBlockRV, n_rows: int, lanes: int, ragged: bool = False
) -> list[SBlockRV]:
    """Vectorize a reduction over its trailing loops: partial sums in up to ROW_CHAINS vectors
    of `lanes`, those vectors added into one, then its lanes summed.

    Only when the reduced elements are contiguous (the innermost read index is reduced);
    otherwise the block keeps its serial reduction loop. Returns the partial-sum blocks, in
    the order they run (none, or the chains' sums and, with several chains, their sum).

    A long row that no vector divides (`_is_ragged_row`) is cut only when `ragged` is set:
    into whole vectors, the last one partial, so that the chains' block has a predicate. TVM's
    compute_at drops a block's predicate (the last vector then read past the row), so the
    caller leaves that block at the root. Why: such a row (a layer norm over 500009 elements,
    a batch norm over (2, C, 200003)) was summed in one serial chain, and over data of mean
    1e3 its mean came out wrong by more than the data's spread: the output was noise.
    """
    if not _reduces_contiguously(sch, block):
        return []
    reduce_loops = _static_reduce_loops(sch, block, n_rows)
    if not reduce_loops:
        return []
    # The vector is cut from the fewest innermost loops whose elements it divides: cut from all
    # of them fused, the loads index with divs and mods that TVM cannot prove contiguous, and
    # gathers them one lane at a time (a (512, 512, 3, 3) gradient: 1.8 ms instead of 0.1).
    extents = [static_extent(sch, l) for l in reduce_loops]
    suffix = _vector_suffix(extents, lanes)
    ragged = ragged and _is_ragged_row(sch, block, n_rows, lanes)
    if ragged:
        suffix = (1, lanes)
    if suffix is None:
        return []
    count, width = suffix
    # Too few elements for every chain (batch-norm sums over 8 x 8 images: one chain of one
    # vector), the vector takes in the next loops out while they continue one contiguous run.
    run = _contiguous_run(sch, block, reduce_loops)
    while count < run and math.prod(extents[-count:]) < 2 * width * ROW_CHAINS:
        count += 1
    fused = sch.fuse(*reduce_loops[-count:]) if count > 1 else reduce_loops[-1]
    extent = static_extent(sch, fused) or width
    # Each chain at least two vectors long, else the chains' sum costs what they save.
    chains = ROW_CHAINS if ragged else next(
        (c for c in (ROW_CHAINS, 2) if extent % (width * c) == 0 and extent >= 2 * width * c), 1)
    _, lane = sch.split(fused, [None, width * chains])
    # The partial sums go last in their buffer, so that one vector store writes them all.
    axis = len(sch.get(block).writes[0].region)
    partials = [sch.rfactor(lane, factor_axis=axis)]
    if chains > 1:
        # `block` now sums the chains' width * chains partial sums: first add the chains'
        # vectors into one (a vector block of its own), then sum its lanes.
        _, lane = sch.split(sch.get_loops(block)[-1], [None, width])
        partials.append(sch.rfactor(lane, factor_axis=axis))
    return partials


def _contiguous_run(sch: s_tir.Schedule, block: SBlockRV, loops: list) -> int:
    """How many of the innermost `loops` (at least one) walk the block's largest read as one
    contiguous run: each reads one trailing axis of it, whole, in order (NCHW's H and W). Their
    fused index then flattens back to one offset, and vector loads stay contiguous."""
    stmt = sch.get(block)
    realize = sch.get(sch.get_loops(block)[-1]).body
    bound = {iv.var: value for iv, value in zip(stmt.iter_vars, realize.iter_values)}
    read = _largest_read(stmt)
    shape = read.source.shape
    run = 0
    for loop, region, dim in zip(reversed(loops), reversed(read.region), reversed(shape)):
        var = sch.get(loop).loop_var
        index = region.min
        if not (isinstance(index, tirx.Var) and index in bound and bound[index].same_as(var)):
            break
        extent = static_extent(sch, loop)
        if extent is None or not isinstance(dim, tirx.IntImm) or int(dim) != extent:
            break
        run += 1
    return max(run, 1)


def _vector_suffix(extents: list[int | None], lanes: int) -> tuple[int, int] | None:
    """(how many innermost loops, vector width): the fewest loops a full `lanes` vector divides
    the elements of, else the fewest any vector of 4 or more does; None if none does."""
    first = None
    product = 1
    for count, extent in enumerate(reversed(extents), start=1):
        if extent is None:
            break
        product *= extent
        width = _vector_width(product, lanes)
        if width == lanes:
            return count, width
        if width is not None and first is None:
            first = (count, width)
    return first


def _vector_width(extent: int | None, lanes: int) -> int | None:
    """The widest power-of-two vector of at most `lanes` (and at least 4) dividing `extent`."""
    width = lanes
    while width >= 4 and (extent is None or extent % width):
        width //= 2
    return width if width >= 4 and extent is not None and extent >= width else None


def _vectorize_partial(sch: s_tir.Schedule, partial: SBlockRV) -> None:
    """Make the lane loop of a partial-sum block the vector and hoist its init.

    Call it after any compute_at: once the init is split off, the update block no longer
    passes the reduction-block checks that compute_at and vectorize make (so the loop is
    vectorized before the split).
    """
    stmt = sch.get(partial)
    lane_var = next(iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar)
    ko_var = next(iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce)
    lane_loop, ko = loop_binding(sch, partial, lane_var), loop_binding(sch, partial, ko_var)
    if lane_loop is None or ko is None:
        return
    # compute_at may put kept loops inside `ko` (a long row's chunks, `_chunk_long_row`): they
    # go outside, so that a chunk is read in one run (inside, each step jumped from chunk to
    # chunk: a sum over (64, 262144) took 2-3x as long).
    loops = sch.get_loops(partial)
    at = min(i for i, l in enumerate(loops) if sch.get(l).same_as(sch.get(ko)) or sch.get(l).same_as(sch.get(lane_loop)))
    kept = [l for l in loops[at:] if not sch.get(l).same_as(sch.get(lane_loop)) and _binds_kept(sch, partial, l)]
    sch.reorder(*kept, ko, lane_loop)
    sch.vectorize(lane_loop)
    sch.decompose_reduction(partial, ko)


def _binds_kept(sch: s_tir.Schedule, block: SBlockRV, loop: LoopRV) -> bool:
    """Whether `loop` drives only kept (spatial) iterators of `block`."""
    stmt = sch.get(block)
    realize = sch.get(sch.get_loops(block)[-1]).body
    var = sch.get(loop).loop_var
    kinds = {iv.iter_type for iv, value in zip(stmt.iter_vars, realize.iter_values) if var in vars_in(value)}
    return kinds == {tirx.IterVar.DataPar}


def _reduces_contiguously(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Whether the largest read of `block` is contiguous along a reduction iterator."""
    stmt = sch.get(block)
    reduce_vars = {iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    read = _largest_read(stmt)
    return read is not None and bool(vars_in(read.region[-1].min) & reduce_vars)


def _largest_read(stmt: s_tir.SBlock) -> tirx.BufferRegion | None:
    """The block's read of the most dimensions, its own output (a reduction's update) aside;
    None when no read has an axis (a sum of a broadcast scalar)."""
    reads = [r for r in stmt.reads if not r.source.same_as(stmt.writes[0].source) and len(r.region) > 0]
    return max(reads, key=lambda r: len(r.region)) if reads else None


def schedule_reduction(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> None:
    """Schedule one root-level reduction nest on its own (see the module docstring)."""
    kinds = iter_kinds(sch, block)
    if kinds is None:
        return
    if len(sch.get(block).writes) > 1:
        # A tuple reduction (max pooling's gradient: the argmax's index and value): rfactor
        # takes one buffer only, and the nest was left serial (a raw-audio net's 1981-sample
        # pooling gradient, 4.7 ms of its training step). Its rows run in parallel.
        schedule_leading_spatial(sch, block)
        return
    if _contiguous_spatial_loop(sch, block) is not None:
        _schedule_column(sch, block, lanes)
        return
    # Row-like: spatial loops outside (parallel), reduction loops inside (rfactor vector).
    spatial, reduce_ = _split_kinds(sch, block)
    sch.reorder(*spatial, *reduce_)
    if not spatial:
        chunks = _chunk_partials(sch, block, lanes)
        if chunks is not None:  # a row reduction per chunk, then the chunks' sums
            block, spatial, reduce_ = chunks, *_split_kinds(sch, chunks)
        else:
            for partial in _rfactor_row(sch, block, 0, lanes):
                _vectorize_partial(sch, partial)
            return
    work = 1
    for l in reduce_:
        work *= work_extent(sch, l)
    row = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    added, vectorized = _row_partials(sch, block, 1, lanes, ragged=True)
    # The partial sums of a row are computed right before they are summed (each block moved
    # after its consumer), except a ragged row's chains (a predicate: see `_rfactor_row`),
    # which run as a parallel nest of their own before. Asked of the block itself: a row whose
    # chunks (`_chunk_long_row`) are ragged when the whole row is not (3 x 4099 of 540 x 4099)
    # had its chains moved, and a max over (2, 540, 4099) read the next row's values.
    ragged = bool(added) and _has_predicate(sch, added[0])
    if ragged and added:
        parallelize(sch, sch.get_loops(added[0])[:1], work)
    for partial in reversed(added[1:] if ragged else added):
        sch.compute_at(partial, row, preserve_unit_loops=True)
    parallelize(sch, [row], work)
    for partial in vectorized:
        _vectorize_partial(sch, partial)
    if ragged and vectorized:
        _peel_partial_vector(sch, vectorized[0])


def _has_predicate(sch: s_tir.Schedule, block: SBlockRV) -> bool:
    """Whether `block` runs under a predicate other than true (a split that no factor divides)."""
    realize = sch.get(sch.get_loops(block)[-1]).body
    predicate = realize.predicate if isinstance(realize, s_tir.SBlockRealize) else None
    return predicate is not None and not (isinstance(predicate, tirx.IntImm) and predicate.value == 1)


def _peel_partial_vector(sch: s_tir.Schedule, partial: SBlockRV) -> None:
    """Run the last vector of a ragged row's chains (the one its predicate cuts) as a loop of its
    own: under the predicate, LLVM got the whole vector loop lane by lane (a sum over (8, 100003)
    took 1.07 ms, peeled 0.16). Its loop over whole vectors, the one around the vector, is
    split before its last step; the init is already split off (a partitioned reduction loop
    re-runs it)."""
    loops = sch.get_loops(partial)
    if len(loops) < 2:
        return
    steps = static_extent(sch, loops[-2])
    if steps is not None and steps > 1:
        sch.loop_partition(loops[-2], factors=[steps - 1, None])


def _split_kinds(sch: s_tir.Schedule, block: SBlockRV) -> tuple[list, list]:
    kinds = iter_kinds(sch, block)
    loops = sch.get_loops(block)
    return [l for l, k in zip(loops, kinds) if k == "S"], [l for l, k in zip(loops, kinds) if k == "R"]


# A reduction to one value of at least this many elements is summed in chunks (see below).
CHUNKED_FROM = 1 << 12


def _chunk_partials(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> SBlockRV | None:
    """A reduction to one value split into chunks of about sqrt(lanes * n) elements, each
    summed on its own (`rfactor`: a block of per-chunk results, then their sum). Returns the
    per-chunk block, or None for a short reduction or one symbolic past its outermost loop.

    Why: in one chain of float32 additions, the rounding error grows with the chain's length.
    Summed `lanes` at a time, the MSE loss of a (8, 128, 256) tensor was off by 5e-5 of its
    value against torch's (torch sums in blocks: 6e-8); per chunk, each chain is about
    sqrt(n / lanes) long. The chunks also run in parallel (one thread summed it all).

    A symbolic outermost loop (a dynamic batch) stays outside the chunk: chunks of at least
    SYMBOLIC_CHUNK_ELEMENTS within a batch item, or whole items, whose sums, as many as the
    batch makes, are added in runs (`_sum_in_runs`). Left whole, `x.var()` of (batch, 4) at a
    batch of 1e6 came out 80 (eager 1.0), an MSE loss over (batch, 40) 1e-4 off (static: 4e-7);
    runs of items instead, the last one partial, put a predicate on every vector lane, which
    LLVM runs lane by lane (a mean over (4096, 10): 50 us, per item 25)."""
    if not _reduces_contiguously(sch, block):
        return None
    loops = sch.get_loops(block)
    extents = [static_extent(sch, l) for l in loops]
    if any(e is None for e in extents[1:]):
        return None
    batch = extents[0] is None
    n = math.prod(extents[1:]) * (REFERENCE_BATCH if batch else extents[0])
    if not batch and n < CHUNKED_FROM:
        return None
    target = max(math.isqrt(lanes * n), SYMBOLIC_CHUNK_ELEMENTS if batch else 0)
    # The chunk is the fewest innermost loops holding `target` elements (a batch's loop stays
    # outside), the outermost of them split (at a divisor, so that no chunk is partial; the
    # innermost at whole vectors) where they hold more than twice that.
    count, chunk = 0, 1
    while count < len(loops) - batch and chunk < target:
        count += 1
        chunk *= extents[-count]
    outer = loops[:len(loops) - count]
    if chunk > 2 * target:
        extent, rest = extents[-count], chunk // extents[-count]
        size = divisor_between(extent, math.ceil(target / rest), extent - 1, 1 if count > 1 else lanes)
        if size is not None:
            ko, _ = sch.split(loops[-count], [None, size])
            outer = [*outer, ko]
    # Loops of extent 1 (a batch of one: a sum over (1, N)) go inside the chunk loop, so that
    # the per-chunk block's loops are in its iterators' order (the chunk's first): rfactor left
    # them out of order, the rest of the schedule raised, and the graph lost its CPU schedules.
    units = [l for l in outer if static_extent(sch, l) == 1]
    outer = [l for l in outer if static_extent(sch, l) != 1]
    if not outer:
        return None
    if units:
        sch.reorder(*outer, *units)
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    try:
        chunks = sch.rfactor(fused, factor_axis=0)
    except s_tir.ScheduleError:  # a reducer rfactor does not know: one chain per lane below
        return None
    if batch:
        _sum_in_runs(sch, block)
    return chunks


# A sum to one value over a dynamic batch is cut into chunks of at least this many elements
# within each batch item, or into whole items when an item holds fewer; the chunks' sums are
# added in runs of SUM_RUN.
SYMBOLIC_CHUNK_ELEMENTS = 1 << 14
SUM_RUN = 1 << 10


def _sum_in_runs(sch: s_tir.Schedule, block: SBlockRV) -> None:
    """A sum over one symbolic loop (chunks' sums, as many as the batch makes) added in runs
    of SUM_RUN values, then the runs' sums: serial, under a predicate, a short pass."""
    loops = sch.get_loops(block)
    if len(loops) != 1:
        return
    run, _ = sch.split(loops[0], [None, SUM_RUN])
    try:
        sch.rfactor(run, factor_axis=0)
    except s_tir.ScheduleError:
        pass


def _contiguous_spatial_loop(sch: s_tir.Schedule, block: SBlockRV) -> int | None:
    """Position of the spatial loop the largest read is contiguous along, if it is spatial."""
    stmt = sch.get(block)
    kinds = iter_kinds(sch, block)
    read = _largest_read(stmt)
    if read is None or kinds is None:
        return None
    last = vars_in(read.region[-1].min)
    for pos, (iv, k) in enumerate(zip(stmt.iter_vars, kinds)):
        if k == "S" and iv.var in last:
            return pos
    return None


def _schedule_column(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> None:
    """A long column reduction first cut into chunks of rows (`_column_chunks`), then each
    block as `_schedule_column_block` runs it."""
    chunks = _column_chunks(sch, block)
    if chunks is not None:
        _schedule_column_block(sch, chunks, lanes)
    _schedule_column_block(sch, block, lanes)


def _column_loops(sch: s_tir.Schedule, block: SBlockRV) -> tuple[list[LoopRV], LoopRV, list[LoopRV]] | None:
    """(the other kept loops, the kept loop the largest read is contiguous along, the reduced
    loops), each in loop order; None if a loop binds no iterator of its own."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    realize = sch.get(loops[-1]).body
    read = _largest_read(stmt)
    if read is None or not isinstance(realize, s_tir.SBlockRealize):
        return None
    contiguous = vars_in(read.region[-1].min)
    others, col, reduce_ = [], None, []
    for loop in loops:
        var = sch.get(loop).loop_var
        bound = [iv for iv, value in zip(stmt.iter_vars, realize.iter_values) if var in vars_in(value)]
        if len(bound) != 1:
            return None
        (iv,) = bound
        if iv.iter_type == tirx.IterVar.CommReduce:
            reduce_.append(loop)
        elif iv.var in contiguous and col is None:
            col = loop
        else:
            others.append(loop)
    return (others, col, reduce_) if col is not None and reduce_ else None


# A column reduction whose rows are a dynamic batch is cut into chunks of at least this many
# rows, whatever the batch turns out to be (its count is unknown when the kernel is built).
SYMBOLIC_CHUNK_ROWS = 1 << 10


def _column_chunks(sch: s_tir.Schedule, block: SBlockRV) -> SBlockRV | None:
    """A column reduction over at least CHUNKED_FROM rows cut into chunks of about sqrt(rows)
    rows, each summed on its own (`rfactor` on the outermost reduced loop: a block of
    per-chunk sums, then their sum in `block`). Returns the per-chunk block, or None for a
    short one, or one with a symbolic reduced loop inside another.

    Why: each output was one chain of additions down its column. `x.var(0)` of a float32
    (1e6, 4) tensor of 1e3 + randn came out 80 (eager 1), a Linear layer's bias gradient over
    1e6 rows 1e-2 off. The chunks also run in parallel (few columns ran on one thread).
    A symbolic outermost reduced loop (a dynamic batch) is cut too, into chunks of at least
    SYMBOLIC_CHUNK_ROWS rows: left whole, the same `x.var(0)` came out 80 under a dynamic batch."""
    found = _column_loops(sch, block)
    if found is None:
        return None
    _, _, reduce_ = found
    extents = [static_extent(sch, l) for l in reduce_]
    if any(e is None for e in extents[1:]):
        return None
    outer = extents[0]  # None: a dynamic batch
    rest = math.prod(extents[1:])
    rows = rest * (outer or REFERENCE_BATCH)
    if outer is not None and (rows < CHUNKED_FROM or outer < 2):
        return None
    target = math.isqrt(rows) if outer is not None else max(math.isqrt(rows), SYMBOLIC_CHUNK_ROWS)
    loop = reduce_[0]
    per_chunk = math.ceil(target / rest)
    if per_chunk > 1 and (outer is None or per_chunk < outer):
        # At a divisor near the target when there is one; else the last chunk is partial (a
        # predicate, which this schedule keeps: it moves no block with compute_at).
        size = (outer and divisor_between(outer, per_chunk, min(outer, 2 * per_chunk))) or per_chunk
        loop, _ = sch.split(loop, [None, size])
    try:
        return sch.rfactor(loop, factor_axis=0)
    except s_tir.ScheduleError:  # a reducer rfactor does not know: one chain per column
        return None


def _schedule_column_block(sch: s_tir.Schedule, block: SBlockRV, lanes: int) -> None:
    """Reduced loops outside, the contiguous kept loop inside as the vector; parallel over
    the other kept loops and chunks of the contiguous one."""
    found = _column_loops(sch, block)
    assert found is not None
    others, col, reduce_ = found
    extent = static_extent(sch, col) or 0
    width = lanes
    while width >= 4 and extent % width:
        width //= 2
    work = math.prod(work_extent(sch, l) for l in reduce_)
    if width < 4:
        if extent > 2 * lanes and _schedule_column_in_vectors(sch, others, col, reduce_, extent, lanes, work):
            return
        sch.reorder(*others, col, *reduce_)
        # NOTE: the work of an output is its reduction's: counted as 1, a raw-audio net's
        # max pooling over (16, 32, 1981) ran on one thread (its (1, 4) window is such a
        # reduction, along 495 columns that no vector divides).
        parallelize(sch, [*others, col], work)
        return
    # Chunks of 4 vectors keep 4 independent accumulators in flight per step.
    chunk = width * 4 if extent % (width * 4) == 0 else width
    co, ci = sch.split(col, [None, chunk])
    sch.reorder(*others, co, *reduce_, ci)
    _, vec = sch.split(ci, [None, width])
    sch.vectorize(vec)
    parallelize(sch, [*others, co], work * chunk)
    # NOTE: last: once the init is split off, `parallel` refuses the loop nest.
    sch.decompose_reduction(block, reduce_[0])


def _schedule_column_in_vectors(sch: s_tir.Schedule, others: list[LoopRV], col: LoopRV, reduce_: list[LoopRV],
                                extent: int, lanes: int, work: int) -> bool:
    """A column reduction along `col`, whose extent no vector divides: parallel over the other
    kept loops, `col` cut (`loop_partition`) into whole vectors, which run as `_schedule_column`
    runs a column (reduced loops outside, the vector inside), and a serial tail. False, with
    `sch` unchanged, when a primitive refuses.

    Why: the max pooling of a raw-audio net (MaxPool1d(4) over (16, 32, 1981): windows along
    495 columns) ran one output at a time, its NaN-propagating max a chain of scalar selects:
    0.76 ms of a 3.1 ms inference call on a 2-vCPU Xeon; in vectors, 0.17 ms alone."""
    if not others:
        return False
    trial = sch.copy()  # a primitive that fails halfway must not leave the nest half cut
    try:
        _column_in_vectors(trial, others, col, reduce_, extent, lanes, work)
    except (s_tir.ScheduleError, ValueError):
        return False
    _column_in_vectors(sch, others, col, reduce_, extent, lanes, work)
    return True


def _column_in_vectors(sch: s_tir.Schedule, others: list[LoopRV], col: LoopRV, reduce_: list[LoopRV],
                       extent: int, lanes: int, work: int) -> None:
    sch.reorder(*others, col, *reduce_)
    parallelize(sch, others, work * extent)
    vectors, _ = sch.loop_partition(col, factors=[extent - extent % lanes, None])
    # loop_partition wraps each part in a block of its own ("..._partition") around the
    # reduction's block, whose loops below `vectors` are the reduced ones
    (part,) = [b for b in sch.get_child_blocks(vectors) if not sch.get(b).name_hint.endswith("_partition")]
    loops = sch.get_loops(part)
    reduced = loops[[sch.get(l).same_as(sch.get(vectors)) for l in loops].index(True) + 1:]
    if not reduced:
        raise ValueError("no reduced loop under the column")
    head, lane = sch.split(vectors, [None, lanes])
    sch.reorder(head, *reduced, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(part, reduced[0])

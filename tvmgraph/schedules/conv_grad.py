"""The weight gradient of a 2-D convolution, as Relax autodiff emits it.

`relax.transform.Gradient` writes dW of conv2d(x, w) as another convolution whose "window" is
the whole output plane and whose "output" is the kernel:

    dW[f, c, ky, kx] += x_pad[n, c, y*s + ky, x*s + kx] * dy[n, f, y, x]   (over n, y, x)

A few hundred outputs, each summing 64 x 32 x 32 products: a direct-convolution schedule
(`conv.py`) would vectorize the 3 kernel columns and loop 65536 times per output. This rule
instead vectorizes the reduction along the image row x: `lanes` partial sums per output in a
vector register (rfactor), a register tile of up to 4 x 3 outputs that share their loads,
parallel over output tiles; the partial sums are added up (and the fused SGD/Adam update
applied) at the end. A 1x1 convolution's gradient, whose x and y are both contiguous, sums
over y*x as one axis so that the vector is full even on 4x4 images.

When the channel counts allow it (F a multiple of 2 vectors), the rule instead runs the
gradient as an implicit GEMM with output channels in the vectors and K = the batch's pixels
(conv_gemm.py, `_gemm_tile`: dy copied channel-last, dy[n, y, x, f]; the tile's rows are the
kernel's columns). This keeps every vector lane busy whatever the image size: ResNet-18's
512-channel layer on 4x4 images went from 41 to 263 GFLOP/s, the 256-channel one on 8x8 from
90 to 305 (Zen 5, 2 cores).

Limits: stride 2 reads x_pad with a stride of 2 (along the vector in the row-vectorized
form: gathers); on images narrower than 4 columns the row-vectorized sums run scalar.
"""

from __future__ import annotations

from typing import NamedTuple

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.target import Target

from .conv import ConvShape, data_producer, find_conv, pad_at
from .conv_gemm import TILE_ROWS, TILE_VECTORS, reads_vars, schedule_implicit_gemm, tile_fits
from .cpu_target import CPUTarget
from .fallback import schedule_remaining
from .matmul import STACK_BYTES
from .loops import (
    element_bytes,
    inline_copies_into,
    inline_spatial_blocks,
    loop_binding,
    parallelize,
    static_extent,
    vars_in,
    work_extent,
)

# Output tile (rows x columns of accumulators); 4 x 3 x 16 floats = 768 bytes stays on the
# stack (see matmul.ACCUMULATOR_SCOPE) and leaves registers for the 7 operand vectors.
TILE = (4, 3)
# The most accumulator vectors of an implicit GEMM's tile with 32 vector registers (AVX-512):
# with its 4 vectors of dy and one broadcast, they hold it.
MAX_ACCUMULATORS = 24
# The fewest tiles of planes for which the parallel loop runs over them (see `_schedule`).
MIN_GROUP_TILES = 4


class ConvWeightGradient(ScheduleRule):
    """Vectorized, register-tiled reduction for convolution weight gradients."""

    # Schedules only a kernel with a reduction block (ApplyCPUSchedules tries it on no other).
    needs_reduction = True
    needs_binary_reduction = True  # one C += data * dy block (find_conv)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when the PrimFunc is not a conv weight gradient."""
        found = find_conv(func, target)
        if found is None or not found[2].is_weight_gradient:
            return None
        sch, main, shape = found
        inline_spatial_blocks(sch, keep=(main,))
        inline_copies_into(sch, main)
        cpu = CPUTarget.from_target(target)
        lanes = cpu.lanes(str(sch.get(main).writes[0].source.dtype))
        tile = _gemm_tile(sch, main, shape, lanes, cpu.num_vector_registers)
        if tile is not None:
            schedule_implicit_gemm(sch, main, tile.vector, tile.row, shape.reduce, lanes,
                                   tile.rows, tile.vectors, tile.outer_row, tile.outer_rows)
        elif not _schedule(sch, main, shape, lanes):
            return None
        schedule_remaining(sch, cpu)
        return sch


class GemmTile(NamedTuple):
    """The implicit GEMM's register tile: loop positions of its vector and row axes, and its
    size, `rows` x `vectors` vectors."""

    vector: int
    row: int
    rows: int
    vectors: int
    outer_row: int | None = None
    outer_rows: int = 1


def _channel_rows(per_channel: int, vectors: int, channels: int, num_registers: int) -> int:
    """How many input channels an implicit GEMM's tile takes, each with `per_channel`
    accumulators: the most that divide `channels` and, with `vectors` vectors of dy and one
    broadcast, fit the register file (at most MAX_ACCUMULATORS accumulators); 0 when not even
    one channel's fits.

    With 16 registers (AVX2) the 3 x 4 tile of one channel (12 accumulators, 4 vectors of dy)
    spilled: ResNet-18's dW 64 x 64 x 3 x 3 on 32 x 32 images took 16-18 ms on Zen 3; 3 columns
    x 2 vectors x 2 channels (12 accumulators, 2 vectors of dy) 10.0-10.3 ms, 3 x 3 x 1 15-18,
    3 x 2 x 1 12.2-12.7 (128 channels on 16 x 16: 17.5-18.0, 10.4-10.8, 17.4-21.3, 15.9-16.4)."""
    most = min(MAX_ACCUMULATORS // per_channel, (num_registers - vectors - 1) // per_channel)
    return next((r for r in range(most, 0, -1) if channels % r == 0), 0)


def _contiguous_plane(sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape) -> bool:
    """1x1, stride 1, no padding: the data's rows follow each other like dy's rows do."""
    stmt = sch.get(main)
    data = stmt.reads[shape.data_read].source
    grad = stmt.reads[1 - shape.data_read].source
    return (shape.extents[shape.y] == 1 and shape.extents[shape.x] == 1
            and [int(d) for d in data.shape[-2:]] == [int(d) for d in grad.shape[-2:]])


def _group_axis(sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape) -> str | None:
    """The output axis whose every index reads its own planes of the data, if any (a depthwise
    conv's gradient: autodiff folds the batch into the groups), by its iterator's name."""
    stmt = sch.get(main)
    outputs = [r.min for r in stmt.writes[0].region]
    data = stmt.reads[shape.data_read].region[:-2]
    return next((v.name for v in outputs if any(v in vars_in(r.min) for r in data)), None)


def _gemm_tile(sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape, lanes: int,
               num_registers: int = 32) -> GemmTile | None:
    """The implicit GEMM's tile when it applies (not grouped: each operand indexed by one
    output channel axis), else None. Preferred: the kernel's columns (kx, 2-5 of them) as the
    tile's rows, with up to 4 vectors of output channels, and with 32 vector registers as many
    input channels as fill MAX_ACCUMULATORS (2 x 3 columns x 4 vectors for a 3x3 kernel): each
    vector of dy loaded serves 6 multiply-adds instead of 3. dy streams from L2, and with 3 it
    was what bound the tile: ResNet-18's dW on 16x16 images 50 -> 58% of the FMA peak, on 32x32
    48 -> 55% (Sapphire Rapids); the data's broadcasts are neighbours in its rows (240-305
    GFLOP/s on Zen 5 against 150-230 with 4 input channels as the rows). With 16 (AVX2) the
    tile with the most accumulators that leaves registers for its vectors of dy and one
    broadcast (`_channel_rows`: 2 input channels x 3 columns x 2 vectors for a 3x3 kernel).
    Else 4 input channels x 2 vectors."""
    stmt = sch.get(main)
    data_vars, grad_vars = reads_vars(stmt, shape.data_read), reads_vars(stmt, 1 - shape.data_read)
    ivars = [iv.var for iv in stmt.iter_vars]
    channels = (shape.n, shape.f)  # the output's two channel axes
    vector = next((i for i in channels if ivars[i] in grad_vars), None)
    if vector is None:
        return None
    channel_row = channels[1] if vector == channels[0] else channels[0]
    if ivars[vector] in data_vars or ivars[channel_row] in grad_vars:
        return None  # grouped: one operand's planes depend on both channels
    taps, channels_out = shape.extents[shape.x], shape.extents[vector]
    dtype_bytes = element_bytes(stmt.writes[0].source.dtype)
    fitting = [vectors for vectors in (4, 3, 2)
               if (2 <= taps <= 5 and channels_out % (vectors * lanes) == 0
                   and taps * vectors * lanes * dtype_bytes < STACK_BYTES)]
    tiles = [(vectors, rows) for vectors in fitting
             if (rows := _channel_rows(taps * vectors, vectors, shape.extents[channel_row], num_registers))]
    if num_registers < 32:
        # The most accumulators (more vectors first on a tie).
        tiles = sorted(tiles, key=lambda t: -taps * t[0] * t[1])
    if tiles:
        vectors, channel_rows = tiles[0]
        return GemmTile(vector, shape.x, taps, vectors, channel_row if channel_rows > 1 else None, channel_rows)
    if not tile_fits(channels_out, shape.extents[channel_row], lanes):
        return None
    return GemmTile(vector, channel_row, TILE_ROWS, TILE_VECTORS)


def _schedule(sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape, lanes: int) -> bool:
    group_axis = _group_axis(sch, main, shape)
    pad = data_producer(sch, main, shape.data_read)
    loops = sch.get_loops(main)
    ry, rx = loops[shape.window[0]], loops[shape.window[1]]
    if _contiguous_plane(sch, main, shape):
        sch.reorder(ry, rx)
        rx = sch.fuse(ry, rx)
    width = lanes
    extent = static_extent(sch, rx) or 0
    while width >= 4 and extent % width:
        width //= 2
    if width < 4:
        return False
    _, lane = sch.split(rx, [None, width])
    partial = sch.rfactor(lane, factor_axis=len(sch.get(main).writes[0].region))

    # The partial block's iterators: first the lane (rfactor puts it first), then the outputs
    # and the remaining reductions. The two biggest outputs form the register tile.
    stmt = sch.get(partial)
    bound = {}
    for iv in stmt.iter_vars:
        loop = loop_binding(sch, partial, iv.var)
        if loop is None:
            return False
        bound[iv.var] = loop
    lane_loop = bound[stmt.iter_vars[0].var]
    outputs = [iv for iv in stmt.iter_vars[1:] if iv.iter_type == tirx.IterVar.DataPar]
    reduce_loops = [bound[iv.var] for iv in stmt.iter_vars
                    if iv.iter_type == tirx.IterVar.CommReduce]
    biggest = sorted(outputs, key=lambda iv: -int(iv.dom.extent))[:2]
    outer_loops, tile_loops = [], []
    group = None  # the loop over tiles of output channels
    for iv in outputs:
        loop = bound[iv.var]
        in_group = iv.var.name == group_axis  # rfactor's block keeps the names
        if any(iv.same_as(b) for b in biggest) and int(iv.dom.extent) > 1:
            size = TILE[len(tile_loops)]
            size = next(t for t in range(size, 0, -1) if int(iv.dom.extent) % t == 0)
            outer, inner = sch.split(loop, [None, size])
            outer_loops.append(outer)
            tile_loops.append(inner)
            loop = outer
        else:
            outer_loops.append(loop)
        if in_group:
            group = loop
    inner_loops: list[LoopRV] = []
    # A plane-per-tile loop with too few tiles to share (a first layer's 3 input channels, one
    # tile) runs ungrouped: its one iteration ran the whole gradient on one core.
    if pad is not None and group is not None and (static_extent(sch, group) or 0) >= MIN_GROUP_TILES:
        # Grouped (a depthwise conv's gradient): each tile of output channels reads its own
        # planes. The parallel loop runs over those tiles, and the planes are padded right
        # before their tile, once, instead of the whole input up front (the benchmark CNN's
        # biggest buffer, 27 MiB, which TVM's workspace pool then kept between calls).
        inner_loops = [loop for loop in outer_loops if loop is not group]
        outer_loops = [group]
    sch.reorder(*outer_loops, *inner_loops, *reduce_loops, *tile_loops, lane_loop)
    outer = sch.fuse(*outer_loops) if len(outer_loops) > 1 else outer_loops[0]
    if inner_loops:
        pad_at(sch, pad, outer, lanes)  # type: ignore[arg-type]
    # The tile of partial sums lives in registers: a small "global" buffer (see matmul.py).
    store = sch.cache_write(partial, 0, "global")
    sch.reverse_compute_at(store, outer, preserve_unit_loops=True)
    work = width
    for loop in [*inner_loops, *reduce_loops, *tile_loops]:
        work *= work_extent(sch, loop)
    parallelize(sch, [outer], work)
    for loop in tile_loops:
        sch.unroll(loop)
    sch.vectorize(lane_loop)
    # NOTE: last: once the init is split off, parallel/vectorize refuse the block.
    sch.decompose_reduction(partial, reduce_loops[0])
    return True

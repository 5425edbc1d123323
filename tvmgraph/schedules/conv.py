"""Direct 2-D convolution (NCHW) with a kernel window: 3x3 (any stride, padding) and depthwise.

Matches a PrimFunc whose one reduction block is `out[n, f, y, x] += data[.., y*s + ry,
x*s + rx] * weight[f, .., ry, rx]` with a window larger than 1x1 (1x1 convolutions are
matmuls and go to `matmul.py`; this rule comes first and leaves them alone). The data is
usually a zero-padding block (`pad_temp`) in front of the convolution.

Schedule, with `vx` output columns per vector (16 floats on AVX-512, fewer for narrow images):
  * regular conv: a register tile of `tf` output channels x `ty` rows x one vector of
    columns (8 x 2 with 32 vector registers, 4 x 3 with 16); loops parallel(n, f / tf) >
    y / ty > x / vx > rc > ry > rx > unroll(tf, ty) > vector(vx): each step loads ty row
    segments of the input and broadcasts `tf` weights.
  * depthwise conv (groups = channels): a tile of `ty` output rows x one vector of columns;
    loops parallel(n, c) > y / ty > x / vx > unroll(ry, rx, ty) > vector(vx), with the
    channel's zero-padded plane built right before it (it stays in L1 instead of a padded
    copy of the whole tensor going through memory).
The accumulators live in registers (a small cache_write buffer that LLVM promotes) and
injective consumers of the output are computed on them before the store.

The batch may be symbolic (a dynamic batch); it is only run in parallel.

Limits: NCHW only; the output width should be a multiple of 4 to vectorize (else columns run
scalar); stride > 1 reads the input with a stride (the vector loads become gathers);
no Winograd, no input-channel blocking (fine for the channel counts of MobileNet-style nets).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.target import Target

from .unchecked import Schedule
from .cpu_target import CPUTarget, is_cpu
from .fallback import schedule_remaining
from .loops import (
    inline_spatial_blocks,
    is_spatial,
    iter_kinds,
    reads_at_its_own_indices,
    root_blocks,
    static_extent,
    vars_in,
)


def find_conv(func: tirx.PrimFunc, target: Target) -> tuple[Schedule, SBlockRV, ConvShape] | None:
    """A schedule of `func`, its one reduction block and the convolution it computes; None when
    `func` is not a convolution with a window (see `conv_shape`) or the target no CPU."""
    if not is_cpu(target):
        return None
    sch = Schedule(func)
    reductions = [b for b in root_blocks(sch) if not is_spatial(sch, b)]
    if len(reductions) != 1:
        return None
    shape = conv_shape(sch, reductions[0])
    return None if shape is None else (sch, reductions[0], shape)


class Conv2d(ScheduleRule):
    """Register-tiled direct convolution for windows larger than 1x1."""

    # Schedules only a kernel with a reduction block (ApplyCPUSchedules tries it on no other).
    needs_reduction = True
    needs_binary_reduction = True  # one C += data * w block (find_conv)

    # Built at -O3 whatever the target's level (apply.OPT_LEVEL_ATTR): LLVM's -O1 leaves the
    # unrolled window's address arithmetic and the tile's predicates in the inner loop.
    # ResNet-18's inference 0.88x the time, the CNN's (depthwise) 0.81x, training steps
    # 0.96-0.97x (A/B, Zen 3, 2026-11-28); the first call's compile time did not move.
    llvm_opt_level = 3

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when the PrimFunc is not such a convolution."""
        found = find_conv(func, target)
        if found is None or found[2].is_weight_gradient:
            return None
        sch, main, shape = found
        inline_spatial_blocks(sch, keep=(main,))
        cpu = CPUTarget.from_target(target)
        lanes = cpu.lanes(str(sch.get(main).writes[0].source.dtype))
        if shape.depthwise:
            _schedule_depthwise(sch, main, shape, lanes)
        else:
            _schedule_regular(sch, main, shape, lanes, cpu.num_vector_registers)
        schedule_remaining(sch, cpu)
        return sch


class ConvShape:
    """Loop positions of a convolution block: output axes, reduction axes, the window."""

    def __init__(self, n: int, f: int, y: int, x: int, reduce: list[int], window: list[int],
                 depthwise: bool, data_read: int, extents: list[int]) -> None:
        self.n, self.f, self.y, self.x = n, f, y, x
        self.reduce, self.window = reduce, window
        self.depthwise, self.data_read = depthwise, data_read
        self.extents = extents

    @property
    def is_weight_gradient(self) -> bool:
        """The window is larger than the output plane: a weight gradient, where the "window"
        runs over the whole image and the "output" over the kernel's offsets."""
        window = self.extents[self.window[0]] * self.extents[self.window[-1]]
        return window > self.extents[self.y] * self.extents[self.x]


def conv_shape(sch: s_tir.Schedule, main: SBlockRV) -> ConvShape | None:
    """Recognize out[n, f, y, x] += data[.., y*s + ry, x*s + rx] * w[.., ry, rx]."""
    kinds = iter_kinds(sch, main)
    stmt = sch.get(main)
    if kinds is None or len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return None
    out = [r.min for r in stmt.writes[0].region]
    if len(out) != 4 or not all(isinstance(v, tirx.Var) for v in out):
        return None
    if not str(stmt.writes[0].source.dtype).startswith("float"):
        return None
    ivars = [iv.var for iv in stmt.iter_vars]
    pos = {v: i for i, v in enumerate(ivars)}
    if any(v not in pos or kinds[pos[v]] != "S" for v in out):
        return None
    extent = [static_extent(sch, l) for l in sch.get_loops(main)]
    reduce = [i for i, k in enumerate(kinds) if k == "R"]
    if len(kinds) - len(reduce) != 4:
        return None
    # The data operand indexes its last two axes by output column/row plus a reduction iter.
    for data_read in (0, 1):
        region = stmt.reads[data_read].region
        if len(region) != 4:
            continue
        last, second = vars_in(region[-1].min), vars_in(region[-2].min)
        if out[3] in last and out[2] in second:
            break
    else:
        return None
    window = [i for i in reduce if ivars[i] in second] + [i for i in reduce if ivars[i] in last]
    if len(window) != 2 or all(extent[i] == 1 for i in window):
        return None  # a 1x1 kernel is a matmul
    channel = [i for i in reduce if i not in window]
    # Only the batch may be symbolic (a dynamic batch): the output's first axis, or the
    # reduction over images of a weight gradient. The schedules tile the other axes.
    if any(e is None and i != pos[out[0]] and i not in channel for i, e in enumerate(extent)):
        return None
    depthwise = all(extent[i] == 1 for i in channel)
    return ConvShape(pos[out[0]], pos[out[1]], pos[out[2]], pos[out[3]], reduce, window,
                     depthwise, data_read, extent)  # type: ignore[arg-type]


def _vector_width(extent: int, lanes: int) -> int:
    width = lanes
    while width > 1 and extent % width:
        width //= 2
    return width if width >= 4 else 1


def _largest_divisor(extent: int, candidates: tuple[int, ...]) -> int:
    return next((c for c in candidates if extent % c == 0), 1)


# Output rows per register tile of a regular conv. One row (8 channels x 1 vector: 8
# accumulators, 1 load and 8 broadcasts per 8 FMAs) was load-bound at 67-70% of the FMA peak;
# two rows share the 8 broadcasts (16 accumulators): ResNet-18's 3x3 convs on 32x32 and 16x16
# images 3.18 -> 2.65 ms, 80-87% (Zen 5). 4 channels x 4 rows measured the same.
TILE_ROWS = 2
# With 16 vector registers (AVX2) the tile is 4 channels x 3 rows: 12 accumulators. 4 x 2
# kept 8 FMAs in flight, just what two FMA pipes of latency 4 need, and ran ResNet-18's 3x3
# convs on 32x32 and 16x16 images at 53-60% of the FMA peak; 4 x 3 at 64-72% (Zen 3, in
# ResNet-18's profile; 4 x 4 spills). Rows that are not a multiple of 3 leave a partial last
# tile, a predicate on its rows that only -O3 hoists out of the reduction loops
# (Conv2d.llvm_opt_level): at -O1 the same kernels took 2.5x as long.
AVX2_TILE_ROWS = 3


def _tile_rows(rows: int | None, registers: int) -> int:
    if registers < 32 and rows is not None and rows >= AVX2_TILE_ROWS:
        return AVX2_TILE_ROWS
    return _largest_divisor(rows or 1, (TILE_ROWS,))


def _schedule_regular(
    sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape, lanes: int, registers: int
) -> None:
    loops = sch.get_loops(main)
    n, f, y, x = (loops[i] for i in (shape.n, shape.f, shape.y, shape.x))
    reduce = [loops[i] for i in shape.reduce]
    vx = _vector_width(static_extent(sch, x) or 1, lanes)
    tf = _largest_divisor(static_extent(sch, f) or 1, (8, 6, 4, 3, 2) if registers >= 32 else
                          (4, 3, 2))
    ty = _tile_rows(static_extent(sch, y), registers)
    fo, fi = sch.split(f, [None, tf])
    yo, yi = sch.split(y, [None, ty])
    xo, xi = sch.split(x, [None, vx])
    sch.reorder(n, fo, yo, xo, *reduce, fi, yi, xi)
    outer = sch.fuse(n, fo)
    _finish(sch, main, outer, xo, [fi, yi], xi, vx, reduce, window_unroll=False)


def _schedule_depthwise(sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape, lanes: int) -> None:
    loops = sch.get_loops(main)
    n, f, y, x = (loops[i] for i in (shape.n, shape.f, shape.y, shape.x))
    reduce = [loops[i] for i in shape.reduce]
    vx = _vector_width(static_extent(sch, x) or 1, lanes)
    ty = _largest_divisor(static_extent(sch, y) or 1, (4, 2))
    yo, yi = sch.split(y, [None, ty])
    xo, xi = sch.split(x, [None, vx])
    sch.reorder(n, f, yo, xo, *reduce, yi, xi)
    pad = data_producer(sch, main, shape.data_read)
    if pad is not None and _column_stride(sch, main, shape) == 2:
        _split_columns_by_parity(sch, pad)
    _finish(sch, main, n, xo, [yi], xi, vx, reduce, window_unroll=True)
    if pad is not None:
        pad_at(sch, pad, n, lanes)


def _column_stride(sch: s_tir.Schedule, main: SBlockRV, shape: ConvShape) -> int:
    """The stride along the width, from the extents: (padded width - kernel) / (width - 1)."""
    stmt = sch.get(main)
    data = stmt.reads[shape.data_read].source
    width_in = int(data.shape[-1])
    width_out = int(stmt.writes[0].source.shape[-1])
    kernel = max(int(iv.dom.extent) for i, iv in enumerate(stmt.iter_vars) if i in shape.reduce)
    if width_out <= 1:
        return 1
    return (width_in - kernel) // (width_out - 1)


def _split_columns_by_parity(sch: s_tir.Schedule, pad: SBlockRV) -> None:
    """Store the padded input as [.., row, column % 2, column / 2]: a stride-2 window then
    reads contiguous vectors (even columns for kernel offsets 0 and 2, odd ones for 1)."""
    shape = sch.get(pad).writes[0].source.shape
    if int(shape[-1]) % 2 or len(shape) != 4:
        return

    def by_parity(n: tirx.Var, c: tirx.Var, h: tirx.Var, w: tirx.Var) -> tuple:
        return (n, c, h, w % 2, w // 2)

    sch.transform_layout(pad, ("write", 0), by_parity)
    sch.transform_block_layout(pad, by_parity)


def pad_at(sch: s_tir.Schedule, pad: SBlockRV, loop: LoopRV, lanes: int) -> None:
    """Build the zero-padded planes that one iteration of `loop` reads right before it (for a
    depthwise conv, one image's: they stay in L2): a vector fill of zeros, then a branch-free
    copy of the interior rows.

    NOTE: not per channel plane: there, the convolution's loads straddle the copy's
    just-written stores and every load misses store-to-load forwarding (3x slower).
    """
    sch.compute_at(pad, loop, preserve_unit_loops=True)
    blocks = [pad]
    try:
        blocks.insert(0, sch.decompose_padding(pad, sch.get_loops(pad)[1]))
    except s_tir.ScheduleError:
        pass  # not a padding pattern (e.g. no padding at all): one plain copy
    for block in blocks:
        loops = sch.get_loops(block)[1:]
        if not loops:
            continue
        inner = loops[-1]
        if len(loops) > 1 and block is not pad:
            inner = sch.fuse(*loops)
        width = _vector_width(static_extent(sch, inner) or 1, lanes)
        if width > 1:
            sch.vectorize(sch.split(inner, [None, width])[1])


def data_producer(sch: s_tir.Schedule, main: SBlockRV, data_read: int) -> SBlockRV | None:
    buffer = sch.get(main).reads[data_read].source
    for block in sch.get_producers(main):
        if any(w.source.same_as(buffer) for w in sch.get(block).writes) and is_spatial(sch, block):
            return block
    return None


def _finish(
    sch: s_tir.Schedule,
    main: SBlockRV,
    outer: LoopRV,
    tile_loop: LoopRV,
    unrolled: list[LoopRV],
    vector: LoopRV,
    vx: int,
    reduce: list[LoopRV],
    window_unroll: bool,
) -> None:
    """Registers for the accumulator tile, epilogue on the store, parallel outer loop."""
    # NOTE: "global", not "local": this TVM puts a small "global" allocation on the stack but
    # every "local" one on the heap (TVMBackendAllocWorkspace) once per parallel iteration.
    store = sch.cache_write(main, 0, "global")
    sch.reverse_compute_at(store, tile_loop, preserve_unit_loops=True)
    for consumer in list(sch.get_consumers(store)):
        try:
            sch.reverse_compute_inline(consumer)
        except s_tir.ScheduleError:
            if reads_at_its_own_indices(sch, consumer, [store]):  # else after all tiles
                sch.reverse_compute_at(consumer, tile_loop, preserve_unit_loops=True)
    sch.parallel(outer)
    for loop in unrolled:
        sch.unroll(loop)
    if window_unroll:
        for loop in reduce:
            sch.unroll(loop)
    if vx > 1:
        sch.vectorize(vector)
        for block in [store, *sch.get_consumers(store)]:
            inner = sch.get_loops(block)[-1]
            if (static_extent(sch, inner) or 0) % vx == 0:
                sch.vectorize(sch.split(inner, [None, vx])[1])
    sch.decompose_reduction(main, reduce[0])

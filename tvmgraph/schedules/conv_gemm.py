"""A convolution's weight gradient as an implicit GEMM with channels in the vectors.

conv_grad.py's direct schedule puts image columns in the vector registers: on the small images
of a network's last stages (4x4, 8x8) most lanes idle. Here one output axis that is a channel
axis goes in the vectors (`vector`), and `rows` consecutive indices of another output axis
(`row`) form the rows of the register tile:

    out[.., row, .., vector] += A[.., row-indexed ..] * B[.., vector-indexed ..]    (over K)

For a weight gradient dW[f, c, ky, kx], `vector` = output channels f, and `row` = the kernel's
columns kx (3 rows x 4 vectors: 12 accumulators, 768 bytes; with 32 vector registers each of
2 input channels, an `outer_row`, has its 3: 24 accumulators; with 16, 2 input channels x 3 rows
x 2 vectors, conv_grad._channel_rows) or, for a 1x1 kernel, 4 input
channels (x 2 vectors); K runs over the batch's pixels (conv_grad.py picks the tile). Each step
of K (the reduction loops, kept as they are) broadcasts one value of A per tile row and loads
the vectors of B.

Steps:
  1. Each operand whose row/vector axis is not its last one is copied channel-last first
     (a padding block changes layout; a parameter is copied): the vector loads are contiguous,
     and so are the broadcasts.
  2. Loops: parallel(vector tiles, row tiles, the other output axes) > K loops > unroll(rows)
     > unroll(vectors) > vector(lanes). The tile is a small "global" buffer (matmul.py's NOTE),
     laid out with the vector axis last, stored to the output after K.
  3. When the first reduction loop (the batch, for a weight gradient) reads more than
     BLOCK_BYTES of B (dy), it is cut into blocks of images that fit, and the blocks run
     outside the parallel loop: every tile of a block reads the same images from L2. The tiles
     then accumulate into a channel-last copy of the output, copied to the output at the end.
     With the whole batch inside each tile, every tile streamed all of dy from L3: ResNet-18's
     dW on 32x32 images (4 MiB of dy, 192 tiles) took 4.4 ms, now 2.7; on 16x16 4.9, now 3.2.

Tried and left out: the same form for forward convolutions on 4x4 images (output columns as
rows) ran no faster than conv.py's schedule (94 vs 110 GFLOP/s, 512 channels); those run as
im2col + matmul instead (relay_passes/im2col_conv.py). Limits: static channel extents.
ResNet-18's dW ran at 71% of the FMA peak on 32x32 images, 56-57% on 16x16 (Zen 5, 2 cores,
in the training step's profile) with 12-vector tiles; on Sapphire Rapids, where dy's loads
from L2 bound those, 24-vector tiles took it from 48 to 55% (32x32) and 50 to 58% (16x16).
On 4x4 and 8x8 images (47-54% here) the weight gradients run as an im2col copy with the batch inside and one matmul instead, at 66-79%
(relay_passes/im2col_conv.py); an earlier try of that form laid the windows out one row per
pixel of dy, and that copy alone took 2.6 ms.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.schedule import LoopRV, SBlockRV

from .conv import data_producer
from .loops import static_extent, vars_in, work_extent

# The register tile: TILE_ROWS broadcast values x TILE_VECTORS vectors.
TILE_ROWS, TILE_VECTORS = 4, 2
# A block of K (whole images) reads at most this much of B, half of Zen 5's 1 MiB L2 per core,
# so that it stays there while all tiles use it.
BLOCK_BYTES = 512 * 1024


def tile_fits(vector_extent: int, row_extent: int, lanes: int) -> bool:
    """Whether the vector and row axes split into whole tiles."""
    return vector_extent % (TILE_VECTORS * lanes) == 0 and row_extent % TILE_ROWS == 0


def reads_vars(stmt: s_tir.SBlock, read: int) -> set[tirx.Var]:
    """The block iterators that index operand `read` of `stmt`."""
    return set().union(*(vars_in(r.min) for r in stmt.reads[read].region))


def _move_axis_last(sch: s_tir.Schedule, main: SBlockRV, buffer: tuple[str, int], axis: int) -> None:
    """Lay out one of `main`'s buffers (("read" | "write", index)) with `axis` last."""
    kind, index = buffer
    stmt = sch.get(main)
    ndim = len((stmt.writes if kind == "write" else stmt.reads)[index].region)
    order = [i for i in range(ndim) if i != axis] + [axis]
    sch.transform_layout(main, buffer, lambda *idx: tuple(idx[i] for i in order))


def _make_channel_last(sch: s_tir.Schedule, main: SBlockRV, read: int, var: tirx.Var) -> None:
    """Give `main`'s operand `read` a layout whose last axis is the one `var` indexes."""
    region = sch.get(main).reads[read].region
    axis = next(i for i, r in enumerate(region) if var in vars_in(r.min))
    if axis == len(region) - 1:
        return
    if data_producer(sch, main, read) is None:  # a parameter: copied first
        sch.cache_read(main, read, "global")
    _move_axis_last(sch, main, ("read", read), axis)


def schedule_implicit_gemm(sch: s_tir.Schedule, main: SBlockRV, vector: int, row: int,
                           reduce: list[int], lanes: int, rows: int = TILE_ROWS,
                           vectors: int = TILE_VECTORS, outer_row: int | None = None,
                           outer_rows: int = 1) -> None:
    """Schedule `main` (loop positions: `vector`, `row` among its outputs, `reduce` its
    reduction loops) as described in the module docstring. With `outer_row` (another output
    axis), the tile's rows are `outer_rows` x `rows`: that many indices of `outer_row`, each
    with `rows` indices of `row`."""
    stmt = sch.get(main)
    ivars = [iv.var for iv in stmt.iter_vars]
    for read in range(len(stmt.reads)):
        used = reads_vars(stmt, read)
        for axis in (vector, row):
            if ivars[axis] in used:
                _make_channel_last(sch, main, read, ivars[axis])
    loops = sch.get_loops(main)
    tile_axes = (vector, row) if outer_row is None else (vector, row, outer_row)
    others = [loops[i] for i in range(len(loops)) if i not in (*tile_axes, *reduce)]
    reduce_loops = [loops[i] for i in reduce]
    blocks = _block_first_reduction(sch, reduce_loops, loops[vector])
    if blocks is not None:
        reduce_loops = blocks[1:]
    outermost = blocks[:1] if blocks is not None else []
    vec_outer, vec_inner = sch.split(loops[vector], [None, vectors * lanes])
    vec_unrolled, lane = sch.split(vec_inner, [vectors, lanes])
    row_outer, row_inner = sch.split(loops[row], [None, rows])
    if outer_row is None:
        tile_rows, row_tiles = [row_inner], [row_outer]
    else:
        outer_tiles, outer_inner = sch.split(loops[outer_row], [None, outer_rows])
        tile_rows, row_tiles = [outer_inner, row_inner], [outer_tiles, row_outer]
    sch.reorder(*outermost, vec_outer, *row_tiles, *others, *reduce_loops, *tile_rows, vec_unrolled, lane)
    outer = sch.fuse(vec_outer, *row_tiles, *others)
    store = sch.cache_write(main, 0, "global")
    # NOTE: the vector axis last in the tile too: LLVM at -O1 keeps the tile in registers only
    # when its vectors are contiguous (8x slower otherwise).
    written = [r.min for r in sch.get(main).writes[0].region]
    vector_axis = next(i for i, v in enumerate(written) if v.same_as(ivars[vector]))
    _move_axis_last(sch, main, ("write", 0), vector_axis)
    if blocks is None:  # the tile's sums are complete: stored from registers per tile
        sch.reverse_compute_at(store, outer, preserve_unit_loops=True)
    sch.parallel(outer)
    for loop in tile_rows:
        sch.unroll(loop)
    sch.unroll(vec_unrolled)
    sch.vectorize(lane)
    sch.decompose_reduction(main, blocks[0] if blocks is not None else reduce_loops[0])


def _block_first_reduction(sch: s_tir.Schedule, reduce_loops: list[LoopRV],
                           vector_loop: LoopRV) -> list[LoopRV] | None:
    """Split the first reduction loop into (blocks, images per block) so that a block's B,
    (images x the other reduction extents x the vector axis) floats, is at most BLOCK_BYTES;
    returns the blocks loop and the reduction loops inside it, or None when all of K is one
    block (or the batch is symbolic)."""
    first, *rest = reduce_loops
    per_image = 4 * work_extent(sch, vector_loop)
    for loop in rest:
        per_image *= work_extent(sch, loop)
    images = static_extent(sch, first)
    if images is None or images * per_image <= BLOCK_BYTES:
        return None
    block = max(1, BLOCK_BYTES // per_image)
    while images % block:
        block -= 1
    if block == 1:
        return [first, *rest]
    blocks, inner = sch.split(first, [None, block])
    return [blocks, inner, *rest]

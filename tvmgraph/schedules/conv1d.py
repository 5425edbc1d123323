"""The 1-D convolution of `relay_passes/direct_conv1d.py`, register-tiled.

That pass computes a conv1d as `padded[n, f, col] += phases[n, c, t % s, col + t // s] * w[f, c, k]`
(t = k * dilation) over rows padded to whole register tiles, then crops them (and FuseOps adds
the epilogue). Schedule:

    parallel(n, col / (tx * vx))          tiles of columns: work for every thread at batch 1
      phases of the tile's columns        (C x stride x (tx * vx + reach) floats: L1; a vector
                                           fill of zeros, then the copy of x)
      f / tf                              each channel tile reuses those phases
        c > k                             the reduction (input channels, taps)
          unroll(tf) > unroll(tx) > vector(vx)
        crop + epilogue of the tf x (tx * vx) accumulators, then the store

A grouped (depthwise) conv runs parallel(n, f / tf) > phases of the tile's groups > col /
(tx * vx) instead: its channel tiles share no rows of the phases. The register tile is tf
channels x tx vectors: 4 x 3 with 16 vector registers (12 accumulators; 3 loads and 4
broadcasts per 12 FMAs), 8 x 2 with 32."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from .cpu_target import CPUTarget, is_cpu
from .fallback import schedule_remaining
from .conv import pad_at
from .loops import inline_spatial_blocks, root_blocks, static_extent, vars_in
from .unchecked import Schedule


# The reduction block's name in relay_passes/direct_conv1d.py: the rule recognizes the kernel by it.
BLOCK = "conv1d_padded"

# Register tiles, best first: (vectors of columns, channel counts to try, speed relative to the
# first). With 16 registers 4 x 3 (12 accumulators) or 6 x 2; with 32, 8 x 2 or 8 x 1. A row is
# padded to whole tiles (`padded_row`), so that no tile is partial: a partial tile's predicate
# stayed inside the reduction loop and kept its accumulators in memory (a raw-audio net's
# first conv1d at 25% of the FMA peak, Zen 3).
TILES_16_REGISTERS = ((3, (4, 3, 2), 1.0), (2, (6, 4, 3, 2), 0.9))
TILES_32_REGISTERS = ((2, (8, 4, 2), 1.0), (1, (8, 4, 2), 0.8))


def _tiles(cpu: CPUTarget) -> tuple[tuple[int, tuple[int, ...], float], ...]:
    return TILES_32_REGISTERS if cpu.num_vector_registers >= 32 else TILES_16_REGISTERS


def padded_row(cpu: CPUTarget, length: int, dtype: str) -> int:
    """The row length to compute a conv1d's `length` output columns over: whole tiles of the
    tile that costs least, padding included."""
    lanes = cpu.lanes(dtype)

    def padded(vectors: int) -> int:
        return -(-length // (vectors * lanes)) * vectors * lanes

    return padded(min(_tiles(cpu), key=lambda tile: padded(tile[0]) / tile[2])[0])


def _grouped(sch: s_tir.Schedule, main: SBlockRV, phases: SBlockRV) -> bool:
    """Whether the product reads the phases at a channel that depends on the output channel (a
    grouped or depthwise conv: each output channel reads its group's rows only)."""
    stmt = sch.get(main)
    f_var = stmt.iter_vars[1].var
    buffer = sch.get(phases).writes[0].source
    return any(read.source.same_as(buffer) and f_var in vars_in(read.region[1].min) for read in stmt.reads)


class Conv1d(ScheduleRule):
    """Register tiles of output channels x whole vectors of columns for `padded_conv1d`."""

    # Schedules only a kernel with a reduction block (ApplyCPUSchedules tries it on no other).
    needs_reduction = True
    needs_block = BLOCK

    # Built at -O3, as Conv2d's unrolled register tiles are; only measured so (its rows are
    # whole tiles: there is no partial tile's predicate for -O3 to hoist, as in Conv2d).
    llvm_opt_level = 3

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when `func` holds no `padded_conv1d`."""
        if not is_cpu(target):
            return None
        sch = Schedule(func)
        blocks = {sch.get(b).name_hint: b for b in root_blocks(sch)}
        main = blocks.get(BLOCK)
        phases = blocks.get("conv1d_phases")
        if main is None or phases is None:
            return None
        inline_spatial_blocks(sch, keep=(main, phases))
        cpu = CPUTarget.from_target(target)
        out = sch.get(main).writes[0].source
        vx = cpu.lanes(str(out.dtype))
        n, f, col, *reduce = sch.get_loops(main)
        rows, filters = static_extent(sch, col), static_extent(sch, f)
        tile = next((t for t in _tiles(cpu) if rows and rows % (t[0] * vx) == 0), None)
        if tile is None or filters is None:
            return None  # padded for another target
        tx, channels, _ = tile
        tf = next((c for c in channels if filters % c == 0), 1)
        fo, fi = sch.split(f, [None, tf])
        xo, xv, xl = sch.split(col, [None, tx, vx])
        if _grouped(sch, main, phases):
            # Each channel tile reads its groups' rows only: their phases, whole, per tile.
            sch.reorder(n, fo, xo, *reduce, fi, xv, xl)
            outer, tile_loop = sch.fuse(n, fo), xo
        else:
            sch.reorder(n, xo, fo, *reduce, fi, xv, xl)
            outer, tile_loop = sch.fuse(n, xo), fo
        sch.parallel(outer)
        pad_at(sch, phases, outer, vx)  # a vector fill of zeros, then a copy of x
        for consumer in sch.get_consumers(main):
            sch.reverse_compute_at(consumer, tile_loop, preserve_unit_loops=True)
        sch.unroll(fi)
        sch.unroll(xv)
        sch.vectorize(xl)
        sch.decompose_reduction(main, reduce[0])
        schedule_remaining(sch, cpu)
        return sch

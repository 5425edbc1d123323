"""Dense and batched matmul (with fused epilogues) as an AVX-512/AVX2 register-tiled kernel.

Matches a PrimFunc with exactly one reduction block of the form
`C[S, I, J] += A[S, I, K] * B[S, J, K]` up to permutation of the axes (so `x @ w`, `x @ w.T`,
`x.T @ dy`, batched `bmm`, a matrix-vector product and a 1x1 convolution all match),
optionally preceded by injective producers and followed by injective epilogues (bias add,
ReLU, GELU, residual add, ...). The operand indexed by the output's innermost axis is B.

Schedule, with `lanes` floats per vector register (16 on AVX-512):
  1. Canonicalize the block to C[S, I, J] += A[S, I, K] * B[S, J, K] (dlight's reindexing),
     where J is the innermost axis of the output.
  2. Pick a register tile of `mi` rows by `nvec` vectors (e.g. 8 x 3 x 16 = 24 accumulators,
     or 4 x 3 x 16 for short K, from the core family's measured table, see `choose_tile`)
     that fits the register file, and zero-pad I and J up to whole tiles (`pad_einsum`); a
     padded A whose rows run along K is copied a tile's rows at a time, right before the tile
     (`_pad_a_per_tile`); an A whose rows run across K (x.T in a weight gradient) is copied
     whole with its rows along K first, unless K is short or A small (TRANSPOSED_A_COPY_K, _MIN_BYTES).
  3. Pack B into panels B[S, J / nj, K, nj] (nj = nvec * lanes) when B is not already
     contiguous along J, when J needs padding, or when enough rows of A reread each panel
     (CPUTarget.pack_reused_rows: 96 on Zen with AVX-512, 16 with AVX2, 32 on Intel): a panel row is then one contiguous read.
  4. Loops: parallel(S, J/nj) > [pack this panel] > I/mi > K > unroll(mi) > unroll(nvec) >
     vector(lanes) when there are at least PANELS_PER_THREAD panels per thread: each panel is
     packed right before its tiles read it (still in cache), into a workspace of one panel per
     thread instead of all of B (an inference MLP 784-1024-1024-10 at batch 64 peaked at 3.8
     MiB with B packed whole, 0.9 MiB panel by panel, and ran 8% faster). With fewer panels:
     B packed whole first, then parallel(S, J/nj, I/mi) > K > ... . An A taller than B and too
     big for L2 (ROW_BLOCK_MIN_A_BYTES) runs instead as B packed whole, then parallel(S, blocks
     of A's rows) > J/nj > the block's I/mi > K > ...: each block of A is read from memory once
     (`_tile_row_blocks`). The accumulator tile lives
     in registers (a small cache_write buffer that LLVM promotes) and the epilogue runs on it
     before it is stored. One row of A with B read in place (x @ W at batch 1) runs instead
     parallel(chunks of J) > steps of ROW_STEP rows of B > the chunk's panels > those rows, so
     that B's rows are read along their length (`_tile_one_row_by_k_steps`).
  5. x @ W.T with 16 to 64 rows of x and a large W (`swap_pays`) runs as W @ x.T: the
     operands swap roles before step 1, so that W is read in place and x is packed, and the
     epilogue stores each tile along its I (an output row's contiguous elements).

A dynamic batch makes some axes symbolic: the tile and the panel decision are those of batch 64
(loops.work_extent), preferring a tile that divides the constant the axis is a multiple of (the
transformer's n * 128 rows), and a symbolic I or J is zero-padded to whole tiles unless the tile
provably divides it (a 1x1 convolution's J, n * H * W, usually is).

Limits: float types only; no K blocking (fine while a B panel, K * nj
floats, fits in L2: K up to ~4096); B is packed on every call, even a weight an inference
graph reads unchanged: at 64 x 1024 x 1024 that caps the product at 61-67% of the FMA peak on
Zen 3, where panels packed once ran at 76-83% (docs/benchmarks.md); x @ W with W[K, N] (an
input gradient dy @ W) packs W through strided reads, a new page per row (on Sapphire Rapids
40% of a 64 x 1024 x 1024 product), which swapping the operands does not avoid (W's columns
would then be broadcast: 1.4-1.6x the time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad, TensorRegion
from tvm_ffi.structural import StructuralMutator, structural_mutate
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.gpu.matmul import IterKind, IterTrait, make_iter_fusion_index_map
from tvm.s_tir.schedule import LoopRV, SBlockRV
from tvm.sym import Analyzer
from tvm.target import Target

from .unchecked import Schedule
from .cpu_target import CPUTarget, is_cpu
from .fallback import schedule_remaining
from .loops import (
    element_bytes,
    enough_per_thread,
    inline_copies_into,
    inline_spatial_blocks,
    is_own_iterator,
    is_spatial,
    parallelize,
    reads_at_its_own_indices,
    root_blocks,
    static_extent,
    vars_in,
    work_extent,
)


@dataclass(frozen=True)
class Tile:
    """A register tile: `mi` rows of C by `nvec` vectors of `lanes` columns."""

    mi: int
    nvec: int
    lanes: int

    @property
    def nj(self) -> int:
        """Columns of C per tile."""
        return self.nvec * self.lanes


# Register tiles (mi rows, nvec vectors) and their throughput relative to the best, per core
# family (CPUTarget.core), for 32 and for 16 vector registers.
# Zen 5 (AVX-512), measured at 64..1024 x 1024 x 1024: 6 x 4 = 24 accumulators + 4 B vectors +
# 1 broadcast fill the 32 zmm registers; 8 x 4 spills a few accumulators.
_ZEN_TILES_32_REGS = {
    (6, 4): 1.0, (4, 3): 0.95, (5, 3): 0.95, (12, 2): 0.9, (8, 3): 0.9, (8, 4): 0.85,
    (6, 2): 0.85, (4, 4): 0.85, (8, 2): 0.75, (3, 4): 0.7, (4, 2): 0.6, (16, 1): 0.5,
    (2, 4): 0.45, (1, 4): 0.2, (1, 1): 0.05,
}
# Sapphire Rapids (2 vCPUs, both threads; `relu(x @ w.T)` at 64..4096 x 256..4096 x 256..4096,
# K >= 256): 8 x 3 was the fastest at every shape, 3-14% ahead of 4 x 3 (e.g. 1024 x 256 x 1024
# 63-68% of the FMA peak against 60%; 256 x 4096 x 4096 67% against 59%); 8 x 2 within 0-8% of
# it; 6 x 4, 4 x 4 and 5 x 3 5-20% behind; 8 x 4 (spills) 30% behind. 16 x 1 at J = 16
# (1 x 1 convolutions' weight gradients, 16 channels) did 0.67-0.9 of 8 x 2's work per second
# where 8 x 2 pads J to 32. Unmeasured tiles keep Zen's figure less 10%.
_INTEL_TILES_32_REGS = {
    (8, 3): 1.0, (8, 2): 0.95, (4, 3): 0.9, (6, 4): 0.9, (4, 4): 0.9, (5, 3): 0.85, (6, 2): 0.85,
    (12, 2): 0.8, (8, 4): 0.7, (3, 4): 0.63, (16, 1): 0.6, (4, 2): 0.54, (2, 4): 0.4,
    (1, 4): 0.18, (1, 1): 0.05,
}
# AVX2 (Zen 3, 16 ymm registers): with B packed (`relu(x @ w.T + b)`, 1020 x 240..480 x
# 256..1024, nothing padded) 6 x 2 ran at 75-77% of the FMA peak, 4 x 3 and 4 x 2 within 4-6% of
# it; but with B read in place 4 x 2 took 1.5-2x as long as 4 x 3 (an MLP's weight gradients,
# 1024 x 784..1024 x 64; 64 x 1024 x 1024: 2.77 against 1.30 ms), which loads fewer vectors per
# multiply-add: 4 x 2 keeps its lower figure. 5 x 2 (10 accumulators) ran within 10% of both
# either way at 1020 x 240..480 x 256..1024; it divides rows that 4 and 6 do not: a ViT's 65
# tokens, whose attention P @ V (64 x 65 x 65 x 32) took 0.14 ms against 0.27 with 6 x 2 (rows
# padded to 66) and 0.35 with 4 x 3.
_TILES_16_REGS = {
    (6, 2): 1.0, (4, 3): 1.0, (5, 2): 0.95, (4, 2): 0.8, (3, 2): 0.7, (2, 2): 0.5, (1, 2): 0.25,
    (1, 1): 0.1,
}
# Zen 4 (AVX-512 on 256-bit units, 2 vCPUs; `benchmarks.peak` 232 GFLOP/s), nothing padded,
# 480 x 768 x {1024, 4096} `a @ b` and 480 x 768 x 1024 `a @ b.T`: every tile of at most 8 rows
# that does not spill ran at 91-93% of the FMA peak on average, within 3% of each other (5 x 3
# first); 2 x 4 81%, 12 x 2 82% and 16 x 1 45% (rows of A 4 KiB apart: 12 or 16 of them share
# one set of the 8-way L1d; 94% at K = 256), 8 x 4 spills (79%).
_ZEN4_TILES_32_REGS = {
    (5, 3): 1.0, (4, 3): 0.99, (8, 2): 0.99, (4, 4): 0.99, (6, 4): 0.985, (8, 3): 0.985,
    (6, 2): 0.985, (3, 4): 0.98, (4, 2): 0.975, (12, 2): 0.88, (2, 4): 0.86, (8, 4): 0.85,
    (16, 1): 0.5, (1, 4): 0.2, (1, 1): 0.05,
}
TILES = {("zen", 32): _ZEN_TILES_32_REGS, ("zen4", 32): _ZEN4_TILES_32_REGS,
         ("intel", 32): _INTEL_TILES_32_REGS,
         ("zen", 16): _TILES_16_REGS, ("zen4", 16): _TILES_16_REGS, ("intel", 16): _TILES_16_REGS}

# A static I padded to whole tiles: each tile's rows of A copied (zero-padded) once per B panel.
# With 32 registers (panels of 32-64 columns) that cost about 5%; with 16 (16-24 columns) each
# copy serves half as many multiply-adds: on Zen 3 a 6-row tile over 1024 or 64 rows ran 17-25%
# slower than over 1026 or 66 (4 x 2, 4 x 3 need no padding there and ran faster), a 4-row tile
# over 1026 rows 45% slower than over 1024.
_PADDING_PENALTY = {32: 1.05, 16: 1.25}
# On Zen 4 the copy costs more, the more so the fewer vectors a tile has to share it: at
# 484 x 768 x {256, 1024, 2304, 4096} (I padded to 486 for 6 rows), each tile against itself
# unpadded at 480 rows: 6 x 4 1.08-1.13x the time, 5 x 3 1.08-1.13x, 6 x 2 1.11-1.2x; ResNet-18's
# layer-4 product (512 x 4608 x 256 rows, 6 x 4 padding 512 to 516) 80% of the FMA peak against
# 92-94% for 4 x 4 and 8 x 2, which divide 512. About 1 + 0.35 / vectors.
_ZEN4_PADDING_COST_PER_TILE = 0.35


def _padding_penalty(core: str, registers: int, nvec: int) -> float:
    """Time factor of a tile whose rows do not divide a static I (see _PADDING_PENALTY)."""
    if core == "zen4" and registers == 32:
        return 1.0 + _ZEN4_PADDING_COST_PER_TILE / nvec
    return _PADDING_PENALTY[registers]


# A symbolic axis padded at run time: a zero-filled copy of all of A, made under a bounds test
# TVM cannot simplify (the transformer's 8192 x 1024 x 256 product over a dynamic batch: 2.3x
# its static time with a 6-row tile, which pads n * 128 rows); or A padded along a static I
# but copied along a symbolic K, one scalar at a time (a GPT's tied-embedding gradient,
# 4096 x 256 summed over n * 128 tokens: 2x its static time).
_SYMBOLIC_PADDING_PENALTY = 1.5
# NOTE: "global", not "local": TVM 0.27 keeps a "global" allocation under 1 KiB on the stack
# but sends every "local" one (and every larger one) through TVMBackendAllocWorkspace, once per
# tile. That call costs about as much as 64 steps of K, so short-K products (weight gradients,
# 1x1 convolutions) prefer tiles under 1 KiB: 4 x 3 x 16 floats = 768 bytes.
ACCUMULATOR_SCOPE = "global"
STACK_BYTES = 1024  # TVM keeps allocations under this on the stack (see the NOTE)
# On Sapphire Rapids the 8 x 3 tile (1.5 KiB) ran 0.76-0.93x as fast as 4 x 3 at K = 64 and
# 1.05-1.14x at K = 256: the call costs 7 to 28 of its K steps; 16 is taken.
# On Zen 4 the tiles of 1 KiB and more ran 2-5% behind the others at K = 256 (about 8 steps).
_ALLOC_COST_IN_K_STEPS = {"zen": 64, "zen4": 8, "intel": 16}
# Copying one float of B into a packed panel (memory-bound) costs about as much as this many
# vector FMA steps of one tile row.
_PACK_COST = 16.0


def choose_tile(
    i_extent: int, j_extent: int, lanes: int, num_registers: int, k_extent: int = 1024,
    dtype_bytes: int = 4, b_contiguous: bool = False,
    i_multiple: int | None = None, j_multiple: int | None = None, symbolic_k: bool = False,
    core: str = "intel",
) -> Tile:
    """The register tile with the least estimated time, in units of one tile-row FMA step.

    Counts the padded work over the tile's relative throughput, the per-tile heap allocation
    of tiles over 1 KiB, and, when B could be read in place but J needs padding, the copy
    that packing B then costs (about _PACK_COST FMA steps per element of B).

    A symbolic I or J (a dynamic batch) comes as its extent at batch 64 and `i_multiple` /
    `j_multiple`, the constant it is provably a multiple of (128 for n * 128): a tile that does
    not divide that is padded at run time, which costs more (_SYMBOLIC_PADDING_PENALTY), as does
    padding I when K is symbolic (`symbolic_k`: the padded copy of A then runs a symbolic loop).
    `core`: the core family whose measurements to use (CPUTarget.core).
    """
    registers = 32 if num_registers >= 32 else 16
    table = TILES[core, registers]
    best: tuple[float, Tile] | None = None
    for (mi, nvec), speed in table.items():
        if i_extent == 1 and mi != 1:
            continue  # a matrix-vector product: there is no I axis to pad (it may not exist)
        i_pad, j_pad = _round_up(i_extent, mi), _round_up(j_extent, nvec * lanes)
        pads_i = i_pad != i_extent if i_multiple is None else i_multiple % mi != 0
        pads_j = j_pad != j_extent if j_multiple is None else j_multiple % (nvec * lanes) != 0
        cost = i_pad * j_pad / speed
        if pads_i:  # the zero-padded copy of A
            cost *= _SYMBOLIC_PADDING_PENALTY if i_multiple is not None or symbolic_k else _padding_penalty(core, registers, nvec)
        if mi * nvec * lanes * dtype_bytes >= STACK_BYTES:
            cost *= 1.0 + _ALLOC_COST_IN_K_STEPS[core] / max(k_extent, 1)
        if b_contiguous and pads_j:
            cost += _PACK_COST * j_pad
        if best is None or cost < best[0]:
            best = (cost, Tile(mi, nvec, lanes))
    assert best is not None
    return best[1]


# Packing per panel needs this many panels per thread to keep every thread busy (S x J/nj
# parallel iterations of unequal cost at the edges); with fewer, B is packed whole first.
PANELS_PER_THREAD = 4


def _known_multiple(sch: s_tir.Schedule, loop: LoopRV) -> int | None:
    """None for a constant extent; for a symbolic one (a dynamic batch), the largest constant it
    is provably a multiple of (128 for n * 128, 1 for n)."""
    extent = sch.get(loop).extent
    if isinstance(extent, tirx.IntImm):
        return None
    return max(1, int(Analyzer().modular_set(extent).coeff))


def _divides(sch: s_tir.Schedule, loop: LoopRV, factor: int) -> bool:
    """Whether `factor` divides the loop's extent, symbolic (a dynamic batch) or not."""
    extent = sch.get(loop).extent
    if isinstance(extent, tirx.IntImm):
        return int(extent) % factor == 0
    return Analyzer().can_prove_equal(tirx.floormod(extent, factor), 0)


def enough_panels(s_extent: int, j_extent: int, tile: Tile, threads: int | None = None) -> bool:
    """Whether the product has enough B panels to run panel by panel in parallel (see `Matmul`;
    a symbolic extent comes at batch 64, loops.work_extent)."""
    return enough_per_thread(s_extent * ((j_extent + tile.nj - 1) // tile.nj), PANELS_PER_THREAD, threads)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def prepare_matmul(func: tirx.PrimFunc, target: Target) -> tuple[Schedule, SBlockRV, tuple] | None:
    """A schedule of `func` with the producers of its matmul block inlined into it, the block,
    and its two operands; None when `func` is not a (batched) matmul or the target no CPU."""
    if not is_cpu(target):
        return None
    sch = Schedule(func)
    main = matmul_block(sch)
    if main is None:
        return None
    inline_spatial_blocks(sch, keep=(main,))
    inline_copies_into(sch, main)
    operands = matmul_operands(sch.get(main))
    return None if operands is None else (sch, main, operands)


# x @ W.T with a few rows of x and a large W (nn.Linear at batch 16 to 64: an MLP's inference
# and forward pass). Packing W into panels is a transposing copy of all of W on every call, and
# it cost more than a third of the product: 0.25 ms of 0.72 at 64 x 1024 x 1024 (Sapphire
# Rapids, 2 vCPUs; MKL took 0.77). With the operands' roles swapped, C.T = W @ x.T, the tiles
# broadcast W's rows, read in place along K (a few sequential streams, from memory once), and
# the panels are x's, a copy I / J the size. Time swapped / W packed, relu(x @ W.T + b) on that
# machine (rows x K -> J): 64 x 784 -> 1024 0.89, 64 x 1024 -> 1024 0.84, 64 x 4096 -> 4096
# 0.76, 64 x 256 -> 1024 0.91, 48 x 1024 -> 1024 0.75; 32 x 1024 -> 1024 0.79 and 32 x 512 ->
# 512 0.81 against the MatrixVector rule, which took those. Slower: 64 x 1024 -> 256 1.01-1.11
# and 64 x 256 -> 256 1.6 (W in L2: its copy costs little), 100 rows 1.15, 128 rows 0.99, 256
# rows 1.04. At 16 rows only for a W of 8 MiB or more: against the MatrixVector rule or the
# packed product, 16 x 3072 -> 768 0.67, 16 x 2048 -> 2048 0.78, 16 x 4096 -> 1024 0.59,
# 16 x 4096 -> 4096 0.56, 16 x 8192 -> 1024 0.56; with less, MatrixVector's dot products were
# as fast or faster (16 x 1024 -> 1024 0.94, 16 x 2048 -> 512 1.02, 16 x 1024 -> 512 1.17,
# 16 x 1024 -> 256 1.7). Only measured on Intel with AVX-512, for float32, and taken there
# only: on Zen 5 an earlier swap (its store still along J) ran 1.4-1.9x slower
# (docs/schedules.md).
SWAP_ROWS = (16, 64)  # rows of x, a multiple of the vector lanes (x's panels then need no padding)
SWAP_MIN_COLUMNS_PER_ROW = 16  # rows of W per row of x
SWAP_MIN_B_BYTES = 1 << 20  # W
SWAP_MIN_B_BYTES_UNDER_32_ROWS = 8 << 20
SWAP_MIN_K = 256


def swaps_on(cpu: CPUTarget) -> bool:
    """Whether `swap_pays` may swap on this core: an Intel core with AVX-512, where measured."""
    return cpu.core == "intel" and cpu.num_vector_registers >= 32


def swap_pays(stmt: s_tir.SBlock, a: int, b: int, cpu: CPUTarget, dtype: str) -> bool:
    """Whether the product C[I, J] = A[I, K] B[J, K] runs faster as C.T = B @ A.T, its tiles
    along B's rows (see SWAP_ROWS): float32 on an Intel core with AVX-512 (`swaps_on`), static,
    unbatched, both operands contiguous along K, few rows of A against a large B, and a tile for
    the swapped product that pads neither axis."""
    if dtype != "float32" or not swaps_on(cpu):
        return False
    if not (contiguous_along_reduction(stmt, a) and contiguous_along_reduction(stmt, b)):
        return False
    traits = _traits(stmt, a, b)
    if traits is None or not all(isinstance(t.extent, tirx.IntImm) for t in traits):
        return False
    extent = {IterKind.kIter_S: 1, IterKind.kIter_I: 1, IterKind.kIter_J: 1, IterKind.kIter_K: 1}
    for trait in traits:
        if trait.kind in extent:
            extent[trait.kind] *= int(trait.extent)
    s, i, j, k = (extent[kind] for kind in (IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J,
                                             IterKind.kIter_K))
    lanes, dtype_bytes = cpu.lanes(dtype), element_bytes(dtype)
    min_b_bytes = SWAP_MIN_B_BYTES if i >= 32 else SWAP_MIN_B_BYTES_UNDER_32_ROWS
    if (s != 1 or not SWAP_ROWS[0] <= i <= SWAP_ROWS[1] or i % lanes or k < SWAP_MIN_K
            or j < SWAP_MIN_COLUMNS_PER_ROW * i or j * k * dtype_bytes < min_b_bytes):
        return False
    tile = choose_tile(j, i, lanes, cpu.num_vector_registers, k, dtype_bytes, core=cpu.core)
    return j % tile.mi == 0 and i % tile.nj == 0


class Matmul(ScheduleRule):
    """Register-tiled, packed, parallel matmul with the epilogue fused into the store."""

    # Schedules only a kernel with a reduction block (ApplyCPUSchedules tries it on no other).
    needs_reduction = True
    needs_binary_reduction = True  # one C += A * B block (prepare_matmul)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when the PrimFunc is not a (batched) matmul."""
        prepared = prepare_matmul(func, target)
        if prepared is None:
            return None
        sch, main, (a, b) = prepared
        cpu = CPUTarget.from_target(target)
        dtype = sch.get(main).writes[0].source.dtype
        # B a weight the caller can pack once (see WEIGHT_PACK): the product keeps it as B.
        frozen_b = is_layout_free(func, sch.get(main), b)
        # C.T = W @ x.T: the tiles run along W's rows (see swap_pays) and store transposed.
        swapped = not frozen_b and swap_pays(sch.get(main), a, b, cpu, dtype)
        if swapped:
            a, b = b, a
        a_rows_along_k = contiguous_along_reduction(sch.get(main), a)
        extents = canonicalize(sch, main, a, b)
        if extents is None:
            return None
        dtype_bytes = element_bytes(dtype)
        lanes = cpu.lanes(dtype)
        b_contiguous = _b_contiguous(func, sch, main, lanes)
        # A symbolic axis (a dynamic batch) is tiled as at batch 64 (loops.work_extent), the
        # static graph's batch, and padded to whole tiles (pad_einsum rounds it up at run time)
        # unless the tile provably divides it (a 1x1 convolution's J, n * H * W).
        s_loop, i_loop, j_loop, k_loop = sch.get_loops(main)
        s_at, i_at, j_at, k_at = (work_extent(sch, loop) for loop in (s_loop, i_loop, j_loop, k_loop))
        tile = choose_tile(i_at, j_at, lanes, cpu.num_vector_registers, k_at, dtype_bytes, b_contiguous,
                           _known_multiple(sch, i_loop), _known_multiple(sch, j_loop),
                           _known_multiple(sch, k_loop) is not None, core=cpu.core)
        pad_i = not _divides(sch, i_loop, tile.mi)
        pad_j = not _divides(sch, j_loop, tile.nj)
        if pad_i or pad_j:
            sch.pad_einsum(main, [1, tile.mi if pad_i else 1, tile.nj if pad_j else 1, 1])
        copy_a = (not a_rows_along_k and k_at >= TRANSPOSED_A_COPY_K
                  and i_at * k_at * dtype_bytes > TRANSPOSED_A_COPY_MIN_BYTES)
        # A 16-bit A reread by several panels of B is copied once, widened (see _narrower).
        widen_a = (_narrower(sch.get(main).reads[a].source.dtype, dtype)
                   and -(-j_at // tile.nj) >= WIDEN_A_MIN_PANELS)
        padded_a = _prepare_a(sch, main, a, copy=copy_a or widen_a)
        copied_a = producer_of(sch, main, a) if (copy_a or widen_a) and padded_a is None else None
        prepacked = frozen_b and i_at <= PREPACK_MAX_ROWS
        pack = prepacked or pad_j or not b_contiguous or i_at >= cpu.pack_reused_rows
        row_blocks = _row_block_tiles(sch, main, tile, pack, dtype_bytes)
        panel_major = pack and enough_panels(s_at, j_at, tile) and row_blocks is None
        packed = _prepare_b(sch, main, b, tile, pack, b_contiguous, schedule=prepacked or not panel_major)
        if prepacked:
            sch.annotate(packed, WEIGHT_PACK, 1)
        # 16-bit operands widened once, in their copies, not at every FMA (see _narrower).
        widened = []
        for copy in (padded_a, copied_a, packed):
            if copy is not None and _narrower(sch.get(copy).writes[0].source.dtype, dtype):
                sch.unsafe_set_dtype(copy, 0, str(dtype))
                widened.append(sch.get(copy).writes[0].source)
        padded = tuple(axis for axis, pad in ((1, pad_i), (2, pad_j)) if pad)
        chunks = None if pack else _row_chunks(*extents, tile)  # static extents only
        if chunks is not None:
            outer = tile_loop = _tile_one_row_by_k_steps(sch, main, tile, chunks)
        elif row_blocks is not None:
            outer, tile_loop = _tile_row_blocks(sch, main, tile, row_blocks, padded, store_along_i=swapped)
        else:
            rows_outer = not panel_major and _rows_outermost(i_at, j_at, k_at, dtype_bytes)
            outer, tile_loop = _tile_main(sch, main, tile, panel_major, padded, rows_outer,
                                          store_along_i=swapped)
        if panel_major and not prepacked:
            sch.compute_at(packed, outer, preserve_unit_loops=True)
            _schedule_pack(sch, packed, tile, b_contiguous, parallel=False)
        if padded_a is not None and a_rows_along_k:
            _pad_a_per_tile(sch, padded_a, tile_loop, tile)
        schedule_remaining(sch, cpu)
        if widened:
            return Schedule(_read_widened(sch.mod["main"], widened))
        return sch


def _read_widened(func: tirx.PrimFunc, widened: list) -> tirx.PrimFunc:
    """`func` reading its widened copies as they are: unsafe_set_dtype leaves every read of a
    copy as `Cast(float32, Cast(bfloat16, copy[..]))`, a rounding LLVM cannot drop; the values
    are widened 16-bit ones, which that rounding leaves unchanged."""

    def unround(node: tirx.PrimExpr, mutator: StructuralMutator) -> tirx.PrimExpr:
        node = mutator.default_mutate(node)
        inner = node.value
        if (isinstance(inner, tirx.Cast) and isinstance(inner.value, TensorLoad)
                and any(inner.value.source.same_as(w) for w in widened)
                and str(inner.value.ty) == str(node.ty) and _narrower(str(inner.ty), str(node.ty))):
            return inner.value
        return node

    return structural_mutate(func, [(tirx.Cast, unround)])


# The attribute TVM's SplitLayoutRewritePreproc looks for: the block that packs a weight, which
# it moves into a function of its own (relay_passes/weight_packing.py then runs that once per
# weight version instead of once per call). Packing W per call costs about as much as reading
# it, which is what a 64-row product's multiply-adds take. Sapphire Rapids (2 vCPUs, 478
# GFLOP/s peak), relu(x @ W.T + b) alone, medians of 31: 64 x 784 -> 1024 326 -> 293 us (84% of
# the peak at best), 64 x 1024 -> 1024 429 -> 405 us (against the swapped product, W read in
# place); in an MLP's program 329 -> 303 and 412 -> 419 us.
WEIGHT_PACK = "meta_schedule.layout_rewrite_preproc"
# With more rows the per-call pack costs little, and it runs panel by panel, each packed panel
# read from L2: relu(x @ W.T + b) at 256 x 4096 -> 4096 took 1.1x the time with W prepacked
# (its panels then come from memory).
PREPACK_MAX_ROWS = 64


def is_layout_free(func: tirx.PrimFunc, stmt: s_tir.SBlock, operand: int) -> bool:
    """Whether the block's read `operand` is a parameter of `func` listed in its
    `layout_free_buffers` attribute: a weight the caller may hand over in any layout."""
    free = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    if not free:
        return False
    source = stmt.reads[operand].source
    return any(source.same_as(func.params[int(i)]) for i in free)


def matmul_block(sch: s_tir.Schedule) -> SBlockRV | None:
    """The single multiply-accumulate reduction block, if the function has one and only one."""
    reductions = [b for b in root_blocks(sch) if not is_spatial(sch, b)]
    if len(reductions) != 1:
        return None
    stmt = sch.get(reductions[0])
    if not _is_multiply_accumulate(stmt) or len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return None
    if not str(stmt.writes[0].source.dtype).startswith(("float", "bfloat")):
        return None
    return reductions[0]


def _is_multiply_accumulate(stmt: s_tir.SBlock) -> bool:
    """C[...] = C[...] + X * Y, where X and Y are (possibly cast) buffer loads."""
    body = stmt.body
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tirx.Add):
        return False

    def strip(e: tirx.PrimExpr) -> tirx.PrimExpr:
        return e.value if isinstance(e, tirx.Cast) else e

    lhs, rhs = body.value.a, body.value.b
    if isinstance(rhs, TensorLoad) and rhs.source.same_as(body.buffer):
        lhs, rhs = rhs, lhs
    if not (isinstance(lhs, TensorLoad) and lhs.source.same_as(body.buffer)):
        return False
    rhs = strip(rhs)
    return (
        isinstance(rhs, tirx.Mul)
        and isinstance(strip(rhs.a), TensorLoad)
        and isinstance(strip(rhs.b), TensorLoad)
    )


def matmul_operands(stmt: s_tir.SBlock) -> tuple[int, int] | None:
    """(A, B) read indices: B is the operand indexed by the output's innermost axis (J)."""
    c_last = stmt.writes[0].region[-1].min
    if not isinstance(c_last, tirx.Var):
        return None
    uses = [c_last in _region_vars(r) for r in stmt.reads]
    if len(uses) != 2:
        return None  # one buffer read twice through one region: a Gram matrix, `x @ x.mT`
    if uses[0] == uses[1]:
        return None  # both (a batch axis) or neither
    return (1, 0) if uses[0] else (0, 1)


def contiguous_along_reduction(stmt: s_tir.SBlock, operand: int) -> bool:
    """The operand's innermost index is a reduction iterator alone (its rows run along K)."""
    last = stmt.reads[operand].region[-1].min
    if not isinstance(last, tirx.Var):
        return False
    reduce = {iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    return vars_in(last) <= reduce and last in reduce


def _region_vars(region: TensorRegion) -> set[tirx.Var]:
    found: set[tirx.Var] = set()
    for r in region.region:
        if not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1):
            return set()  # not a point access
        found |= vars_in(r.min)
    return found


def _traits(stmt: s_tir.SBlock, a: int, b: int) -> list[IterTrait] | None:
    """Kind (S/I/J/K/trivial) of each block iterator for C[S,I,J] += A[S,I,K] * B[S,J,K]."""
    a_vars, b_vars = _region_vars(stmt.reads[a]), _region_vars(stmt.reads[b])
    c_vars = _region_vars(stmt.writes[0])
    traits = []
    for iv in stmt.iter_vars:
        var, extent = iv.var, iv.dom.extent
        if isinstance(extent, tirx.IntImm) and extent.value == 1:
            kind = IterKind.kIter_T
        elif iv.iter_type == tirx.IterVar.DataPar:
            kind = {
                (True, True, True): IterKind.kIter_S,
                (True, False, True): IterKind.kIter_I,
                (False, True, True): IterKind.kIter_J,
            }.get((var in a_vars, var in b_vars, var in c_vars))
        elif iv.iter_type == tirx.IterVar.CommReduce and var not in c_vars:
            kind = IterKind.kIter_K if var in a_vars and var in b_vars else None
        else:
            kind = None
        if kind is None:
            return None
        traits.append(IterTrait(kind, extent))
    kinds = {t.kind for t in traits}
    # I may be missing (a matrix-vector product): it then becomes a unit axis of the tile.
    if not {IterKind.kIter_J, IterKind.kIter_K} <= kinds:
        return None
    return traits


def canonicalize(
    sch: s_tir.Schedule, main: SBlockRV, a: int, b: int
) -> tuple[int | None, int | None, int, int | None] | None:
    """Rewrite `main` to C[S, I, J] += A[S, I, K] * B[S, J, K]; return (S, I, J, K).

    Any of them may be symbolic (a dynamic batch; None is returned for it)."""
    traits = _traits(sch.get(main), a, b)
    if traits is None:
        return None
    reindex_a = sch.reindex(main, ("read", a))
    reindex_b = sch.reindex(main, ("read", b))
    reindex_c = sch.reindex(main, ("write", 0))
    # The reindexed buffers are indexed by plain iterators (unit ones sometimes dropped):
    # read their index order off the block instead of assuming it.
    stmt = sch.get(main)
    trait_of = {iv.var: t for iv, t in zip(stmt.iter_vars, traits)}

    def operand_map(region: TensorRegion, order: list[IterKind]) -> tirx.IndexMap:
        return make_iter_fusion_index_map([trait_of[r.min] for r in region.region], order)

    S, I, J, K = IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K
    if not all(isinstance(r.min, tirx.Var) for x in (*stmt.reads, *stmt.writes) for r in x.region):
        return None
    sch.transform_layout(reindex_a, ("write", 0), operand_map(stmt.reads[a], [S, I, K]))
    sch.transform_layout(reindex_b, ("write", 0), operand_map(stmt.reads[b], [S, J, K]))
    sch.transform_layout(reindex_c, ("read", 0), operand_map(stmt.writes[0], [S, I, J]))
    sch.transform_block_layout(main, make_iter_fusion_index_map(traits, [S, I, J, K]))
    extents = [static_extent(sch, loop) for loop in sch.get_loops(main)]
    if len(extents) != 4:
        return None
    return tuple(extents)  # type: ignore[return-value]


def _b_contiguous(
    func: tirx.PrimFunc, sch: s_tir.Schedule, main: SBlockRV, lanes: int
) -> bool:
    """Whether reading B in place gives whole contiguous vectors along J.

    True when B's innermost index, in the original function, is the output's innermost axis
    and that axis is a multiple of `lanes` long (so no vector straddles two rows of B).
    """
    original = Schedule(func)
    block = matmul_block(original)
    if block is None:
        return False
    inline_copies_into(original, block)
    stmt = original.get(block)
    operands = matmul_operands(stmt)
    if operands is None:
        return False
    c_last = stmt.writes[0].region[-1].min
    b_last = stmt.reads[operands[1]].region[-1].min
    extent = next(iv.dom.extent for iv in stmt.iter_vars if iv.var.same_as(c_last))
    unit = {iv.var for iv in stmt.iter_vars if isinstance(iv.dom.extent, tirx.IntImm)
            and iv.dom.extent.value == 1}
    if vars_in(b_last) - unit != {c_last} or not isinstance(extent, tirx.IntImm):
        return False
    return extent.value % lanes == 0 and _is_var_plus_units(b_last, c_last, unit)


def _is_var_plus_units(expr: tirx.PrimExpr, var: tirx.Var, unit: set[tirx.Var]) -> bool:
    """expr is `var`, or `var + u` with u a unit-extent iterator (a 1x1 kernel's offset)."""
    if isinstance(expr, tirx.Var):
        return expr.same_as(var)
    if isinstance(expr, tirx.Add):
        a, b = expr.a, expr.b
        return (_is_var_plus_units(a, var, unit) and isinstance(b, tirx.Var) and b in unit) or (
            _is_var_plus_units(b, var, unit) and isinstance(a, tirx.Var) and a in unit
        )
    return False


def producer_of(sch: s_tir.Schedule, main: SBlockRV, index: int) -> SBlockRV:
    buffer = sch.get(main).reads[index].source
    for block in sch.get_producers(main):
        if any(w.source.same_as(buffer) for w in sch.get(block).writes):
            return block
    raise ValueError(f"no producer for read {index} of the matmul block")


# Copied whole and widened, an A read by fewer panels of B costs more than widening it in the
# FMA loop: a MobileNet's 1x1-convolution weight gradients (dY^T over 65536 pixels by one panel
# of 16-24 input channels) took 1.8x the time, the CNN's bfloat16 training step 1.05-1.11x.
WIDEN_A_MIN_PANELS = 4


def _narrower(operand: str, accumulator: str) -> bool:
    """Whether an operand is a 16-bit float summed in float32 (AMP's bfloat16 products). Read
    in place, each broadcast of A and each vector of B's panel was widened inside the FMA loop:
    the batch-64 MLP's bfloat16 products ran at 46-56% of the FMA peak where float32's reach
    67-71% (Sapphire Rapids). B's panels are then packed widened, and an A reread by enough
    panels (WIDEN_A_MIN_PANELS) is copied widened."""
    return str(operand) in ("bfloat16", "float16") and str(accumulator) == "float32"


def _prepare_a(sch: s_tir.Schedule, main: SBlockRV, a: int, copy: bool) -> SBlockRV | None:
    """Read A in place: each step broadcasts mi scalars of A, which any layout allows, unless
    `copy` (A's rows run across K, see TRANSPOSED_A_COPY_K): then A is first copied whole with
    its rows along K.

    The reindex copy is inlined; a zero-padding copy (when I was padded) stays, so that the
    inner loop carries no bounds checks: returned, for `_pad_a_per_tile`.
    """
    producer = producer_of(sch, main, a)
    if sch.get(producer).name_hint.endswith("_pad"):
        sch.compute_inline(sch.get_producers(producer)[0])
        return producer
    if not copy:
        sch.compute_inline(producer)
    return None


# A transposed A (x in a weight gradient x.T @ dy, rows along I) read in place fetches a new
# cache line and a new page per step of K, for every tile of every B panel: the transformer's
# 1024 x 1024 x 256 weight gradient took 4.6 ms so on Sapphire Rapids, 2.1 ms with A first
# copied with its rows along K. Short sums (K = 64, a batch-64 MLP) stay in place.
TRANSPOSED_A_COPY_K = 128
# ... and only where A (per batch) outgrows the caches: an attention gradient P^T @ dO reads a
# 128 x 128 P per head, whose rows the tiles share from L1/L2; copied it took 0.62 ms, read in
# place 0.54 (32 heads x 128 x 64 x 128 on Zen 3).
TRANSPOSED_A_COPY_MIN_BYTES = 256 << 10


def _pad_a_per_tile(sch: s_tir.Schedule, padded: SBlockRV, tile_loop: LoopRV, tile: Tile) -> None:
    """Copy each tile's mi rows of A, zero-padded, right before the tile reads them (a buffer
    of mi x K, in cache) instead of all of A up front. The whole padded copy stayed in TVM's
    workspace pool after the call: 4 MiB for a GPT's 1024 x 1024 MLP activations, above eager's
    inference peak. Each J panel copies the rows again: K x mi copies per tile of mi x nj x K
    multiply-adds. Only for rows of A contiguous along K: a transposed A (dy in a weight
    gradient) would be gathered along K for every tile (a GPT's training step took 2.1x)."""
    sch.compute_at(padded, tile_loop, preserve_unit_loops=True)
    inner = sch.get_loops(padded)[-1]
    extent = static_extent(sch, inner)
    if extent is not None and extent % tile.lanes == 0:
        sch.vectorize(sch.split(inner, [None, tile.lanes])[1])


def _prepare_b(sch: s_tir.Schedule, main: SBlockRV, b: int, tile: Tile, pack: bool,
               b_contiguous: bool, schedule: bool = True) -> SBlockRV | None:
    """Either read B in place (contiguous along J) or pack it into [S, J/nj, K, nj] panels:
    the packing block, scheduled (`schedule`) as a parallel loop of its own."""
    producer = producer_of(sch, main, b)
    nj = tile.nj
    if sch.get(producer).name_hint.endswith("_pad"):
        # pad_einsum made a zero-padded copy in [S, J, K] order: it becomes the packing block.
        sch.compute_inline(sch.get_producers(producer)[0])
        sch.transform_layout(producer, ("write", 0), lambda s, j, k: (s, j // nj, k, j % nj))
    else:
        sch.compute_inline(producer)
        if not pack:
            return None
        # With S == 1 the batch iterator does not index B, and the cache block drops it.
        batched = static_extent(sch, sch.get_loops(main)[0]) != 1
        producer = sch.reindex_cache_read(
            main,
            b,
            "global",
            (lambda s, i, j, k: (s, j // nj, k, j % nj))
            if batched
            else (lambda s, i, j, k: (j // nj, k, j % nj)),
        )
    if schedule:
        _schedule_pack(sch, producer, tile, b_contiguous, parallel=True)
    return producer


# A B read across its rows (x @ W.T) is packed this many rows at a time. Rows 4 KiB apart (K a
# multiple of 1024 floats) fall into one L1 set, and an 8-way L1 (Zen 3, Zen 4: 32 KiB) holds 8
# of them: 16 rows at once (one AVX-512 vector) evicted each other at every step of K. Zen 4,
# relu(x @ W.T + b) at 64 x 1024 x 1024: 0.92 ms (65% of the FMA peak) with 16 rows, against
# 0.67 ms for the same product with W stored transposed.
PACK_ROWS_AT_ONCE = 8


def _schedule_pack(sch: s_tir.Schedule, producer: SBlockRV, tile: Tile, b_contiguous: bool,
                   parallel: bool) -> None:
    """Copy B into panels one vector at a time, in the order B's own rows run."""
    *s, j, k = sch.get_loops(producer)
    jo, jv, jj = sch.split(j, [None, tile.nvec, tile.lanes])
    if b_contiguous:
        # B's rows run along J (dy @ W in an input gradient): each step of K copies one
        # contiguous nj-wide piece of a row. A vector at a time over all of K instead revisits
        # every row once per vector, a new page each time (Sapphire Rapids, the pack inside
        # the product: 64 x 4096 x 4096 13.4 -> 10.5 ms, 64 x 1024 x 1024 618 -> 551 us).
        sch.reorder(jo, k, jv, jj)
        outer = [*s, jo]
    else:
        # B's rows run along K (x @ W.T): PACK_ROWS_AT_ONCE rows at a time, each read in order
        # along K (see PACK_ROWS_AT_ONCE).
        rows = min(tile.lanes, PACK_ROWS_AT_ONCE)
        jh, jj = sch.split(jj, [None, rows])
        sch.reorder(jo, jv, jh, k, jj)
        outer = [*s, jo, jv]
    sch.vectorize(jj)
    if parallel:
        parallelize(sch, outer, work_extent(sch, k) * tile.lanes * (tile.nvec if b_contiguous else 1))


# The parallel loop over (panels of B, tiles of A's rows) gives each thread a share of the panels
# and all of A's rows. When A is the tall operand and B fits L2 (a ViT's x @ W.T, 1040 tokens x
# 128 features by 128..256 outputs), each thread reads all of A, half of it from the other
# core's L2, where the kernel before (which splits its rows between the threads too) left it. Rows
# outermost, a thread's tiles cover a band of A's rows and every panel of B: on the 2-vCPU Xeon
# the ViT's inference took 0.94x the time, its training step 0.92-0.94x; the CNN, ResNet-18, the
# GPT and the transformer moved within +-1.5% (A/B in one process). With B wider than A is tall
# (a 1x1 convolution's image as B) the CNN's training step took 1.08x: not then.
def _rows_outermost(i_extent: int, j_extent: int, k_extent: int, dtype_bytes: int) -> bool:
    """Whether the parallel loop runs over (I tiles, J panels) rather than (J panels, I tiles)."""
    return k_extent * j_extent * dtype_bytes <= ROW_BLOCK_B_IN_L2_BYTES and i_extent > j_extent


def _tile_main(sch: s_tir.Schedule, main: SBlockRV, tile: Tile, panel_major: bool = False,
               padded: tuple[int, ...] = (), rows_outer: bool = False,
               store_along_i: bool = False) -> tuple[LoopRV, LoopRV]:
    """Tile the product; the parallel loop runs over (S, J panels, I tiles), with `rows_outer`
    over (S, I tiles, J panels) (_rows_outermost), or with `panel_major` over (S, J panels)
    only, the I tiles of a panel in order inside it. Returns the parallel loop and the loop
    over tiles. `store_along_i`: see fuse_epilogue."""
    s, i, j, k = sch.get_loops(main)
    io, ii = sch.split(i, [None, tile.mi])
    jo, ji, jv = sch.split(j, [None, tile.nvec, tile.lanes])
    sch.reorder(s, *((io, jo) if rows_outer else (jo, io)), k, ii, ji, jv)
    work = tile.mi * tile.nj * work_extent(sch, k) * (work_extent(sch, io) if panel_major else 1)
    if panel_major:
        outer = sch.fuse(s, jo)
    else:
        outer = sch.fuse(s, io, jo) if rows_outer else sch.fuse(s, jo, io)
    tile_loop = io if panel_major else outer
    _finish_tiles(sch, main, tile, outer, tile_loop, work, (ii, ji, jv, k), padded, store_along_i)
    return outer, tile_loop


def _finish_tiles(sch: s_tir.Schedule, main: SBlockRV, tile: Tile, outer: LoopRV, tile_loop: LoopRV,
                  work: int, inner: tuple[LoopRV, LoopRV, LoopRV, LoopRV], padded: tuple[int, ...],
                  store_along_i: bool = False) -> None:
    """What every tiling of the product shares: the accumulator tile kept in registers and
    stored, with its epilogue, once per `tile_loop` iteration; `outer` parallel; the tile's
    rows and vectors (`inner`: ii, ji, jv and the K loop outside them) unrolled and vectorized."""
    ii, ji, jv, k = inner
    store = sch.cache_write(main, 0, ACCUMULATOR_SCOPE)
    sch.reverse_compute_at(store, tile_loop, preserve_unit_loops=True)
    fuse_epilogue(sch, store, tile_loop, tile.lanes, padded, along_i=store_along_i)
    parallelize(sch, [outer], work)
    sch.unroll(ii)
    sch.unroll(ji)
    sch.vectorize(jv)
    init = sch.decompose_reduction(main, k)
    sch.vectorize(sch.get_loops(init)[-1])


# A taller than B and too big for L2 (a weight gradient dy.T @ x over many tokens, the GPT's
# tied embedding 4096 x 256 summed over 1024) is read from L3 once per B panel when the panels
# run outermost. Such products run in blocks of A's rows instead, each block read once and kept
# in L2 while every panel of B (packed whole first) passes over it. Zen 3, dy.T @ x, K = 1024:
# 4096 x 256 21.2 -> 17.1 ms, 1024 x 256 5.0 -> 4.3, 768 x 256 3.7 -> 3.3 (50-55% of the FMA
# peak -> 60-65%); x @ W.T 1024 x 256 x 1024 3.85 -> 3.75; with A of 1 MiB (K = 256) the
# panels-outermost order was 6% faster, hence ROW_BLOCK_MIN_A_BYTES.
ROW_BLOCK_MIN_A_BYTES = 2 << 20
ROW_BLOCK_BYTES = 256 << 10  # one block of A: half of Zen 3's L2, 64 rows at K = 1024
# But every block rereads all of B: from L2 while B fits there (Zen 3's 512 KiB), else from L3
# or memory, and then only where that reads less than A once per panel. ResNet-18's layer-4
# im2col product (A = W, 512 x 4608, 9.4 MB; B 4608 x 256, 4.7 MB) in blocks of 8 rows read B
# 64 times, 302 MB a call, against 75 MB for A once per panel: in the graph 81% of the FMA peak
# against 94% with the panels outermost (Zen 4; alone, with B in L3, 93% either way).
ROW_BLOCK_B_IN_L2_BYTES = 512 << 10


def _row_block_tiles(sch: s_tir.Schedule, main: SBlockRV, tile: Tile, pack: bool,
                     dtype_bytes: int) -> int | None:
    """Register tiles of rows per block when the product runs in blocks of A's rows (see
    ROW_BLOCK_MIN_A_BYTES), else None: the largest divisor of I's tiles that keeps a block
    within ROW_BLOCK_BYTES (no block is partial) and leaves PANELS_PER_THREAD blocks per
    thread; None also where the blocks would reread more of a B too big for L2 than the panels
    would of A (ROW_BLOCK_B_IN_L2_BYTES)."""
    extents = [static_extent(sch, loop) for loop in sch.get_loops(main)]
    if None in extents or not pack:
        return None
    s, i, j, k = extents
    if i * k * dtype_bytes < ROW_BLOCK_MIN_A_BYTES or i < j:
        return None
    tiles = i // tile.mi  # I is padded to whole tiles by now
    most = max(1, ROW_BLOCK_BYTES // (dtype_bytes * k * tile.mi))
    fits = [d for d in range(1, min(tiles, most) + 1)
            if tiles % d == 0 and enough_per_thread(s * (tiles // d), PANELS_PER_THREAD)]
    if not fits:
        return None
    per_block = max(fits)
    b_bytes = j * k * dtype_bytes
    rereads_of_b = tiles // per_block * b_bytes
    rereads_of_a = -(-j // tile.nj) * i * k * dtype_bytes
    if b_bytes > ROW_BLOCK_B_IN_L2_BYTES and rereads_of_b > rereads_of_a:
        return None
    return per_block


def _tile_row_blocks(sch: s_tir.Schedule, main: SBlockRV, tile: Tile, per_block: int,
                     padded: tuple[int, ...] = (), store_along_i: bool = False) -> tuple[LoopRV, LoopRV]:
    """Tile the product as parallel(S, blocks of `per_block` tiles of rows) > J panels > the
    block's tiles > K > ...; B is packed whole before it. Returns the parallel loop and the
    loop over tiles."""
    s, i, j, k = sch.get_loops(main)
    work = per_block * tile.mi * work_extent(sch, j) * work_extent(sch, k)
    ib, io, ii = sch.split(i, [None, per_block, tile.mi])
    jo, ji, jv = sch.split(j, [None, tile.nvec, tile.lanes])
    sch.reorder(s, ib, jo, io, k, ii, ji, jv)
    outer = sch.fuse(s, ib)
    _finish_tiles(sch, main, tile, outer, io, work, (ii, ji, jv, k), padded, store_along_i)
    return outer, io


# One row of A by B read in place (x @ W at batch 1): this many rows of B at a time, all of a
# thread's panels in each (see _tile_one_row_by_k_steps). On Zen 3: 1 x 4096 x 4096 3.5 ms with
# every panel reading all of K (55-62% of the copy bandwidth), 2.36 ms (87%) in steps of 8 rows,
# 2.20 in steps of 4, 3.28 in steps of 32; 1 x 2048 x 2048 0.52 -> 0.26 ms; 1 x 1024 x 1024 and
# 1 x 1024 x 784, whose B stays in cache, the same within 10%.
ROW_STEP = 8


def _row_chunks(s_extent: int | None, i_extent: int | None, j_extent: int | None,
                k_extent: int | None, tile: Tile) -> int | None:
    """The number of parallel chunks of J for a one-row product read in place in steps of K,
    or None where that does not apply (more than one row, symbolic extents, short or ragged K,
    a padded J, or one chunk on several threads: the panels then run in parallel each over all
    of K)."""
    if s_extent != 1 or i_extent != 1 or j_extent is None or k_extent is None:
        return None
    if k_extent < 4 * ROW_STEP or k_extent % ROW_STEP or j_extent % tile.nj:
        return None
    panels = j_extent // tile.nj
    threads = os.cpu_count() or 1
    # The most chunks, up to one per thread, that divide the panels evenly.
    chunks = max(c for c in range(1, min(threads, panels) + 1) if panels % c == 0)
    return chunks if chunks > 1 or threads == 1 else None


def _tile_one_row_by_k_steps(sch: s_tir.Schedule, main: SBlockRV, tile: Tile, chunks: int) -> LoopRV:
    """Tile a one-row product whose B is read in place: parallel(chunks of J) > steps of
    ROW_STEP rows of B > the chunk's panels > those rows > vector(nvec x lanes).

    Reading each panel down all of K visits one page of B per row (a row of a 4096-wide W is
    16 KiB); a step of a few rows across the whole chunk reads each of those rows along its
    length, which the prefetchers follow. The accumulators, a chunk of C, stay in L1 between
    steps. Returns the parallel loop."""
    s, i, j, k = sch.get_loops(main)
    jc, jo, ji, jv = sch.split(j, [chunks, None, tile.nvec, tile.lanes])
    ko, ki = sch.split(k, [None, ROW_STEP])
    sch.reorder(s, i, jc, ko, jo, ki, ji, jv)
    outer = sch.fuse(s, i, jc)
    store = sch.cache_write(main, 0, ACCUMULATOR_SCOPE)
    sch.reverse_compute_at(store, outer, preserve_unit_loops=True)
    fuse_epilogue(sch, store, outer, tile.lanes)
    parallelize(sch, [outer], work_extent(sch, jo) * tile.nj * work_extent(sch, ko) * ROW_STEP)
    sch.unroll(ji)
    sch.vectorize(jv)
    init = sch.decompose_reduction(main, ko)
    sch.vectorize(sch.get_loops(init)[-1])
    return outer


def fuse_epilogue(sch: s_tir.Schedule, store: SBlockRV, outer: LoopRV, lanes: int,
                  padded: tuple[int, ...] = (), along_i: bool = False) -> None:
    """Inline the consumers of the accumulator into its store; compute the rest per tile
    where they read what the tile computed at its own indices, else after the whole product.

    `along_i`: the output's rows run along the tile's I (operands swapped, see swap_pays):
    the store's vector runs along I, a contiguous piece of an output row per column of the
    tile. Along J each lane went to its own row, 4 KiB apart: 64 x 1024 outputs stored that
    way took 0.13 ms of a 0.72 ms product.

    `padded`: the accumulator's axes zero-padded to whole tiles. A consumer is inlined only if
    it reads each of them at one of its own indices alone: the store then runs over the padded
    elements too, and its bound test checks the output's indices. Through a reshape that mixes
    a padded axis into another index, a padded row passed it: a 3-D adaptive average pool's
    gradient (`[b, 3, t]` products padded to 4 rows, stored as `[b * 3 + i, t]`) wrote row 3
    of batch b over row 0 of batch b + 1."""
    changed = True
    while changed:
        changed = False
        for consumer in sch.get_consumers(store):
            if padded and not _keeps_padded_axes(sch.get(consumer), sch.get(store), padded):
                continue
            try:
                sch.reverse_compute_inline(consumer)
            except s_tir.ScheduleError:
                continue
            changed = True
            break
    rest = _transitive_consumers(sch, store)
    # Per tile only where each block reads the tile's own elements (else after all tiles).
    per_tile = all(reads_at_its_own_indices(sch, block, [store, *rest]) for block in rest)
    if per_tile:
        for block in rest:
            sch.reverse_compute_at(block, outer, preserve_unit_loops=True)
    # NOTE: blocks left after the product are not touched here: a vectorized loop marks a
    # block scheduled, and `schedule_remaining` would then leave it serial (the transformer's
    # GELU over 1024 x 1024 outputs ran on one core in the training step: that kernel took
    # 5.3 ms per step, 4.9 ms with the GELU on both cores).
    if along_i:
        *_, i_loop, j_loop = sch.get_loops(store)
        sch.reorder(j_loop, i_loop)
        sch.vectorize(i_loop)
    for block in ([] if along_i else [store]) + (rest if per_tile else []):
        inner = sch.get_loops(block)[-1]
        extent = static_extent(sch, inner)
        if extent is not None and extent % lanes == 0:
            _, vec = sch.split(inner, [None, lanes])
            sch.vectorize(vec)


def _keeps_padded_axes(consumer: s_tir.SBlock, store: s_tir.SBlock, padded: tuple[int, ...]) -> bool:
    """Whether `consumer` reads each padded axis of what `store` writes (`padded`: positions
    among the store's iterators, [S, I, J]) at one of its own iterators, used by no other index
    of that read (so the axis stays an index of its output)."""
    buffer = store.writes[0].source
    written = [r.min for r in store.writes[0].region]
    analyzer = Analyzer()
    for iv in consumer.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    for axis in padded:
        var = store.iter_vars[axis].var
        position = next((i for i, e in enumerate(written) if isinstance(e, tirx.Var) and e.same_as(var)), None)
        if position is None:
            return False
        for region in consumer.reads:
            if not region.source.same_as(buffer):
                continue
            # Under the consumer's ranges, as reverse_compute_inline maps them: a legalized
            # reshape reads `[(b * 128 + v // n + t) % m, v % n]`, i.e. `[b * 128 + t, v]`. Read
            # literally, its padded axis `v % n` kept it out of the store, and the whole padded
            # product went through a workspace (the GPT's logits: 16 MiB).
            indices = [analyzer.simplify(r.min) for r in region.region]
            index = indices[position]
            others = set().union(*(vars_in(e) for i, e in enumerate(indices) if i != position))
            if not is_own_iterator(index, consumer) or any(index.same_as(v) for v in others):
                return False
    return True


def _transitive_consumers(sch: s_tir.Schedule, block: SBlockRV) -> list[SBlockRV]:
    result: list[SBlockRV] = []
    frontier = list(sch.get_consumers(block))
    while frontier:
        b = frontier.pop(0)
        if any(sch.get(b).same_as(sch.get(r)) for r in result):
            continue
        result.append(b)
        frontier.extend(sch.get_consumers(b))
    return result

"""`x @ w.T` for a few rows of x (batch 1 to 32 at 1024 features) as dot products that read
W in place.

Matches what `matmul.py` matches, `C[S, I, J] += A[S, I, K] * B[S, J, K]`, when both A and B
are contiguous along K and A has few rows (I <= K / 16, and at most 128 KiB of A unless W has at
most 128 rows, a classifier head): nn.Linear
at small batch, where B is the weight W[out, in]. The matmul rule would pack W into panels on
every call (a transposing copy of W that costs more than the product itself when I is small:
700 us of 1270 us for 64 x 1024 x 1024 on one core); this rule reads every row of W straight
from memory, and at batch 1 reads W exactly once.

Schedule, with `width` floats per vector (16 on AVX-512; the largest power of two dividing K):
  * a register tile of `ri` rows of A by `rj` rows of B (see TILES): each step over K loads
    one vector of each of the ri + rj rows and adds the ri * rj products into one vector of
    partial sums per output (rfactor of the K loop by the vector lanes; under 1 KiB, so the
    partial sums stay on the stack and in registers);
  * loops: parallel(S, J / rj) > I / ri > K / width > unroll(ri, rj) > vector(width): a group
    of rj rows of W stays in L1 while every row of A passes by (one thread below
    MIN_PARALLEL_MACS);
  * then each output's partial sums are added up and the epilogue (bias, ReLU, ...) runs on
    the tile before it is stored.

Limits: static shapes; K must be a multiple of 4; the horizontal sums cost about
ri * rj * width scalar adds per tile (I * J * width in all), which is why large I goes to
`matmul.py`.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.schedule import SBlockRV
from tvm.target import Target

from .cpu_target import CPUTarget
from .fallback import schedule_remaining
from .loops import element_bytes
from .matmul import (
    ACCUMULATOR_SCOPE,
    canonicalize,
    contiguous_along_reduction,
    fuse_epilogue,
    prepare_matmul,
    producer_of,
    swap_pays,
)

# (ri, rj) register tiles, best first: at most 12 partial-sum vectors (768 bytes: a tile of
# 1 KiB or more is allocated on the heap per tile, see matmul.py), few loads per FMA.
TILES = ((4, 3), (3, 4), (2, 6), (6, 2), (1, 12), (2, 4), (4, 2), (1, 8), (2, 3), (3, 2),
         (1, 6), (2, 2), (1, 4), (4, 1), (1, 3), (3, 1), (1, 2), (2, 1), (1, 1))
# Up to I = K / MAX_ROWS_PER_K rows the horizontal sums (I * J * width adds) cost less than
# packing W for the matmul rule (J * K strided copies). Measured on Zen 5 (N = 256..1024):
# 0.16-0.3x of the matmul rule's time at I = 1, 0.5-0.8x at I = 16, 0.7-1.2x at I = 32.
MAX_ROWS_PER_K = 16
# ... and while A's rows stay in cache: every group of rj rows of W reads all of A, so an A of
# I * K floats that does not stay in L2 is read from L3 J / rj times. Measured on Zen 5 (1 MiB
# L2 per core, both cores), this rule's time over the matmul rule's: 0.63 at 16 x 1024 x 1024,
# 0.92 at 32 x 1024 x 1024 and 0.95 at 16 x 2048 x 2048 (128 KiB of A); 1.15 at
# 64 x 1024 x 1024, 1.24 at 16 x 4096 x 4096 and 2.9 at 64 x 256 x 1024 (256 KiB); 2.8 at
# 256 x 4096 x 4096 (4 MiB: the large MLP's layers, 46% of the FMA peak before this limit).
MAX_A_BYTES = 128 * 1024
# ... unless W has at most this many rows (a classifier head): A is then read only J / rj times,
# from L2. On Zen 3 (2 threads), this rule against the matmul rule, which packs W: 64 x 1024 ->
# 10 22 against 47 us, 64 x 1280 -> 10 23 against 41, 64 x 1024 -> 100 117 against 179,
# 256 x 4096 -> 10 (4 MiB of A) 307 against 321; at 64 x 1024 -> 1024 it lost (above).
MAX_ROWS_OF_W_REREADING_A = 128
# Below this many multiply-adds the kernel runs on one thread: waking TVM's worker costs more
# than a small product (the MLP's 1024 x 10 head). Above it both cores read W: a batch-1 layer
# reads its weight at ~75 GB/s on one Zen 5 core (a 1024 x 1024 weight in 48 us), about 30 GB/s
# on one Sapphire Rapids core. Measured on an idle machine, the batch-1 MLP 784-1024-1024-10:
# Zen 5 0.10 ms on one thread, 0.06 on two; Sapphire Rapids 0.197 -> 0.189 ms when its two
# large layers (0.8 and 1 M multiply-adds) went from one thread to two (this limit was 4 M; a
# busy neighbour on the other core made two threads 0.19 ms on Zen 5).
MIN_PARALLEL_MACS = 1 << 18


class MatrixVector(ScheduleRule):
    """Dot products of each row of x with each row of W, `ri` x `rj` at a time."""

    # Schedules only a kernel with a reduction block (ApplyCPUSchedules tries it on no other).
    needs_reduction = True
    needs_binary_reduction = True  # one C += x * w block (prepare_matmul)

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when the PrimFunc is not x @ W.T with few rows of x."""
        prepared = prepare_matmul(func, target)
        if prepared is None:
            return None
        sch, main, (a, b) = prepared
        stmt = sch.get(main)
        if not all(contiguous_along_reduction(stmt, x) for x in (a, b)):
            return None
        cpu = CPUTarget.from_target(target)
        dtype = str(stmt.writes[0].source.dtype)
        if swap_pays(stmt, a, b, cpu, dtype):
            return None  # the matmul rule's swapped tiles (Sapphire Rapids: 0.75-0.9x the time)
        extents = canonicalize(sch, main, a, b)
        if extents is None:
            return None
        s_ext, i_ext, j_ext, k_ext = extents
        if s_ext is None or i_ext is None or k_ext is None or i_ext * MAX_ROWS_PER_K > k_ext:
            return None
        a_bytes = element_bytes(stmt.reads[a].source.dtype)
        few_rows_of_w = j_ext is not None and j_ext <= MAX_ROWS_OF_W_REREADING_A
        if i_ext > 1 and i_ext * k_ext * a_bytes > MAX_A_BYTES and not few_rows_of_w:
            return None
        width = cpu.lanes(dtype)
        while width >= 4 and k_ext % width:
            width //= 2
        if width < 4:
            return None
        ri, rj = next((ri, rj) for ri, rj in TILES if i_ext % ri == 0 and j_ext % rj == 0)
        for index in (a, b):  # the canonical copies of A and B: read both in place
            sch.compute_inline(producer_of(sch, main, index))
        parallel = s_ext * i_ext * j_ext * k_ext >= MIN_PARALLEL_MACS
        _schedule(sch, main, ri, rj, width, parallel)
        schedule_remaining(sch, cpu)
        return sch


def _schedule(sch: s_tir.Schedule, main: SBlockRV, ri: int, rj: int, width: int,
              parallel: bool) -> None:
    s, i, j, k = sch.get_loops(main)
    ko, kv = sch.split(k, [None, width])
    partial = sch.rfactor(kv, factor_axis=3)  # partial[s, i, j, lane]
    s, i, j, ko, kv = sch.get_loops(partial)
    io, ii = sch.split(i, [None, ri])
    jo, jj = sch.split(j, [None, rj])
    sch.reorder(s, jo, io, ko, ii, jj, kv)
    outer = sch.fuse(s, jo)
    sch.reverse_compute_at(main, io, preserve_unit_loops=True)
    lane, *rest = sch.get_loops(main)[-4:]
    sch.reorder(*rest, lane)  # each output's lanes added in turn
    store = sch.cache_write(main, 0, ACCUMULATOR_SCOPE)
    sch.reverse_compute_at(store, io, preserve_unit_loops=True)
    fuse_epilogue(sch, store, io, width)
    if parallel:
        sch.parallel(outer)
    sch.unroll(ii)
    sch.unroll(jj)
    sch.vectorize(kv)
    init = sch.decompose_reduction(partial, ko)
    sch.vectorize(sch.get_loops(init)[-1])

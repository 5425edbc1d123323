"""GPU: sums scheduled by their shape. A few outputs, each a long sum, get one thread block per
output (`LongReduction`); many outputs, each a short sum, one thread per output
(`ShortReduction`).

Convolution weight gradients and batch statistics are long sums with few outputs: dW[cout,
cin, kh, kw] adds up every pixel of the batch (N * H * W terms: 65536 for a batch of 64 at
32x32) and a depthwise 3x3 kernel of 192 channels has 1728 weights; batch norm's mean and
variance have one output per channel. dlight's `Matmul` rule tiles the outputs and loops over
the sum in each thread, its `Fallback` gives each output one thread: 16 to 2048 threads for
the whole GPU (an H100 holds 270 thousand), each adding up to 65536 terms in a row. The
depthwise convolutions' input gradients are the opposite, one short sum (9 taps) per input
pixel, and dlight's `GeneralReduction` spreads each over 256 threads, 247 of them idle. On an
H100 these kernels were most of a MobileNetV2-style CNN's CUDA training step (81 ms against
eager's 5.7, docs/benchmarks.md).

After the function's injective blocks (pads, reshapes, transposes of the operands) are inlined,
each remaining block is scheduled on its own (each becomes a kernel launch):
  * a long sum (at most MAX_OUTPUTS outputs and at least MIN_REDUCTION terms, or at most
    FEW_OUTPUTS and SHORTEST_SPLIT: batch norm's statistics on small images): its spatial loops,
    fused, go to `blockIdx.x`; its reduction loops, fused, are split by the block's threads and
    the inner part goes to `threadIdx.x`, so the threads add strided parts of the sum and TVM's
    cross-thread reduction (warp shuffles) adds those up. Consecutive threads read consecutive
    pixels (the last reduction axis is the image's width), so the loads coalesce;
  * a short sum (at most MAX_SHORT terms) or a spatial block: one thread per output, as
    dlight's `Fallback`; a spatial block that only consumes a short sum (the ReLU6 gradient
    after a depthwise input gradient) runs in the same threads, the sum kept in a register.
A function with a sum of neither kind goes to dlight's rules (Matmul, GEMV, Reduction,
GeneralReduction): a matmul, softmax, layer norm.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule, try_inline
from tvm.target import Target

# Below this many outputs, one thread per output (or a tile of outputs per thread) leaves most
# of the GPU idle: 16384 threads are 6% of an H100's. The ResNet-18 and transformer
# weight gradients above it have short enough sums for dlight's Matmul tiles.
MAX_OUTPUTS = 16384
# A sum this long is split over a block's threads; one over a few outputs (at most
# FEW_OUTPUTS: batch norm's channels) from SHORTEST_SPLIT terms (a 4x4 image's batch: 256).
MIN_REDUCTION, FEW_OUTPUTS, SHORTEST_SPLIT = 2048, 1024, 256
# A sum this short is one thread's loop (a depthwise 3x3 or 5x5 kernel's taps).
MAX_SHORT = 32
# Threads per block of a split sum: at least 4 terms each, 32 to 256 (1024 below 256 outputs,
# so that the few blocks still fill their multiprocessors).
MAX_THREADS, FEWEST_OUTPUTS, FEWEST_OUTPUTS_THREADS = 256, 256, 1024
# Threads per block of one-thread-per-output blocks.
SPATIAL_THREADS = 256


class LongReduction(ScheduleRule):
    """Long sums with few outputs: a thread block each (the function's other blocks: a thread
    per output). Goes before dlight's Matmul, which would take the weight gradients; a function
    with one long sum of one tensor (a bias gradient, a mean) is left to dlight's Reduction,
    and softmax and layer norm to its GeneralReduction, which fuse their epilogues."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        scheduled = _plans(func, target)
        if scheduled is None:
            return None
        sch, infos, plans = scheduled
        long_sums = [info for info, plan in zip(infos, plans) if plan == "long"]
        if not long_sums or (len(long_sums) == 1 and len(_inputs_read(sch, long_sums[0], infos)) < 2):
            return None
        if len(long_sums) > 1 and _row_normalization(func, target):
            return None
        _schedule(sch, infos, plans)
        return sch


def _row_normalization(func: tirx.PrimFunc, target: Target) -> bool:
    """Softmax and layer norm: sums along each row, then the row scaled, which dlight's
    GeneralReduction runs in one kernel per row (batch norm's per-channel sums it cannot)."""
    from tvm.s_tir import dlight as dl

    try:
        return dl.gpu.GeneralReduction().apply(func, target, False) is not None
    except Exception:  # noqa: BLE001  (a dlight rule that fails declines: tvmgraph/schedules/apply_gpu.py)
        return False


class ShortReduction(ScheduleRule):
    """Short sums (a depthwise convolution's taps): a thread each, a consumer in the same
    threads. Goes after dlight's Matmul, GEMV and Reduction, before its GeneralReduction."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        scheduled = _plans(func, target)
        if scheduled is None:
            return None
        sch, infos, plans = scheduled
        if "short" not in plans or "long" in plans:
            return None
        _schedule(sch, infos, plans)
        return sch


def _plans(func: tirx.PrimFunc, target: Target):
    """(schedule with injective blocks inlined, its blocks, their plans), or None where some
    block is of no kind this file schedules."""
    if not isinstance(func, tirx.PrimFunc) or "gpu" not in target.keys:
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline(sch, infos)
    if not infos:
        return None
    plans = [_plan(info) for info in infos]
    return None if None in plans else (sch, infos, plans)


def _inputs_read(sch: s_tir.Schedule, info, infos) -> set:
    """The function's own inputs (not its blocks' outputs) that a block reads."""
    written = {w.source for other in infos for w in sch.get(other.block_rv).writes}
    return {r.source for r in sch.get(info.block_rv).reads if r.source not in written}


def _schedule(sch: s_tir.Schedule, infos, plans) -> None:
    fused_into: set[int] = set()
    for i, (info, plan) in enumerate(zip(infos, plans)):
        if i in fused_into:
            continue
        if plan == "long":
            _block_per_output(sch, info)
            continue
        thread, taps = _thread_per_output(sch, info)
        if plan == "short" and i + 1 < len(infos) and plans[i + 1] == "spatial" \
                and _fuse_consumer(sch, info, infos[i + 1], thread, infos):
            fused_into.add(i + 1)
        if plan == "short":  # the sum's zero-initialization out of its loop over the taps
            sch.decompose_reduction(info.block_rv, taps[0])


def _plan(info) -> str | None:
    """"long", "short" or "spatial" for a block; None where this rule does not schedule it."""
    kinds = info.dom_kind()
    if set(kinds) - {"S", "R"} or not all(isinstance(it.dom, (int, tirx.IntImm)) for it in info.iters):
        return None
    if "R" not in kinds:
        return "spatial"
    outputs, terms = _extents(info)
    if (outputs <= MAX_OUTPUTS and terms >= MIN_REDUCTION) or (outputs <= FEW_OUTPUTS and terms >= SHORTEST_SPLIT):
        return "long"
    if terms <= MAX_SHORT:
        return "short"
    return None


def _extents(info) -> tuple[int, int]:
    """(outputs, terms of each sum) of a block with static extents."""
    outputs = math.prod(int(it.dom) for it in info.iters if it.kind == "S")
    terms = math.prod(int(it.dom) for it in info.iters if it.kind == "R")
    return outputs, terms


def _split_loops(sch: s_tir.Schedule, info):
    kinds = info.dom_kind()
    loops = sch.get_loops(info.block_rv)
    spatial = [loop for loop, kind in zip(loops, kinds) if kind == "S"]
    reduction = [loop for loop, kind in zip(loops, kinds) if kind == "R"]
    return spatial, reduction


def _block_per_output(sch: s_tir.Schedule, info) -> None:
    block = info.block_rv
    spatial, reduction = _split_loops(sch, info)
    sch.reorder(*spatial, *reduction)
    output = sch.fuse(*spatial) if spatial else sch.add_unit_loop(block)
    serial, lane = sch.split(sch.fuse(*reduction), [None, _threads_per_sum(info)])
    sch.reorder(output, lane, serial)
    sch.bind(output, "blockIdx.x")
    sch.bind(lane, "threadIdx.x")


def _threads_per_sum(info) -> int:
    """A block's threads for one split sum: a power of two, 32 up to MAX_THREADS with at least
    4 terms each (up to FEWEST_OUTPUTS_THREADS below FEWEST_OUTPUTS outputs)."""
    outputs, terms = _extents(info)
    cap = FEWEST_OUTPUTS_THREADS if outputs < FEWEST_OUTPUTS else MAX_THREADS
    threads = 32
    while threads * 2 <= cap and threads * 2 * 4 <= terms:
        threads *= 2
    return threads


def _thread_per_output(sch: s_tir.Schedule, info):
    """dlight's Fallback for one block; returns the loop bound to threadIdx.x and the block's
    reduction loops (inside it)."""
    block = info.block_rv
    spatial, reduction = _split_loops(sch, info)
    sch.reorder(*spatial, *reduction)
    output = sch.fuse(*spatial) if spatial else sch.add_unit_loop(block)
    grid, thread = sch.split(output, [None, SPATIAL_THREADS])
    sch.bind(grid, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")
    return thread, reduction


def _fuse_consumer(sch: s_tir.Schedule, producer, consumer, thread, infos) -> bool:
    """Run `consumer` (a spatial block over the producer's outputs) in the producer's threads,
    the producer's output in a register when no other block reads it; False, with the schedule
    unchanged, where it cannot."""
    written = sch.get(producer.block_rv).writes[0].source
    readers = [info for info in infos if info is not producer
               and any(r.source.same_as(written) for r in sch.get(info.block_rv).reads)]
    if readers != [consumer]:
        return False
    # NOTE: Schedule primitives either apply whole or raise, leaving the schedule as it was.
    try:
        sch.reverse_compute_at(consumer.block_rv, thread, preserve_unit_loops=True)
    except Exception:  # noqa: BLE001  (tirx.ScheduleError and the FFI's own errors)
        return False
    try:
        sch.set_scope(producer.block_rv, 0, "local")
    except Exception:  # noqa: BLE001  (a function's output stays where the caller gave it)
        pass
    return True

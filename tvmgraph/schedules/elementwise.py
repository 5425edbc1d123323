"""Element-wise and other injective kernels: one fused loop, vector tail, parallel head.

Matches a PrimFunc whose blocks are all spatial (adds, activations, casts, transposes,
reshapes, broadcasts, optimizer updates). Chains of blocks are first inlined into the block
that writes each output; each remaining loop nest is fused into one loop, split so that its
last `lanes` iterations form a vector, and the rest runs on the thread pool.

A block that switches between operands at constant points of its last axis (a concatenation)
is cut there first, one vectorized loop per piece (piecewise.py).

Limits: a transpose vectorized along its output reads with a stride (gathers); a loop whose
length no power of two >= 4 divides stays scalar (but parallel); loops with a symbolic extent
are only parallelized.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .unchecked import Schedule
from .cpu_target import CPUTarget, is_cpu
from .piecewise import schedule_piecewise
from .loops import (
    inline_spatial_blocks,
    is_spatial,
    iter_kinds,
    root_blocks,
    schedule_spatial,
    simplify_indices,
    vectorize_tails,
)


class Elementwise(ScheduleRule):
    """Fuse, vectorize and parallelize PrimFuncs made only of spatial blocks."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when some block reduces."""
        if not is_cpu(target):
            return None
        sch = Schedule(func)
        blocks = root_blocks(sch)
        if not blocks or not all(is_spatial(sch, b) for b in blocks):
            return None
        inline_spatial_blocks(sch)
        # Inlining composes index expressions; simplified, transposed reads are recognizable.
        # (Simplifying also binds unit loops to 0, which the loop helpers do not take.)
        simplified = Schedule(simplify_indices(sch.mod["main"]))
        if all(iter_kinds(simplified, b) is not None for b in root_blocks(simplified)):
            sch = simplified
        for block in root_blocks(sch):
            lanes = _lanes(sch, block, target)
            if not schedule_piecewise(sch, block, lanes):
                schedule_spatial(sch, block, lanes, by_rows=True)
        vectorize_tails(sch, lambda block: _lanes(sch, block, target))
        return sch


def _lanes(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, target: Target) -> int:
    writes = sch.get(block).writes
    dtype = writes[0].source.dtype if writes else "float32"
    return CPUTarget.from_target(target).lanes(dtype)

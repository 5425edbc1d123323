"""The catch-all rule: whatever no other rule took gets at least threads and vectors.

Spatial blocks are inlined into spatial consumers (never into a reduction, which would
recompute them at every step); every remaining loop nest is then scheduled on its own: an
all-spatial nest as in `elementwise.py`, a reduction nest by running its leading spatial loops
in parallel. The other rules also call `schedule_remaining` for the blocks they leave.

Limits: no tiling, no register blocking, reductions not vectorized (the simple schedule is the
point: it must not fail); a reduction to a scalar stays serial.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .unchecked import Schedule
from .cpu_target import CPUTarget, is_cpu
from .loops import (
    inline_spatial_blocks,
    is_scheduled,
    is_spatial,
    root_blocks,
    schedule_leading_spatial,
    schedule_spatial,
)


class Fallback(ScheduleRule):
    """Parallelize and vectorize every loop nest of any PrimFunc, one nest at a time."""

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return a schedule for any PrimFunc with blocks under its root."""
        if not is_cpu(target):
            return None
        sch = Schedule(func)
        if not root_blocks(sch):
            return None
        inline_spatial_blocks(sch)
        schedule_remaining(sch, CPUTarget.from_target(target))
        return sch


def schedule_remaining(sch: s_tir.Schedule, cpu: CPUTarget) -> None:
    """Give each root-level loop nest that no rule has touched the catch-all schedule."""
    for block in root_blocks(sch):
        if is_scheduled(sch, block):
            continue
        writes = sch.get(block).writes
        lanes = cpu.lanes(writes[0].source.dtype if writes else "float32")
        if is_spatial(sch, block):
            schedule_spatial(sch, block, lanes)
        else:
            schedule_leading_spatial(sch, block)

"""Im2col: the window copy of relay_passes/im2col_conv.py, one output row per vector.

Matches a PrimFunc whose one block is named "im2col": `cols[n, c, ky, kx, y, x]` (or, with the
batch inside, `cols[c, ky, kx, n, y, x]`) = the zero-padded input at the window's offset.

Schedule: parallel over the first two axes fused, the kernel's columns unrolled, and each output
row one vector when it is at most a vector wide (else split into whole vectors, or left serial).
The element-wise rule fused all six axes and cut vectors across rows: each vector then
straddled two image rows and was loaded lane by lane under the bounds test. ResNet-18's copies
ran at 41-53% of the copy bandwidth that way; by rows (Zen 4, 16 images, 3x3 windows) 8x8 x 256
channels 0.573 -> 0.296 ms, 4x4 x 512 0.354 -> 0.129, 16x16 x 128 1.273 -> 0.633, and strided
16x16 -> 8x8 0.484 -> 0.158.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .cpu_target import CPUTarget, is_cpu
from .loops import root_blocks, static_extent
from .unchecked import Schedule

BLOCK_NAME = "im2col"  # relay_passes/im2col_conv.py's `_im2col`


class Im2col(ScheduleRule):
    """Parallel over (image, channel), one vector per output row."""

    needs_block = BLOCK_NAME  # ApplyCPUSchedules tries it on no other kernel

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        """Return the schedule, or None when `func` is not an im2col copy."""
        if not is_cpu(target):
            return None
        sch = Schedule(func)
        blocks = root_blocks(sch)
        if len(blocks) != 1 or sch.get(blocks[0]).name_hint != BLOCK_NAME:
            return None
        loops = sch.get_loops(blocks[0])
        if len(loops) != 6:
            return None
        first, second, _, kx, _, col = loops
        sch.parallel(sch.fuse(first, second))
        if static_extent(sch, kx) is not None:
            sch.unroll(kx)
        lanes = CPUTarget.from_target(target).lanes(str(sch.get(blocks[0]).writes[0].source.dtype))
        width = static_extent(sch, col)
        if width is not None and 1 < width <= lanes:
            sch.vectorize(col)
        elif width is not None and width % lanes == 0:
            sch.vectorize(sch.split(col, [None, lanes])[1])
        return sch

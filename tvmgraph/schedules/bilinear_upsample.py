"""Bilinear upsampling by two (torch's `interpolate(scale_factor=2, mode="bilinear")`) as taps.

`BilinearUpsampleByTwo` (relay_passes/bilinear_upsample.py) replaces an NCHW `resize2d` to twice
the height and width with `method="linear"` and half-pixel centres (torch's
`align_corners=False`) by a call of `bilinear_upsample_kernel`. At a scale of exactly two, every
output pixel reads the same four taps with the same weights: output column 2j + p (p = 0, 1)
lies a quarter of a pixel from input column j, towards column j - 1 + 2p,

    row(i)[2j + p]      = 0.75 * x[i, j] + 0.25 * x[i, clamp(j - 1 + 2p)]
    out[2i + q, 2j + p] = 0.75 * row(i)[2j + p] + 0.25 * row(clamp(i - 1 + 2q))[2j + p]

(the clamps at the borders are torch's: its source index stops at 0 and at the last pixel).
TOPI's resize computes each output's source coordinates in float, floors and clamps them, and
reads its four taps through that arithmetic: nothing vectorizes. A U-Net's 4 x 32 x 32 x 32 ->
64 x 64 took 1.4 ms with its SiLU and concatenation fused in (20% of the call) on a 2-vCPU Xeon;
torch's own kernel 0.54 ms.

Here each (image, channel) plane is first copied with one replicated column on either side
(`padded`, compute_at the plane: it stays in L1/L2), so that the column taps are the loads
`padded[.., j + 1]` and `padded[.., j + 2p]` with no clamp; the rows' clamps are per row. The
rule (`BilinearUpsample`) runs the planes in parallel and unrolls p; LLVM's loop vectorizer
(-O2 and up) vectorizes along j and interleaves the two columns' stores (vectorized by TVM
instead, the stride-2 stores are scalar: 138 against 119 us in a first version). The U-Net's
resize alone: 51 us at -O3, 210 at the -O1 graphs build with.
"""

from __future__ import annotations

from tvm import s_tir, te, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from relay_passes import OPAQUE

# Marks a PrimFunc made by `bilinear_upsample_kernel` (the rule schedules nothing else).
ATTRIBUTE = "tvmgraph.bilinear_upsample"


def bilinear_upsample_kernel(batch: int | None, channels: int, height: int, width: int,
                             dtype: str) -> tirx.PrimFunc:
    """The PrimFunc `main(x[N, C, H, W], out[N, C, 2H, 2W])`: x upsampled by two, bilinear,
    half-pixel centres (see the module docstring). `batch` None: N is symbolic (a dynamic batch)."""
    n = tirx.Var("batch", "int64") if batch is None else batch
    x = te.placeholder((n, channels, height, width), dtype, name="x")

    def clamp(index: tirx.PrimExpr, last: int) -> tirx.PrimExpr:
        return tirx.max(tirx.min(index, last), 0)

    padded = te.compute((n, channels, height, width + 2),
                        lambda n, c, i, j: x[n, c, i, clamp(j - 1, width - 1)], name="padded")
    near, far = tirx.const(0.75, dtype), tirx.const(0.25, dtype)

    def upsampled(n, c, y, column):
        i, q = y // 2, y % 2
        j, p = column // 2, column % 2
        other = clamp(i - 1 + 2 * q, height - 1)

        def row(r):  # padded[.., j + 1] is x[.., j]; padded[.., j + 2p] is x[.., j - 1 + 2p]
            return near * padded[n, c, r, j + 1] + far * padded[n, c, r, j + 2 * p]

        return near * row(i) + far * row(other)

    out = te.compute((n, channels, 2 * height, 2 * width), upsampled, name="upsampled")
    func = te.create_prim_func([x, out])
    # (private: TE names every function "main", which a module calling it already has)
    return func.without_attr("global_symbol").with_attrs({ATTRIBUTE: True, "op_pattern": OPAQUE})


class BilinearUpsample(ScheduleRule):
    """Schedules `bilinear_upsample_kernel`'s PrimFuncs (see the module docstring)."""

    # LLVM's loop vectorizer, which interleaves the two columns' stores, runs from -O2.
    llvm_opt_level = 3

    def apply(self, func: tirx.PrimFunc, target: Target, _tunable: bool) -> s_tir.Schedule | None:
        if func.attrs is None or ATTRIBUTE not in func.attrs:
            return None
        sch = s_tir.Schedule(func)
        out = sch.get_sblock("upsampled")
        n, c, _, column = sch.get_loops(out)
        _, phase = sch.split(column, [None, 2])
        plane = sch.fuse(n, c)
        sch.parallel(plane)
        sch.unroll(phase)
        sch.compute_at(sch.get_sblock("padded"), plane)
        return sch

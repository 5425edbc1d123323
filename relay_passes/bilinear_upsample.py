"""BilinearUpsampleByTwo: torch's bilinear upsampling by two as one kernel of fixed taps (CPU).

    y = R.image.resize2d(x, [2H, 2W], layout="NCHW", method="linear",
                         coordinate_transformation_mode="half_pixel")
                                              ->     y = R.call_tir(bilinear_upsample, (x,))

`F.interpolate(x, scale_factor=2, mode="bilinear")` (and `nn.Upsample` with it, align_corners
False) converts to that resize2d. TOPI computes each output's source coordinates and weights in
float and gathers its four taps through them; at a scale of exactly two the taps and their
weights are the same for every output (tvmgraph/schedules/bilinear_upsample.py), and the kernel
reads them as plain loads. A U-Net's upsampling (4 x 32 x 32 x 32 -> 64 x 64, with the SiLU
before it and the concatenation after it fused in) took 1.4 ms of a 7.1 ms inference call on a
2-vCPU Xeon.

The kernel is opaque to FuseOps: the element-wise op before it and a concatenation after it
are kernels of their own (each cheap: the resize was slow for its index arithmetic).

Taken: float32 and float64 NCHW tensors of static channels, height and width (the batch may be
symbolic: a dynamic batch), the output exactly twice the input's height and width, half-pixel
centres (`half_pixel` or `pytorch_half_pixel`: they differ only for outputs of one pixel).
Other sizes, align_corners=True, nearest and bicubic keep TOPI's resize. The same values up to
rounding (the weights applied in another order). Only the forward op: the gradient of a
training step's resize is resize2d's own (after autodiff, this pass sees only its forward call).

Position: before LegalizeOps, on CPU targets.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter
from tvmgraph.schedules.bilinear_upsample import bilinear_upsample_kernel

_RESIZE2D = tvm.ir.Op.get("relax.image.resize2d")
_HALF_PIXEL = ("half_pixel", "pytorch_half_pixel")


def _dims(shape: relax.Expr) -> list[int | None] | None:
    """A shape's integers, None for a symbolic one."""
    if not isinstance(shape, relax.ShapeExpr):
        return None
    return [int(v) if isinstance(v, tvm.tirx.IntImm) else None for v in shape.values]


def _input_shape(call: relax.Call) -> list[int | None] | None:
    """x's shape (its batch None when symbolic) where the call is a bilinear upsampling by two
    that the kernel computes."""
    x = call.args[0].ty
    if not isinstance(x, relax.TensorType) or x.dtype not in ("float32", "float64"):
        return None
    attrs = call.attrs
    if (attrs.layout != "NCHW" or attrs.method != "linear"
            or attrs.coordinate_transformation_mode not in _HALF_PIXEL
            or (attrs.out_dtype is not None and str(attrs.out_dtype) not in ("", x.dtype))):
        return None
    shape, size = _dims(x.shape), _dims(call.args[1])
    if shape is None or size is None or len(shape) != 4 or None in shape[1:]:
        return None
    return shape if size == [2 * shape[2], 2 * shape[3]] else None


@mutator
class _Rewriter(BoundRewriter):
    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.kernels: dict[tuple[int | None, int, int, int, str], tvm.ir.GlobalVar] = {}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(_RESIZE2D)):
            return call
        shape = _input_shape(call)
        if shape is None:
            return call
        dtype = call.args[0].ty.dtype
        key = (*shape, dtype)
        if key not in self.kernels:
            self.kernels[key] = self.builder_.add_func(bilinear_upsample_kernel(*key), "bilinear_upsample")
        self.counts["bilinear upsampling by two as one kernel of fixed taps"] += 1
        n = call.args[0].ty.shape.values[0]
        _, c, h, w = shape
        return relax.call_tir(self.kernels[key], [call.args[0]], relax.TensorType([n, c, 2 * h, 2 * w], dtype))


@tvm.transform.module_pass(opt_level=0, name="BilinearUpsampleByTwo")
class BilinearUpsampleByTwo:
    """Rewrite each bilinear NCHW resize2d to twice the height and width as one kernel (CPU)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "BilinearUpsampleByTwo", self.report, _Rewriter(mod))

"""DirectConv1d: a 1-D convolution computed over whole vectors of output columns, then cropped.

TVM 0.27 legalizes `relax.nn.conv1d` with TOPI's `conv1d_ncw`, which no tvmgraph schedule rule
took: a raw-audio net's three convolutions ran at 22-31% of the FMA peak, 60% of its inference.
Its rows are rarely whole vectors (1981, 493, 121 columns: `(W + padding - span) / stride + 1`),
and a first layer reads raw samples at a stride (4 in M5), so output columns in the vector
lanes would read the input at the stride. Here the conv1d becomes one kernel of three steps:

    phases[n, c, p, j]  = x[n, c, j*s + p - pad]    (0 outside x; the input split by position
                                                      modulo the stride: contiguous per phase)
    padded[n, f, col]   = sum over c, k of phases[n, c', t % s, col + t // s] * w[f, c, k]
                                                    (t = k * dilation, c' = c in f's group; col
                                                      up to L rounded up to whole register
                                                      tiles: `padded_row`)
    out[n, f, col]      = padded[n, f, col]          (col < L)

since x[col * s + t - pad] is phase t % s of x, t // s columns on. `tvmgraph/schedules/conv1d.py`
tiles `padded` into registers (output channels x whole vectors of columns), each step loading
contiguous columns of one phase and broadcasting one weight per channel, with no bounds test
inside the reduction. The phases of x are copied per tile of columns (L1), the crop and the
epilogue (bias, activation: FuseOps fuses them in, the kernel is marked out-element-wise
fusable) are done on the tile before its store. With stride 1 there is one phase and the copy
only adds the zeros. Grouped (depthwise) and dilated convolutions alike: a group's channels read
their own rows of the phases, a dilated tap its own offset.

Exact up to the order of the sums. Position: after autodiff (a training step's forward conv1d;
its gradients are conv2ds, tvmgraph/gradients/conv.py), CPU targets only. Limits: NCW/OIW,
static channels, width and kernel (the batch may be symbolic), float32 and float64 with the
result in the input's type (16-bit convolutions keep TVM's).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_on_cpu
from relay_passes.rebind import BoundRewriter
from tvmgraph.schedules.conv1d import BLOCK, padded_row
from tvmgraph.schedules.cpu_target import CPUTarget

OUT_EWISE_FUSABLE = 4  # TVM's OpPatternKind kOutEWiseFusable: FuseOps fuses element-wise ops after it


def padded_conv1d(x: te.Tensor, w: te.Tensor, stride: int, padding: tuple[int, int], dilation: int,
                  groups: int, rows: int) -> te.Tensor:
    """conv1d(x, w) (NCW, OIW) as phases, a product over `rows` columns (at least the output's)
    and a crop."""
    _, channels, width = x.shape
    filters, group_channels, kernel = (int(d) for d in w.shape)
    channels, width = int(channels), int(width)
    left, right = padding
    length = (width + left + right - (kernel - 1) * dilation - 1) // stride + 1
    assert rows >= length, (rows, length)
    reach = (kernel - 1) * dilation // stride  # the last tap's offset within its phase
    per_group = filters // groups

    def phase(n, c, p, j):  # noqa: ANN001, ANN202  (te index variables)
        at = j * stride + p - left
        inside = tirx.all(at >= 0, at < width)
        return tirx.if_then_else(inside, x[n, c, tirx.min(tirx.max(at, 0), width - 1)], tirx.const(0, x.dtype))

    phases = te.compute((x.shape[0], channels, stride, rows + reach), phase, name="conv1d_phases")
    rc = te.reduce_axis((0, group_channels), name="rc")
    rk = te.reduce_axis((0, kernel), name="rk")

    def product(n, f, col):  # noqa: ANN001, ANN202
        channel = rc if groups == 1 else f // per_group * group_channels + rc
        tap = rk * dilation  # x[col * s + tap - pad] lies in phase tap % s, tap // s columns on
        return te.sum(phases[n, channel, tap % stride, col + tap // stride] * w[f, rc, rk], axis=[rc, rk])

    padded = te.compute((x.shape[0], filters, rows), product, name=BLOCK)
    return te.compute((x.shape[0], filters, length), lambda n, f, col: padded[n, f, col], name="conv1d_crop")


def _ints(values: object) -> list[int]:
    return [int(v) for v in values]  # type: ignore[union-attr]


def _supported(call: relax.Call) -> bool:
    """NCW/OIW, static sizes but the batch, float32/64 in and out."""
    attrs = call.attrs
    x, w = call.args
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NCW", "OIW", "NCW"):
        return False
    dtypes = {str(x.ty.dtype), str(w.ty.dtype), str(call.ty.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in ("float32", "float64"):
        return False
    x_shape, w_shape = getattr(x.ty, "shape", None), getattr(w.ty, "shape", None)
    if x_shape is None or w_shape is None or len(x_shape) != 3:
        return False
    return all(isinstance(d, tirx.IntImm) for d in (*x_shape.values[1:], *w_shape.values))


@mutator
class _Rewriter(BoundRewriter):
    def __init__(self, mod: tvm.IRModule, cpu: CPUTarget) -> None:
        super().__init__(mod)
        self.cpu = cpu

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv1d" and _supported(call)):
            return call
        attrs = call.attrs
        stride, dilation, groups = int(attrs.strides[0]), int(attrs.dilation[0]), int(attrs.groups)
        length = int(call.ty.shape[2])
        rows = padded_row(self.cpu, length, str(call.ty.dtype))
        self.counts[f"conv1d stride {stride}, {length} -> {rows} columns"] += 1
        bb = self.builder_
        out = bb.emit_te(padded_conv1d, *call.args, stride, tuple(_ints(attrs.padding)), dilation, groups, rows,
                         primfunc_name_hint="conv1d")
        gv = bb.lookup_binding(out).args[0]
        bb.update_func(gv, bb.get()[gv].with_attr("op_pattern", OUT_EWISE_FUSABLE))
        return out


@tvm.transform.module_pass(opt_level=0, name="DirectConv1d")
class DirectConv1d:
    """Compute each supported conv1d as `padded_conv1d` (under an llvm target)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_on_cpu(mod, "DirectConv1d", self.report, lambda cpu: _Rewriter(mod, cpu), drop_unused=True)

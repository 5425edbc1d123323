"""Im2colConv: a convolution on small images becomes an im2col copy and one matmul.

tvmgraph's direct convolution schedule (tvmgraph/schedules/conv.py) puts output columns in the
vector registers. On the 4x4 and 8x8 images of a network's last stages (ResNet-18's layer3 and
layer4 at CIFAR size) a 16-lane vector holds 4 or 8 columns, and those kernels ran at 90-110
GFLOP/s where the matmul schedule reaches 350-400 on the same machine. Here

    y = R.nn.conv2d(x, w, strides=s, padding=p, dilation=d)          # x: [N, C, H, W], small H, W

becomes

    cols = im2col(x)                         # [N, C, kh, kw, Ho, Wo]: shifted planes, 0 where padded
    rows = R.reshape(cols, [N, C * kh * kw, Ho * Wo])                   # a view
    y = R.reshape(R.matmul(R.reshape(w, [F, C * kh * kw]), rows), [N, F, Ho, Wo])

the weight broadcast over the batch and read in place, the output already NCHW. A transposed
convolution (a conv's input gradient) goes the other way round:

    cols = R.matmul(R.permute_dims(R.reshape(w, [F, C * kh * kw])), R.reshape(dy, [N, F, H * W]))
    dx = col2im(cols)                        # each pixel sums the kernel offsets that reach it

every pixel of dy times the whole kernel (the transpose is read in place by the matmul), then
each output pixel adds up the at most kh * kw products that land on it: no multiply by the
zeros a strided transposed convolution inserts. On images of fewer than FOLD_BATCH_BELOW
pixels the product would have a vector's width of columns or less per image, so all images'
pixels go into one product instead:

    cols = R.matmul(R.reshape(R.permute_dims(dy, [0, 2, 3, 1]), [N * H * W, F]), R.reshape(w, [F, C * kh * kw]))

and col2im reads cols as [(n, y, x), (c, ky, kx)]. A weight gradient (autodiff's conv of x read
as CNHW with dy read as IOHW) is one matmul over the batch's pixels:

    cols = im2col(x)                         # [C, kh, kw, N, Ho, Wo]: the batch inside
    dw = R.reshape(R.matmul(R.reshape(R.permute_dims(dy, [1, 0, 2, 3]), [F, N * Ho * Wo]),
                            R.permute_dims(R.reshape(cols, [C * kh * kw, N * Ho * Wo]))),
                   [F, C, kh, kw])

when its images are narrower than a vector, its conv strided or its kernel 1x1. The copies
are kh * kw times the smaller image: ResNet-18's largest is 9.4 MiB, live only until the next
kernel has read it. A 1x1 one with stride 1 and no padding needs no copy: NCHW is already
[channels, pixels] per image, so

    dw = R.reshape(R.sum(R.matmul(R.reshape(dy, [N, F, H * W]),
                                  R.permute_dims(R.reshape(x, [N, C, H * W]), [0, 2, 1])), axis=[0]), [F, C, 1, 1])

(x first when it has more channels), while the per-image products are no larger than dy and x.

Exact up to the order of the sums (the matmul adds the C * kh * kw products in its own order).

Position: after autodiff (it rewrites the backward pass's convolutions too), before FuseEpilogue;
CPU targets only. Limits: NCHW/OIHW (IOHW transposed), groups 1, static image sizes (the batch
may be symbolic), output width below MAX_WIDTH (wider images keep the direct schedule, at
65-75% of the FMA peak there; except strided convolutions, rewritten at any width: TOPI's
transposed one multiplies the zeros of a dilated dy, and the direct schedule reads a strided
conv's input at the stride, and 1-D rows that no vector divides, rewritten at any width: the
direct schedule runs their columns scalar), float32 and float64 results (16-bit inputs with a
float32 result: AccumulateFloat32's).

A conv1d's gradients are conv2ds of height 1 (tvmgraph/gradients/conv.py), rewritten here when
no vector divides their rows. The conv1d itself is not taken: as the conv2d of x viewed as
[N, C, 1, L] (im2col, then the weight [F, C * K] times [C * K, L] per image) a raw-audio net's
inference went from 11.7 to 16.5 ms, its products of 32-128 rows at 15-29% of the FMA peak;
relay_passes/direct_conv1d.py computes it directly.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import mutator
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

from relay_passes import OPAQUE, rewrite_graph_functions
from relay_passes.rebind import BoundRewriter

# Output widths below this (one AVX-512 vector of float32) go through im2col.
MAX_WIDTH = 16
# Below this many multiply-adds per output element the direct schedule is as good.
MIN_REDUCTION = 64
# A transposed conv on images of fewer pixels than this multiplies all images' pixels at once:
# per image, the product's output rows (the pixels) fill one vector of 16 at most.
FOLD_BATCH_BELOW = 32


def _ints(values: object) -> list[int]:
    return [int(v) for v in values]  # type: ignore[attr-defined]


def _im2col(x: te.Tensor, kernel: tuple[int, int], strides: list[int], padding: list[int],
            dilation: list[int], out_hw: tuple[int, int], batch_inside: bool = False) -> te.Tensor:
    """cols[n, c, ky, kx, y, x] = x_pad[n, c, y * s + ky * d, x * s + kx * d]: each (c, ky, kx)
    a shifted copy of the plane; laid out [c, ky, kx, n, y, x] with `batch_inside`."""
    n, channels, h, w = x.shape
    kh, kw = kernel
    ho, wo = out_hw

    def value(image, channel, ky, kx, y, col):  # noqa: ANN001, ANN202  (te index variables)
        iy = y * strides[0] + ky * dilation[0] - padding[0]
        ix = col * strides[1] + kx * dilation[1] - padding[1]
        inside = tirx.all(iy >= 0, iy < h, ix >= 0, ix < w)
        return tirx.if_then_else(inside, x[image, channel, iy, ix], tirx.const(0, x.dtype))

    if batch_inside:
        return te.compute((channels, kh, kw, n, ho, wo),
                          lambda c, ky, kx, i, y, col: value(i, c, ky, kx, y, col), name="im2col")
    return te.compute((n, channels, kh, kw, ho, wo), value, name="im2col")


@mutator
class _Rewriter(BoundRewriter):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else None
        if name == "relax.nn.conv2d" and _worth_it(call, "OIHW"):
            self.counts["conv2d as im2col + matmul"] += 1
            return self._im2col_matmul(call)
        if name == "relax.nn.conv2d" and _pointwise_weight_grad(call):
            self.counts["1x1 weight gradient as per-image matmuls"] += 1
            return self._per_image_weight_grad(call)
        if name == "relax.nn.conv2d" and _weight_grad_worth_it(call):
            self.counts["weight gradient as im2col + matmul"] += 1
            return self._weight_grad_matmul(call)
        if name == "relax.nn.conv2d_transpose" and _worth_it(call, "IOHW"):
            self.counts["conv2d_transpose as matmul + col2im"] += 1
            return self._matmul_col2im(call)
        return call

    def _emit_im2col(self, data: relax.Expr, kernel: tuple[int, int], strides: list[int],
                     padding: list[int], dilation: list[int], out_hw: tuple[int, int],
                     batch_inside: bool = False) -> relax.Var:
        """Emit `_im2col` as its own kernel."""
        bb = self.builder_
        cols = bb.emit_te(_im2col, data, kernel, strides, padding, dilation, out_hw, batch_inside,
                          primfunc_name_hint="im2col")
        # NOTE: opaque, so that FuseOps leaves the reshape after it out of it (a reshape inside
        # the copy divides every index; alone it is a free view).
        gv = bb.lookup_binding(cols).args[0]
        bb.update_func(gv, bb.get()[gv].with_attr("op_pattern", OPAQUE))
        return cols

    def _im2col_matmul(self, call: relax.Call) -> relax.Expr:
        """conv2d(x, w): the shifted planes of x (im2col), then one matmul with w read in place."""
        bb = self.builder_
        attrs = call.attrs
        data, weight = call.args
        batch, f, ho, wo = call.ty.shape.values
        _, c, kh, kw = _ints(weight.ty.shape.values)
        cols = self._emit_im2col(data, (kh, kw), _ints(attrs.strides), _ints(attrs.padding)[:2],
                                 _ints(attrs.dilation), (int(ho), int(wo)))
        k = c * kh * kw
        rows = bb.emit(relax.op.reshape(cols, [batch, k, ho * wo]))
        weight = bb.emit(relax.op.reshape(weight, [f, k]))
        # [F, K] @ [N, K, Ho * Wo]: the weight is broadcast over the batch, read in place.
        product = bb.emit(relax.op.matmul(weight, rows, out_dtype=str(call.ty.dtype)))
        return relax.op.reshape(product, [batch, f, ho, wo])

    def _weight_grad_matmul(self, call: relax.Call) -> relax.Expr:
        """dw = conv2d(x as CNHW, dy as IOHW) (autodiff's weight gradient): the windows of x
        laid out [C, kh, kw, N, Ho, Wo] (im2col with the batch inside), and one matmul of dy's
        channels with them over the batch's pixels."""
        bb = self.builder_
        attrs = call.attrs
        data, dy = call.args
        batch, f, ho, wo = dy.ty.shape.values
        _, c, kh, kw = _ints(call.ty.shape.values)  # CNHW: (F, C, kh, kw)
        # autodiff's conv: strides = the forward dilation, dilation = the forward stride
        cols = self._emit_im2col(data, (kh, kw), _ints(attrs.dilation), _ints(attrs.padding)[:2],
                                 _ints(attrs.strides), (int(ho), int(wo)), batch_inside=True)
        pixels = batch * ho * wo
        windows = bb.emit(relax.op.reshape(cols, [c * kh * kw, pixels]))
        dy_rows = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(dy, [1, 0, 2, 3])), [f, pixels]))
        # [F, pixels] @ [pixels, C * kh * kw]: the windows' transpose is read in place
        product = bb.emit(relax.op.matmul(dy_rows, bb.emit(relax.op.permute_dims(windows, [1, 0])),
                                          out_dtype=str(call.ty.dtype)))
        return relax.op.reshape(product, [f, c, kh, kw])

    def _per_image_weight_grad(self, call: relax.Call) -> relax.Expr:
        """dw of a 1x1 conv with stride 1: the sum over the images of dy[n] @ x[n]^T, both read
        as [channels, pixels], which NCHW already is; the operand with more channels is the
        matmul's A, read in place, and the other one's transpose is packed by the matmul."""
        bb = self.builder_
        data, dy = call.args
        batch, f, ho, wo = dy.ty.shape.values
        c = data.ty.shape.values[1]
        dy_rows = bb.emit(relax.op.reshape(dy, [batch, f, ho * wo]))
        x_rows = bb.emit(relax.op.reshape(data, [batch, c, ho * wo]))
        swapped = int(c) > int(f)
        a, b = (x_rows, dy_rows) if swapped else (dy_rows, x_rows)
        per_image = bb.emit(relax.op.matmul(a, bb.emit(relax.op.permute_dims(b, [0, 2, 1])),
                                            out_dtype=str(call.ty.dtype)))
        dw = relax.op.sum(per_image, axis=[0])
        if swapped:  # [C, F]
            dw = relax.op.permute_dims(bb.emit(dw), [1, 0])
        return relax.op.reshape(bb.emit(dw), [f, c, 1, 1])

    def _matmul_col2im(self, call: relax.Call) -> relax.Expr:
        """conv2d_transpose(dy, w): every pixel of dy times the kernel (one matmul, w read in
        place), then each output pixel sums the products that land on it (col2im)."""
        bb = self.builder_
        attrs = call.attrs
        dy, weight = call.args
        batch, f, hi, wi = dy.ty.shape.values
        _, c, kh, kw = _ints(weight.ty.shape.values)  # IOHW: I = dy's channels
        k = c * kh * kw
        pixels_first = int(hi) * int(wi) < FOLD_BATCH_BELOW
        if pixels_first:
            # [N * Hi * Wi, F] @ [F, K]: every image's pixels in one product, w read in place.
            rows = bb.emit(relax.op.reshape(bb.emit(relax.op.permute_dims(dy, [0, 2, 3, 1])),
                                            [batch * hi * wi, f]))
            cols = bb.emit(relax.op.matmul(rows, bb.emit(relax.op.reshape(weight, [f, k])),
                                           out_dtype=str(call.ty.dtype)))
        else:
            wt = bb.emit(relax.op.permute_dims(bb.emit(relax.op.reshape(weight, [f, k])), [1, 0]))
            rows = bb.emit(relax.op.reshape(dy, [batch, f, hi * wi]))
            cols = bb.emit(relax.op.matmul(wt, rows, out_dtype=str(call.ty.dtype)))  # [N, K, Hi * Wi]
        return bb.emit_te(_col2im, cols, (kh, kw), _ints(attrs.strides), _ints(attrs.padding)[:2],
                          _ints(attrs.dilation), (int(hi), int(wi)), tuple(call.ty.shape.values),
                          pixels_first, primfunc_name_hint="col2im")


def _static_shapes(call: relax.Call, layouts: tuple[str, str, str]) -> list | None:
    """The (data, kernel, output) dims of a groups-1 conv in `layouts` whose sizes are static
    but for the batch (dim 0 of data and output in NCHW, dim 0 of both operands for a weight
    gradient) and whose dtypes a float32/64 matmul can take; None otherwise."""
    attrs = call.attrs
    found = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout or attrs.data_layout)
    if tuple(map(str, found)) != layouts or int(attrs.groups) != 1:
        return None
    shapes = [getattr(e.ty, "shape", None) for e in (*call.args, call)]
    if any(s is None for s in shapes):
        return None
    dims = [list(s.values) for s in shapes]
    batch_at = [0, 0, None] if layouts[0] == "CNHW" else [0, None, 0]
    if not all(isinstance(d, tirx.IntImm) for ds, skip in zip(dims, batch_at)
               for i, d in enumerate(ds) if i != skip):
        return None
    dtype = str(call.ty.dtype)
    # A 16-bit conv comes here with a float32 result (AccumulateFloat32 ran): its matmul then
    # sums in float32 as well. 16-bit results would sum in 16 bits: left as they are.
    inputs = {"float32": ("float32", "bfloat16", "float16"), "float64": ("float64",)}.get(dtype, ())
    if any(str(a.ty.dtype) not in inputs for a in call.args):
        return None
    return dims


def _pointwise_weight_grad(call: relax.Call) -> bool:
    """A 1x1 conv's weight gradient, stride 1 and no padding, whose per-image products [F, C]
    are no larger than their operands [F + C, pixels]. As one matmul over the batch's pixels,
    both operands were first copied to [channels, N * pixels] (a 25 MiB dy for the CNN's 96
    channels at 32 x 32); per image, NCHW is read in place: 3.6 -> 1.5 ms there, 28% -> 66% of
    the FMA peak (Zen 3). With more products than pixels (512 x 256 channels at 4 x 4) the
    per-image results would outgrow the tensors they come from."""
    dims = _static_shapes(call, ("CNHW", "IOHW", "CNHW"))
    if dims is None:
        return False
    data, dy, out = dims
    attrs = call.attrs
    if [int(d) for d in out[2:]] != [1, 1] or [int(d) for d in data[2:]] != [int(d) for d in dy[2:]]:
        return False
    if _ints(attrs.padding) != [0, 0, 0, 0] or _ints(attrs.dilation) != [1, 1]:
        return False
    f, c, pixels = int(dy[1]), int(data[1]), int(dy[2]) * int(dy[3])
    return f * c <= (f + c) * pixels


def _weight_grad_worth_it(call: relax.Call) -> bool:
    """A weight gradient (CNHW / IOHW) on images narrower than a vector, of a strided conv
    (dilated here), or of a 1x1 kernel. conv_gemm.py's tiles of the kernel's 3 columns ran the
    first at 47-54% of the FMA peak (ResNet-18's 4x4 and 8x8 layers), the dilated ones at 39%
    and the 1x1 ones at 11-19%; as one matmul with an im2col copy, 61-79%: training step -3.2%
    (A/B, 2026-11-26). On 16x16 images, stride 1, it gained nothing measurable."""
    dims = _static_shapes(call, ("CNHW", "IOHW", "CNHW"))
    if dims is None:
        return False
    _, dy, out = dims
    one_by_one = (int(out[2]), int(out[3])) == (1, 1)
    return (one_by_one or _ints(call.attrs.dilation) != [1, 1] or int(dy[3]) < MAX_WIDTH
            or _ragged_row(int(dy[2]), int(out[2]), int(dy[3])))


def _ragged_row(height: int, kernel_height: int, width: int) -> bool:
    """A 1-D convolution (images and kernel of height 1: a conv1d's gradients are such conv2ds)
    whose output width no vector divides: TOPI's transposed convolution and conv_gemm.py's
    tiles put output columns in the vector registers only where a vector divides them. A
    raw-audio net's input gradients (widths 495 and 123) ran at 6% of the FMA peak; with these
    and its weight gradients rewritten, its training step 64.0 -> 46.5 ms (A/B, Zen 3)."""
    return height == 1 and kernel_height == 1 and width % MAX_WIDTH != 0


def _worth_it(call: relax.Call, kernel_layout: str) -> bool:
    """NCHW with `kernel_layout`, groups 1, float32/64, static image and kernel sizes, more than
    MIN_REDUCTION products per output, and either a strided conv or output rows narrower than a
    vector with a kernel larger than 1x1 (a matmul already)."""
    attrs = call.attrs
    dims = _static_shapes(call, ("NCHW", kernel_layout, "NCHW"))
    if dims is None:
        return False
    data, weight, out = dims
    kh, kw = int(weight[2]), int(weight[3])
    if int(data[1]) * kh * kw < MIN_REDUCTION:
        return False
    if call.op.name == "relax.nn.conv2d_transpose" and _ints(attrs.strides) != [1, 1]:
        # A strided transposed conv (the input gradient of a strided conv) runs in TOPI on dy
        # dilated with zeros: 3 of 4 multiply-adds are with zeros at stride 2, whatever the
        # width or kernel (ResNet-18's 32x32 one: 9.3 ms, 12% of the FMA peak in useful work;
        # its training step 0.94x as matmul + col2im, which does no wasted work).
        return True
    if _ints(attrs.strides) != [1, 1]:
        # Strided: the direct schedule's vectors of output columns read the input at the
        # stride. ResNet-18's 3x3 stride-2 conv on 32x32 images ran at 30% of the FMA peak
        # (3.8 ms); im2col + matmul: inference -4%, training step -1.3% (A/B, 2026-11-26).
        # Its 1x1 stride-2 shortcuts ran at 25-34% (their im2col is a strided slice).
        return True
    if (kh, kw) == (1, 1):
        return False  # a 1x1 conv is a matmul already
    return int(out[3]) < MAX_WIDTH or _ragged_row(int(out[2]), kh, int(out[3]))


def _col2im(cols: te.Tensor, kernel: tuple[int, int], strides: list[int], padding: list[int],
            dilation: list[int], in_hw: tuple[int, int], out_shape: tuple,
            pixels_first: bool = False) -> te.Tensor:
    """dx[n, c, iy, ix] = the sum of cols[n, (c, ky, kx), (y, x)] over the kernel offsets
    (ky, kx) and pixels (y, x) of dy with iy = y * s + ky * d - p (and the same along x);
    cols laid out [(n, y, x), (c, ky, kx)] with `pixels_first`.

    Written as a scatter: each plane of dx (one image, one channel) is zeroed, then each kernel
    offset adds its plane of cols to the pixels it reaches, over ranges of (y, x) computed here
    so that no test is left in the loops. The plane of dx stays in L1 while its offsets add up.
    The gather form (each pixel of dx testing all offsets for the ones that reach it, a
    division and a stride test each) vectorized into gathers and ran at 13-30% of the memory
    bandwidth on ResNet-18's strided input gradients."""
    kh, kw = kernel
    hi, wi = in_hw
    _, channels, ho, wo = out_shape
    plane, taps = ho * wo, hi * wi

    def reached(size: int, out: int, k: int, axis: int) -> tuple[int, int]:
        """The range of dy's pixels along `axis` whose offset k lands inside dx (0 <= . < out)."""
        shift = k * dilation[axis] - padding[axis]
        low = max(0, -(shift // strides[axis]))  # ceil(-shift / s)
        high = min(size, (out - 1 - shift) // strides[axis] + 1)
        return low, max(low, high)

    def source(nc, ky: int, kx: int, tap):  # noqa: ANN001, ANN202  (TIR expressions)
        """Where cols holds image and channel `nc`'s product at kernel offset (ky, kx), pixel `tap`."""
        if pixels_first:
            image, channel = nc // channels, nc % channels
            return (image * taps + tap) * (channels * kh * kw) + (channel * kh + ky) * kw + kx
        return (nc * (kh * kw) + ky * kw + kx) * taps + tap

    def scatter(ins: list[tirx.Buffer], outs: list[tirx.Buffer]) -> tirx.Stmt:
        src, dst = T.buffer_proxy(ins[0]), T.buffer_proxy(outs[0])
        with IRBuilder() as ib:
            with T.parallel(0, out_shape[0] * channels) as nc:  # one plane of dx: image, channel
                with T.seq_scope():
                    with T.serial(0, plane) as i:
                        dst[nc * plane + i] = tirx.const(0, cols.dtype)
                    for ky in range(kh):
                        y0, y1 = reached(hi, ho, ky, 0)
                        for kx in range(kw):
                            x0, x1 = reached(wi, wo, kx, 1)
                            if y0 == y1 or x0 == x1:
                                continue
                            with T.serial(y0, y1) as y:
                                with T.serial(x0, x1) as x:
                                    at = nc * plane + (y * strides[0] + ky * dilation[0] - padding[0]) * wo \
                                        + x * strides[1] + kx * dilation[1] - padding[1]
                                    dst[at] = dst[at] + src[source(nc, ky, kx, y * wi + x)]
        return ib.get()

    return te.extern([out_shape], [cols], scatter, dtype=[str(cols.dtype)], name="col2im")


@tvm.transform.module_pass(opt_level=0, name="Im2colConv")
class Im2colConv:
    """Run convolutions whose output rows are narrower than a vector as im2col + matmul."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "Im2colConv", self.report, _Rewriter(mod), drop_unused=True)

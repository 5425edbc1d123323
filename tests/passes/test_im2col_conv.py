"""Im2colConv: convolutions on images narrower than a vector run as im2col + matmul (and
transposed ones as matmul + col2im), with torch's numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.im2col_conv import Im2colConv

TARGET = tvm.target.Target({"kind": "llvm"})

# id: (op, data shape, weight shape, stride, padding, dilation, output_padding)
CASES = {
    "conv-3x3-s1": ("conv2d", (2, 8, 6, 6), (5, 8, 3, 3), 1, 1, 1, 0),
    "conv-3x3-s2": ("conv2d", (2, 8, 7, 7), (5, 8, 3, 3), 2, 1, 1, 0),
    "conv-3x3-dilated-asymmetric": ("conv2d", (1, 8, 6, 5), (4, 8, 3, 3), 1, 2, 2, 0),
    "conv-5x3-s2-no-padding": ("conv2d", (1, 8, 9, 7), (3, 8, 5, 3), 2, 0, 1, 0),
    "transpose-3x3-s1": ("conv2d_transpose", (2, 8, 6, 6), (8, 5, 3, 3), 1, 1, 1, 0),
    "transpose-3x3-s2-output-padding": ("conv2d_transpose", (2, 8, 4, 4), (8, 5, 3, 3), 2, 1, 1, 1),
    "transpose-2x2-s2": ("conv2d_transpose", (1, 16, 3, 3), (16, 4, 2, 2), 2, 0, 1, 0),
    "transpose-3x3-dilated": ("conv2d_transpose", (1, 8, 4, 5), (8, 3, 3, 3), 1, 1, 2, 0),
    "transpose-1x1-s2-wide": ("conv2d_transpose", (1, 64, 10, 10), (64, 8, 1, 1), 2, 0, 1, 1),
    # Strided transposed convs at any width: TOPI's would multiply the zeros of a dilated dy.
    "transpose-3x3-s2-wide": ("conv2d_transpose", (2, 16, 16, 16), (16, 8, 3, 3), 2, 1, 1, 1),
    # and strided convs: the direct schedule reads the input at the stride
    "conv-3x3-s2-wide": ("conv2d", (2, 8, 33, 34), (5, 8, 3, 3), 2, 1, 1, 0),
    # 1x1 too (ResNet's downsampling shortcuts): the im2col is a strided slice
    "conv-1x1-s2-wide": ("conv2d", (2, 64, 20, 18), (16, 64, 1, 1), 2, 0, 1, 0),
    # 1-D (height 1) rows that no vector divides, at any width (a conv1d's input gradient)
    "conv-1x3-ragged-row": ("conv2d", (2, 32, 1, 37), (8, 32, 1, 3), 1, (0, 1), 1, 0),
    "transpose-1x3-ragged-row": ("conv2d_transpose", (2, 32, 1, 35), (32, 8, 1, 3), 1, 0, 1, 0),
}


def conv_module(op: str, data: tuple, weight: tuple, stride: int, padding: int, dilation: int,
                output_padding: int) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(data, "float64"))
    w = relax.Var("w", R.Tensor(weight, "float64"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            if op == "conv2d":
                y = relax.op.nn.conv2d(x, w, stride, padding, dilation)
            else:
                y = relax.op.nn.conv2d_transpose(x, w, stride, padding, output_padding, dilation)
            out = bb.emit_output(bb.emit(y))
        bb.emit_func_output(out)
    return bb.get()


def torch_conv(op: str, x: torch.Tensor, w: torch.Tensor, stride: int, padding: int, dilation: int,
               output_padding: int) -> torch.Tensor:
    if op == "conv2d":
        return torch.nn.functional.conv2d(x, w, None, stride, padding, dilation)
    return torch.nn.functional.conv_transpose2d(x, w, None, stride, padding, output_padding, 1, dilation)


def run(mod: tvm.IRModule, *args: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a) for a in args)).numpy()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_rewritten_convolution_equals_torch_in_float64(case: tuple) -> None:
    """Exact up to the order of the sums: float64 within 1e-12 of torch's float64 result."""
    op, data, weight, *window = case
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(data), rng.standard_normal(weight)
    messages: list[str] = []
    mod = Im2colConv(messages.append)(conv_module(op, data, weight, *window))
    names = [gv.name_hint for gv in mod.get_global_vars()]
    if op == "conv2d":
        assert "im2col" in names and messages == ["Im2colConv: conv2d as im2col + matmul x1"]
    else:
        assert "col2im" in names and messages == ["Im2colConv: conv2d_transpose as matmul + col2im x1"]
    want = torch_conv(op, torch.from_numpy(x), torch.from_numpy(w), *window).numpy()
    np.testing.assert_allclose(run(mod, x, w), want, rtol=1e-12, atol=1e-12)


def test_wide_images_grouped_and_1x1_convolutions_are_left_alone() -> None:
    """Output rows of a vector or more keep the direct schedule (unless the conv is strided); a
    grouped conv, a 1x1 one (a matmul already) and a strided one with under MIN_REDUCTION
    products per output are not rewritten."""
    for module in (conv_module("conv2d", (1, 8, 16, 16), (4, 8, 3, 3), 1, 1, 1, 0),
                   conv_module("conv2d_transpose", (1, 8, 16, 16), (8, 4, 3, 3), 1, 1, 1, 0),
                   conv_module("conv2d", (1, 8, 6, 6), (4, 8, 1, 1), 1, 0, 1, 0),
                   conv_module("conv2d", (1, 8, 32, 32), (4, 8, 1, 1), 2, 0, 1, 0)):
        tvm.ir.assert_structural_equal(Im2colConv()(module), module)

    @I.ir_module
    class Grouped:
        @R.function
        def main(x: R.Tensor((1, 8, 6, 6), "float32"), w: R.Tensor((8, 1, 3, 3), "float32")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, padding=1, groups=8)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(Im2colConv()(Grouped), Grouped)


def test_the_rewrite_is_a_copy_a_view_and_one_matmul() -> None:
    """Before/after: conv2d becomes im2col (opaque: FuseOps fuses nothing into it), a reshape
    to [N, C * kh * kw, Ho * Wo], the weight viewed as [F, C * kh * kw], one matmul, a reshape."""
    mod = Im2colConv()(conv_module("conv2d", (2, 8, 6, 6), (5, 8, 3, 3), 1, 1, 1, 0))
    bindings = [b for b in mod["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert [b.value.op.name for b in bindings] == [
        "relax.call_tir", "relax.reshape", "relax.reshape", "relax.matmul", "relax.reshape"]
    assert int(mod["im2col"].attrs["op_pattern"]) == 8
    shapes = [[int(d) for d in b.var.ty.shape.values] for b in bindings]
    assert shapes == [[2, 8, 3, 3, 6, 6], [2, 72, 36], [5, 72], [2, 5, 36], [2, 5, 6, 6]]


def test_transposed_conv_on_tiny_images_multiplies_every_images_pixels_at_once() -> None:
    """Before/after: a transposed conv on 4x4 images (ResNet-18's layer 4 input gradients)
    takes dy as [N * H * W, F] (permuted to pixels first) times w viewed as [F, C * kh * kw]:
    one product with N * 16 rows instead of N products with 16 columns each (0.47 -> 0.65 of
    the FMA peak on a Xeon). On 6x6 images (36 pixels) the product stays per image."""
    def product_shape(data: tuple) -> list[int]:
        mod = Im2colConv()(conv_module("conv2d_transpose", data, (8, 5, 3, 3), 1, 1, 1, 0))
        matmul = next(b for b in mod["main"].body.blocks[0].bindings
                      if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul")
        return [int(d) for d in matmul.var.ty.shape.values]

    assert product_shape((3, 8, 4, 4)) == [3 * 16, 5 * 9]
    assert product_shape((3, 8, 6, 6)) == [3, 5 * 9, 36]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((3, 8, 4, 4)), rng.standard_normal((8, 5, 3, 3))
    mod = Im2colConv()(conv_module("conv2d_transpose", x.shape, w.shape, 1, 1, 1, 0))
    want = torch_conv("conv2d_transpose", torch.from_numpy(x), torch.from_numpy(w), 1, 1, 1, 0).numpy()
    np.testing.assert_allclose(run(mod, x, w), want, rtol=1e-12, atol=1e-12)


def test_half_precision_convolutions_sum_in_float32() -> None:
    """A bfloat16 conv with a bfloat16 result is left alone (its matmul would sum in bfloat16);
    after AccumulateFloat32 (bfloat16 inputs, a float32 result) it is rewritten, its matmul sums
    in float32, and the result rounded to bfloat16 is torch's within one bfloat16 step."""
    from relay_passes.accumulate_float32 import AccumulateFloat32

    @I.ir_module
    class Half:
        @R.function
        def main(x: R.Tensor((2, 16, 4, 4), "bfloat16"), w: R.Tensor((8, 16, 3, 3), "bfloat16")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, padding=1)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(Im2colConv()(Half), Half)
    mod = Im2colConv()(AccumulateFloat32()(Half))
    matmuls = [b.value for b in mod["main"].body.blocks[0].bindings
               if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.matmul"]
    assert "im2col" in [gv.name_hint for gv in mod.get_global_vars()]
    assert len(matmuls) == 1 and matmuls[0].attrs.out_dtype == "float32"
    x, w = torch.randn(2, 16, 4, 4).bfloat16(), torch.randn(8, 16, 3, 3).bfloat16()
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    got = torch.from_dlpack(vm["main"](x, w))
    want = torch.nn.functional.conv2d(x, w, padding=1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-8, atol=1e-2)


def weight_grad_module(data: tuple, grad: tuple, stride: int, padding: int, dilation: int) -> tvm.IRModule:
    """dw of y = conv2d(x, w, stride, padding, dilation) as autodiff writes it: a conv of x read
    as CNHW with dy read as IOHW, strides and dilation swapped."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(data, "float64"))
    dy = relax.Var("dy", R.Tensor(grad, "float64"))
    with bb.function("main", [x, dy]):
        with bb.dataflow():
            dw = relax.op.nn.conv2d(x, dy, dilation, padding, stride, 1, "CNHW", "IOHW", "CNHW")
            out = bb.emit_output(bb.emit(dw))
        bb.emit_func_output(out)
    return bb.get()


# id: (data shape, weight shape, stride, padding, dilation)
WEIGHT_GRAD_CASES = {
    "3x3-s1": ((3, 8, 6, 6), (5, 8, 3, 3), 1, 1, 1),
    "3x3-s2": ((2, 8, 7, 7), (5, 8, 3, 3), 2, 1, 1),
    "3x3-dilated": ((2, 4, 8, 7), (3, 4, 3, 3), 1, 2, 2),
    "5x3-s2-no-padding": ((1, 6, 9, 7), (4, 6, 5, 3), 2, 0, 1),
    "1x1-more-products-than-pixels": ((2, 16, 2, 2), (12, 16, 1, 1), 1, 0, 1),
    "3x3-s2-wide": ((2, 4, 31, 31), (3, 4, 3, 3), 2, 1, 1),  # strided: at any width
    "1x3-ragged-row": ((2, 16, 1, 39), (8, 16, 1, 3), 1, 0, 1),  # a conv1d's, width 37
}


@pytest.mark.parametrize("case", WEIGHT_GRAD_CASES.values(), ids=WEIGHT_GRAD_CASES.keys())
def test_rewritten_weight_gradient_equals_torch_in_float64(case: tuple) -> None:
    """A weight gradient on images narrower than a vector (or strided, or 1x1) is an im2col with the batch inside
    ([C, kh, kw, N, Ho, Wo]) and one matmul over the batch's pixels: torch's dw within 1e-12."""
    data, weight, stride, padding, dilation = case
    kh, kw = weight[2:]
    out = [(n + 2 * padding - dilation * (k - 1) - 1) // stride + 1 for n, k in zip(data[2:], (kh, kw))]
    if any((o - 1) * stride + (k - 1) * dilation + 1 != n + 2 * padding
           for o, k, n in zip(out, (kh, kw), data[2:])):
        pytest.skip("autodiff trims the unread border first (tvmgraph/gradients/conv.py)")
    grad = (data[0], weight[0], *out)
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal(data), rng.standard_normal(grad)
    messages: list[str] = []
    mod = Im2colConv(messages.append)(weight_grad_module(data, grad, stride, padding, dilation))
    assert messages == ["Im2colConv: weight gradient as im2col + matmul x1"]
    cols = next(b.var for b in mod["main"].body.blocks[0].bindings
                if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir")
    assert [int(d) for d in cols.ty.shape.values] == [data[1], kh, kw, data[0], *out]
    want = torch.nn.grad.conv2d_weight(torch.from_numpy(x), weight, torch.from_numpy(dy), stride, padding, dilation)
    np.testing.assert_allclose(run(mod, x, dy), want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("channels", [(12, 5), (5, 12)], ids=["more-out-channels", "more-in-channels"])
def test_1x1_weight_gradient_is_a_matmul_per_image_reading_nchw_in_place(channels: tuple) -> None:
    """A 1x1 weight gradient (stride 1, unpadded) sums dy[n] @ x[n]^T over the images: no
    im2col and no transposed copy of dy, only views, one batched matmul (the operand with more
    channels first) and the sum; torch's dw within 1e-12."""
    f, c = channels
    data, grad = (3, c, 6, 5), (3, f, 6, 5)
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal(data), rng.standard_normal(grad)
    messages: list[str] = []
    mod = Im2colConv(messages.append)(weight_grad_module(data, grad, 1, 0, 1))
    assert messages == ["Im2colConv: 1x1 weight gradient as per-image matmuls x1"]
    ops = [b.value.op.name for b in mod["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    transposes = ["relax.permute_dims"] * (1 if f >= c else 2)
    assert sorted(ops) == sorted(["relax.reshape"] * 3 + ["relax.matmul", "relax.sum"] + transposes), ops
    matmul = next(b.value for b in mod["main"].body.blocks[0].bindings
                  if isinstance(b.value, relax.Call) and b.value.op.name == "relax.matmul")
    assert int(matmul.args[0].ty.shape[1]) == max(f, c)
    want = torch.nn.grad.conv2d_weight(torch.from_numpy(x), (f, c, 1, 1), torch.from_numpy(dy))
    np.testing.assert_allclose(run(mod, x, dy), want.numpy(), rtol=1e-12, atol=1e-12)


def test_wide_unstrided_weight_gradients_are_left_alone() -> None:
    """On images of a vector or more, stride 1, conv_gemm.py's tiles are as fast."""
    module = weight_grad_module((2, 8, 16, 16), (2, 5, 16, 16), 1, 1, 1)
    tvm.ir.assert_structural_equal(Im2colConv()(module), module)

"""Max pooling's gradient for windows that do not overlap, as one element-wise kernel.

TVM 0.27 legalizes `relax.grad.max_pool2d_backward` with TOPI's `pool_grad`: an argmax of each
window (the flat index of its first maximum), then, for every input element, a sum over the
windows that may cover it of `dy` where that window's argmax is this element. With windows that
do not overlap (stride = kernel, no padding: `nn.MaxPool1d(4)`, `nn.MaxPool2d(2)`) each element
lies in one window at most, and the sum's truncating divisions, range tests and int64 index
compares kept the kernel scalar: a raw-audio net's (16, 32, 1981) gradient ran at 7% of the
memory bandwidth. Here the window is `y // kh, x // kw` and the argmax a position in the window:

    argmax[n, c, i, j] = first (dy, dx) with the window's largest x   (TOPI's reducer: ties go to
                                                                       the first, as in torch)
    dx[n, c, y, x] = dy[n, c, y // kh, x // kw] if argmax[..] == (y % kh) * kw + x % kw else 0

(0 also past the last whole window). Any other max pooling keeps TVM's legalization.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx
from tvm.relax.transform.legalize_ops.grad import _grad_max_pool2d_backward

_LEVEL = 11  # TVM registers its legalizations at level 10


def _argmax_reducer() -> object:
    """TOPI's argmax reducer over (index, value): the larger value, on a tie the smaller index."""

    def combine(lhs, rhs):  # noqa: ANN001, ANN202  (TIR expressions)
        bigger = lhs[1] > rhs[1]
        index = tirx.Select(bigger | ((lhs[1] == rhs[1]) & (lhs[0] < rhs[0])), lhs[0], rhs[0])
        return index, tirx.Select(bigger, lhs[1], rhs[1])

    def identity(index_dtype, value_dtype):  # noqa: ANN001, ANN202
        return tirx.const(-1, index_dtype), tirx.min_value(value_dtype)

    return te.comm_reducer(combine, identity, name="argmax")


def non_overlapping_pool_grad(dy: te.Tensor, x: te.Tensor, kernel: tuple[int, int]) -> te.Tensor:
    """dx of a non-overlapping max pooling (NCHW) of `x` with `kernel`; see the module docstring."""
    kh, kw = kernel
    _, _, height, width = x.shape
    _, _, out_h, out_w = dy.shape
    dh = te.reduce_axis((0, kh), name="dh")
    dw = te.reduce_axis((0, kw), name="dw")
    argmax = _argmax_reducer()
    index, _ = te.compute(
        dy.shape,
        lambda n, c, i, j: argmax((dh * kw + dw, x[n, c, i * kh + dh, j * kw + dw]), axis=[dh, dw]),
        name="window_argmax")

    def dx(n, c, y, col):  # noqa: ANN001, ANN202  (te index variables)
        i, j = y // kh, col // kw
        window = (n, c, tirx.min(i, out_h - 1), tirx.min(j, out_w - 1))  # in bounds past the last one
        hit = tirx.all(i < out_h, j < out_w, index[window] == (y % kh) * kw + col % kw)
        return tirx.Select(hit, dy[window], tirx.const(0, dy.dtype))

    return te.compute((x.shape[0], x.shape[1], height, width), dx, name="max_pool_grad")


def _non_overlapping(call: relax.Call) -> tuple[int, int] | None:
    """The kernel of a max pooling gradient whose windows do not overlap (NCHW, stride = kernel,
    no padding, no dilation, floor mode, static window), else None."""
    attrs = call.attrs
    kernel = [int(k) for k in attrs.pool_size]
    if (str(attrs.layout) != "NCHW" or [int(s) for s in attrs.strides] != kernel
            or any(int(p) for p in attrs.padding) or any(int(d) != 1 for d in attrs.dilation)
            or bool(attrs.ceil_mode)):
        return None
    return kernel[0], kernel[1]


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    kernel = _non_overlapping(call)
    if kernel is None:
        return _grad_max_pool2d_backward(bb, call)
    dy, x = call.args
    return bb.call_te(non_overlapping_pool_grad, dy, x, kernel, primfunc_name_hint="max_pool2d_backward")


tvm.ir.register_op_attr("relax.grad.max_pool2d_backward", "FLegalize", _legalize, level=_LEVEL)

"""Gradients of the 3-D poolings TVM 0.27 lacks: avg_pool3d, max_pool3d, adaptive_avg_pool3d.

TVM has pooling-backward kernels for 2-D only. Here a pooling's adjoint is a transposed conv:
scattering a value per window back over the window's inputs is ``conv3d_transpose`` with a
kernel of ones (average), or, for max pooling, with one one-hot kernel per window offset
(channel ``k`` of the transposed conv's input carries the gradient that goes to offset ``k``).
"""

from __future__ import annotations

import itertools

import numpy as np
from tvm import relax

from ._common import dtype_of, prod, register, shape_of
from .conv import conv_data_grad
from .nn import window_matrix

op = relax.op


class _Pool3d:
    """A 3-D pooling's window: NCDHW data of shape ``(N, C, *size)``, output ``out``.

    Reshapes are emitted before use: reshape reads its input's type when a dimension is 0.
    """

    def __init__(self, orig_var: relax.Var, orig_call: relax.Call, name: str) -> None:
        attrs = orig_call.attrs
        if str(attrs.layout) != "NCDHW" or str(attrs.out_layout) != "NCDHW":
            raise NotImplementedError(
                f"gradient of relax.nn.{name} with layout {attrs.layout}: only NCDHW is supported"
            )
        if bool(attrs.ceil_mode):
            # tvmgraph's converters lower ceil mode as end padding; TVM's ceil-mode windows
            # past the padding would need their own divisors.
            raise NotImplementedError(f"gradient of relax.nn.{name} with ceil_mode=True")
        self.data = orig_call.args[0]
        self.batch, self.channels, *self.size = shape_of(self.data)
        self.out = shape_of(orig_var)[2:]
        self.kernel = [int(k) for k in attrs.pool_size]
        self.strides = [int(s) for s in attrs.strides]
        self.padding = [int(p) for p in attrs.padding]
        self.dilation = [int(d) for d in attrs.dilation]
        self.count_include_pad = bool(attrs.count_include_pad)

    def positions(self, axis: int) -> np.ndarray:
        """``[k, o]``: the input index that offset ``k`` of window ``o`` reads along ``axis``
        (negative or past the end in the padding)."""
        start = np.arange(self.out[axis]) * self.strides[axis] - self.padding[axis]
        return np.arange(self.kernel[axis])[:, None] * self.dilation[axis] + start[None, :]

    def valid(self, axis: int) -> np.ndarray:
        """``[k, o]``: whether that position is inside the input."""
        pos = self.positions(axis)
        return (pos >= 0) & (pos < self.size[axis])

    def scatter(
        self, ctx: relax.BlockBuilder, per_offset: relax.Expr, kernel: np.ndarray
    ) -> relax.Expr:
        """``dx`` from ``per_offset`` of shape ``(N * C, K, *out)`` and a transposed-conv
        kernel ``(K, 1, *kernel)``: the sum over windows and offsets of each value at the
        input position it came from."""
        grad = conv_data_grad(
            ctx.emit(per_offset), relax.const(kernel, dtype_of(self.data)),
            [self.batch * self.channels, 1, *self.size], self.strides, self.padding,
            self.dilation, 1, dtype_of(self.data),
        )
        return op.reshape(ctx.emit(grad), [self.batch, self.channels, *self.size])


@register("relax.nn.avg_pool3d")
def avg_pool3d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y[o] = sum(x[window o]) / count[o]``, NCDHW, ``count`` the window's size
    (``count_include_pad``) or its inputs inside x (a product over the axes).

    ``dx = conv3d_transpose(dy / count, ones(kd, kh, kw))`` with the pool's strides, padding
    and dilation, channel by channel.
    """
    pool = _Pool3d(orig_var, orig_call, "avg_pool3d")
    if pool.count_include_pad:
        count = np.full(pool.out, float(prod(pool.kernel)))
    else:
        counts = [np.maximum(pool.valid(axis).sum(axis=0), 1) for axis in range(3)]
        count = np.einsum("i,j,k->ijk", *counts).astype(np.float64)
    dtype = dtype_of(pool.data)
    scaled = op.multiply(output_grad, relax.const(1.0 / count, dtype))
    scaled = op.reshape(ctx.emit(scaled), [pool.batch * pool.channels, 1, *pool.out])
    return [pool.scatter(ctx, scaled, np.ones([1, 1, *pool.kernel], dtype))]


@register("relax.nn.max_pool3d")
def max_pool3d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y[o] = max(x[window o])``, NCDHW: ``dy[o]`` goes to the window's first maximum (in
    the order of the flattened window, as torch's indices).

    ``X[k, o]`` is the input at offset ``k`` of window ``o`` (strided slices of the padded x),
    ``hit = (X == y) & inside x``, the first hit is where ``cumsum(hit, k) == 1``; then
    ``dx = conv3d_transpose(dy * first, onehot)`` with ``onehot[k]`` one at offset ``k``.
    """
    pool = _Pool3d(orig_var, orig_call, "max_pool3d")
    dtype = dtype_of(pool.data)
    rows = pool.batch * pool.channels
    pads = [w for axis in range(3) for w in (pool.padding[axis], pool.padding[axis + 3])]
    padded_size = [n + sum(pads[2 * axis:2 * axis + 2]) for axis, n in enumerate(pool.size)]
    padded = ctx.emit(op.reshape(ctx.emit(op.nn.pad(pool.data, [0, 0, 0, 0, *pads])),
                                 [rows, 1, *padded_size]))
    offsets = list(itertools.product(*(range(k) for k in pool.kernel)))
    slices = []
    for offset in offsets:
        begin = [k * d for k, d in zip(offset, pool.dilation)]
        end = [b + (o - 1) * s + 1 for b, o, s in zip(begin, pool.out, pool.strides)]
        slices.append(op.strided_slice(padded, [2, 3, 4], begin, end, pool.strides))
    windows = ctx.emit(op.concat(slices, axis=1))
    inside = np.stack([
        np.einsum("i,j,k->ijk", *(pool.valid(axis)[k] for axis, k in enumerate(offset)))
        for offset in offsets
    ])
    values = ctx.emit(op.reshape(orig_var, [rows, 1, *pool.out]))
    hit = op.logical_and(op.equal(windows, values), relax.const(inside[None]))
    first = op.equal(op.cumsum(op.astype(hit, "int32"), axis=1), relax.const(1, "int32"))
    first = op.logical_and(hit, first)
    per_offset = op.multiply(op.astype(first, dtype), ctx.emit(op.reshape(output_grad, [rows, 1, *pool.out])))
    onehot = np.eye(len(offsets), dtype=dtype).reshape([len(offsets), 1, *pool.kernel])
    return [pool.scatter(ctx, per_offset, onehot)]


@register("relax.nn.adaptive_avg_pool3d")
def adaptive_avg_pool3d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = adaptive_avg_pool3d(x, (od, oh, ow))``, NCDHW: separable, as the 2-D one
    (gradients/nn.py), ``dx = dy x_D M_d x_H M_h x_W M_w`` with the window matrices ``M``
    (``o x n``), each contracting one axis."""
    attrs = orig_call.attrs
    if attrs.layout != "NCDHW" or attrs.out_layout != "NCDHW":
        raise NotImplementedError(
            f"gradient of relax.nn.adaptive_avg_pool3d with layout={attrs.layout!r}: only NCDHW "
            "is supported"
        )
    x = orig_call.args[0]
    dtype = dtype_of(x)
    batch, channels, *size = shape_of(x)
    out = shape_of(orig_var)[2:]
    grad: relax.Expr = output_grad
    for axis in range(3):  # (N, C, ..., o_axis, ...) -> (N, C, ..., n_axis, ...)
        if out[axis] == size[axis]:
            continue
        shape = [*size[:axis], out[axis], *out[axis + 1:]]
        lead, tail = prod(shape[:axis]), prod(shape[axis + 1:])
        grad = ctx.emit(op.reshape(grad, [batch * channels * lead, out[axis], tail]))
        matrix_t = relax.const(window_matrix(size[axis], out[axis]).T, dtype)
        grad = ctx.emit(op.matmul(matrix_t, grad))
        grad = ctx.emit(op.reshape(grad, [batch, channels, *size[:axis + 1], *out[axis + 1:]]))
    return [grad]

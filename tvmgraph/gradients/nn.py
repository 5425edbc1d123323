"""Gradients of the remaining nn ops: dropout, and the separable linear resamplings
adaptive_avg_pool2d and image.resize2d (``y = M_h @ x @ M_w^T``, so ``dx = M_h^T @ dy @ M_w``).
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dims_of, dtype_of, register, scalar_of, spatial_shape_of, tuple_field_grad

op = relax.op


@register("relax.nn.dropout")
def dropout_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``(y, mask) = dropout(x, rate)``:  ``dx = dy[0]``.

    TVM 0.27 legalizes ``relax.nn.dropout`` to the identity with an all-ones mask (it is an
    inference op), so the gradient of what it computes is the identity. Training-mode dropout
    is ``x * mask * scale`` with the mask a graph input, differentiated through ``multiply``.
    """
    dy = tuple_field_grad(ctx, output_grad, 0)
    x = orig_call.args[0]
    return [op.zeros(dims_of(x), dtype_of(x)) if dy is None else dy]


def window_matrix(in_size: int, out_size: int) -> np.ndarray:
    """``M[i, j] = 1 / |W_i|`` for ``j`` in adaptive window ``W_i``, else 0 (shape out x in).

    Window ``i`` spans ``[floor(i * in / out), ceil((i + 1) * in / out))``, as in torch.
    """
    matrix = np.zeros((out_size, in_size))
    for i in range(out_size):
        start = (i * in_size) // out_size
        stop = -((-(i + 1) * in_size) // out_size)
        matrix[i, start:stop] = 1.0 / (stop - start)
    return matrix


@register("relax.nn.adaptive_avg_pool2d")
def adaptive_avg_pool2d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = adaptive_avg_pool2d(x, (oh, ow))``, NCHW: the pooling is separable,
    ``y = M_h @ x @ M_w^T`` with the window matrices ``M`` (``oh x H`` and ``ow x W``).

    ``dx = M_h^T @ dy @ M_w``: every input element gets ``dy / |window|`` from each window it
    lies in (windows overlap when the size does not divide).
    """
    attrs = orig_call.attrs
    if attrs.layout != "NCHW" or attrs.out_layout != "NCHW":
        raise NotImplementedError(
            f"gradient of relax.nn.adaptive_avg_pool2d with layout={attrs.layout!r}, "
            f"out_layout={attrs.out_layout!r}: only NCHW is supported"
        )
    x = orig_call.args[0]
    dtype = dtype_of(x)
    in_h, in_w = spatial_shape_of(x)
    out_h, out_w = spatial_shape_of(orig_var)
    grad: relax.Expr = output_grad
    if (out_w, out_h) == (1, 1):
        # Global pooling, the common case: a broadcast needs no matrices.
        scale = relax.const(1.0 / (in_h * in_w), dtype)
        return [op.broadcast_to(output_grad * scale, dims_of(x))]
    if out_w != in_w:
        grad = op.matmul(grad, relax.const(window_matrix(in_w, out_w), dtype))
    if out_h != in_h:
        grad = op.matmul(relax.const(window_matrix(in_h, out_h).T, dtype), grad)
    return [grad]


#: Coordinate modes in which a 2 -> 2 resize maps every pixel onto itself (scale 1, no shift).
_IDENTITY_PRESERVING_MODES = {"half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"}


def _resize_matrix_t(
    attrs: object, in_size: int, out_size: int, axis: int, dtype: str
) -> relax.Expr:
    """``R^T`` (``in_size x out_size``) of the 1-D resize along ``axis`` (2: H, 3: W), computed
    by the forward op itself on an identity, so it matches its kernel exactly.

    The identity ``E[k, 0, k, :] = 1`` has size 2 on the other axis, resized 2 -> 2: that is
    the identity in every coordinate mode (integer source coordinates, weight 1 on themselves).
    """
    eye = np.eye(in_size)
    if axis == 2:
        basis, size = np.repeat(eye[:, None, :, None], 2, axis=3), (out_size, 2)
    else:
        basis, size = np.repeat(eye[:, None, None, :], 2, axis=2), (2, out_size)
    resized = op.image.resize2d(
        relax.const(basis, dtype),
        size,
        roi=tuple(scalar_of(v) for v in attrs.roi),
        layout="NCHW",
        method=attrs.method,
        coordinate_transformation_mode=attrs.coordinate_transformation_mode,
        rounding_method=attrs.rounding_method,
        cubic_alpha=attrs.cubic_alpha,
        cubic_exclude=attrs.cubic_exclude,
        extrapolation_value=attrs.extrapolation_value,
    )
    other = 5 - axis
    one_line = op.strided_slice(resized, [1, other], [0, 0], [1, 1])
    return op.reshape(one_line, [in_size, out_size])


@register("relax.image.resize2d")
def resize2d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = resize2d(x, (oh, ow))``, NCHW (``F.interpolate``: nearest, bilinear, bicubic).

    Resizing is linear in x and separable, ``y = R_h @ x @ R_w^T`` with ``R_h`` (``oh x H``)
    the 1-D resize along H, so ``dx = R_h^T @ dy @ R_w``. The matrices come from the op itself
    applied to an identity (see ``_resize_matrix_t``). The size argument is not differentiable.
    """
    attrs = orig_call.attrs
    mode = str(attrs.coordinate_transformation_mode)
    if attrs.layout != "NCHW" or mode not in _IDENTITY_PRESERVING_MODES:
        raise NotImplementedError(
            f"gradient of relax.image.resize2d with layout={attrs.layout!r} and "
            f"coordinate_transformation_mode={mode!r}: only NCHW with one of "
            f"{sorted(_IDENTITY_PRESERVING_MODES)} is supported"
        )
    x = orig_call.args[0]
    dtype = dtype_of(x)
    in_h, in_w = spatial_shape_of(x)
    out_h, out_w = spatial_shape_of(orig_var)
    resize_w_t = ctx.emit(_resize_matrix_t(attrs, in_w, out_w, 3, dtype))
    resize_h_t = ctx.emit(_resize_matrix_t(attrs, in_h, out_h, 2, dtype))
    grad = op.matmul(output_grad, op.permute_dims(resize_w_t, [1, 0]))
    grad = op.matmul(resize_h_t, grad)
    return [grad, grad_op.no_grad(orig_call.args[1])]

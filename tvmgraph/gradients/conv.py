"""Gradients of convolutions: conv2d (overriding TVM's, which breaks on dilation) and conv1d
(which TVM lacks), the latter as a conv2d of height 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import relax

from ._common import register, shape_of

op = relax.op


def conv2d_grads(
    data: relax.Expr,
    weight: relax.Expr,
    output_grad: relax.Expr,
    out_shape: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    out_dtype: str | None,
) -> list[relax.Expr]:
    """``[dx, dw]`` of ``y = conv2d(x, w)`` in NCHW / OIHW with ``padding`` (top, left, bottom,
    right); see :func:`conv2d_grad` for the formulas."""
    batch, out_channels, grad_h, grad_w = out_shape
    _, in_channels, in_h, in_w = shape_of(data)
    _, _, filter_h, filter_w = shape_of(weight)
    pad_top, pad_left, pad_bottom, pad_right = padding
    stride_h, stride_w = strides
    dilation_h, dilation_w = dilation

    covered_h = (grad_h - 1) * stride_h - pad_top - pad_bottom + dilation_h * (filter_h - 1) + 1
    covered_w = (grad_w - 1) * stride_w - pad_left - pad_right + dilation_w * (filter_w - 1) + 1
    data_grad = op.nn.conv2d_transpose(
        output_grad,
        weight,
        strides,
        padding,
        (in_h - covered_h, in_w - covered_w),
        dilation,
        groups,
        "NCHW",
        "IOHW",
        "NCHW",
        out_dtype,
    )

    if groups != 1:
        data = op.reshape(data, (batch, groups, in_channels // groups, in_h, in_w))
        data = op.permute_dims(data, [1, 0, 2, 3, 4])
        data = op.reshape(data, (batch * groups, in_channels // groups, in_h, in_w))
    weight_grad = op.nn.conv2d(
        data,
        output_grad,
        strides=dilation,
        padding=padding,
        dilation=strides,
        groups=groups,
        data_layout="CNHW",
        kernel_layout="IOHW",
        out_layout="CNHW",
        out_dtype=out_dtype,
    )
    full_h = (in_h - (grad_h - 1) * stride_h - 1 + pad_top + pad_bottom) // dilation_h + 1
    full_w = (in_w - (grad_w - 1) * stride_w - 1 + pad_left + pad_right) // dilation_w + 1
    if (full_h, full_w) != (filter_h, filter_w):
        end = [out_channels, in_channels // groups, filter_h, filter_w]
        weight_grad = op.strided_slice(weight_grad, [0, 1, 2, 3], [0, 0, 0, 0], end)
    return [data_grad, weight_grad]


def _check_layouts(name: str, attrs: object, expected: tuple[str, str, str]) -> None:
    """Raise NotImplementedError unless the conv's layouts are ``expected``."""
    keys = ("data_layout", "kernel_layout", "out_layout")
    layouts = tuple(str(getattr(attrs, key)) for key in keys)
    if layouts != expected:
        raise NotImplementedError(
            f"gradient of relax.nn.{name} with layouts {'/'.join(layouts)}: only "
            f"{'/'.join(expected)} is supported"
        )


@register("relax.nn.conv2d", fixes_tvm=True)
def conv2d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv2d(x, w, strides s, padding p, dilation d, groups g)``, NCHW / OIHW.

    ``dx = conv2d_transpose(dy, w, s, p, output_padding, d, g)``, where ``output_padding`` is
    the rows (columns) of x past the last window: ``H - ((oh - 1) s - p_top - p_bottom +
    d (kh - 1) + 1)``. TVM leaves out the dilation (it uses ``kh``, not ``d (kh - 1) + 1``), so
    dilated convolutions fail to build; the rest is TVM's. ``dw`` is the correlation of x with
    dy: a conv2d with strides and dilation swapped in ``CNHW``/``IOHW`` layouts (per group),
    cropped to kh x kw.
    """
    attrs = orig_call.attrs
    _check_layouts("conv2d", attrs, ("NCHW", "OIHW", "NCHW"))
    data, weight = orig_call.args
    return conv2d_grads(
        data,
        weight,
        output_grad,
        shape_of(orig_var),
        [int(s) for s in attrs.strides],
        [int(p) for p in attrs.padding],
        [int(d) for d in attrs.dilation],
        int(attrs.groups),
        attrs.out_dtype,
    )


@register("relax.nn.conv1d")
def conv1d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv1d(x, w, s, (p_left, p_right), d, g)``, NCW / OIW: the conv2d gradients of
    ``x`` as ``[N, C, 1, L]`` and ``w`` as ``[O, I, 1, K]`` (strides ``(1, s)``, padding
    ``(0, p_left, 0, p_right)``, dilation ``(1, d)``), reshaped back."""
    attrs = orig_call.attrs
    _check_layouts("conv1d", attrs, ("NCW", "OIW", "NCW"))
    data, weight = orig_call.args
    batch, channels, length = shape_of(data)
    out_channels, in_per_group, kernel = shape_of(weight)
    out_batch, out_ch, out_length = shape_of(orig_var)
    pad_left, pad_right = (int(p) for p in attrs.padding)
    data_grad, weight_grad = conv2d_grads(
        ctx.emit(op.reshape(data, [batch, channels, 1, length])),
        ctx.emit(op.reshape(weight, [out_channels, in_per_group, 1, kernel])),
        ctx.emit(op.reshape(output_grad, [out_batch, out_ch, 1, out_length])),
        [out_batch, out_ch, 1, out_length],
        [1, int(attrs.strides[0])],
        [0, pad_left, 0, pad_right],
        [1, int(attrs.dilation[0])],
        int(attrs.groups),
        attrs.out_dtype,
    )
    return [
        op.reshape(data_grad, shape_of(data)),
        op.reshape(weight_grad, shape_of(weight)),
    ]

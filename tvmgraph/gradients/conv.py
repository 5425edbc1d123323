"""Gradients of convolutions, plain and transposed, 1-D to 3-D: conv2d (overriding TVM's, which
breaks on dilation), conv3d and the transposed convs (which TVM lacks). 1-D ops are the 2-D ones
at height 1.

A convolution is linear in x and in w, and a transposed convolution is the adjoint in x of the
convolution with the same attributes; so each one's dx is the other op applied to dy, and both
share one dw: the correlation of the convolution's input with its output's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import relax

from ._common import dims_of, dtype_of, prod, register, shape_of

op = relax.op

#: rank -> (data, conv kernel, transposed-conv kernel, channels-first data) layouts.
_LAYOUTS = {2: ("NCHW", "OIHW", "IOHW", "CNHW"), 3: ("NCDHW", "OIDHW", "IODHW", "CNDHW")}
_CONV = {2: op.nn.conv2d, 3: op.nn.conv3d}
_CONV_TRANSPOSE = {2: op.nn.conv2d_transpose, 3: op.nn.conv3d_transpose}


def _crop(expr: relax.Expr, full: Sequence[int], shape: Sequence[int]) -> relax.Expr:
    """``expr`` (of spatial size ``full``) cut to ``shape[0] x shape[1] x ...``."""
    if list(full) == list(shape[2:]):
        return expr
    axes = list(range(len(shape)))
    return op.strided_slice(expr, axes, [0] * len(shape), list(shape))


def conv_data_grad(
    output_grad: relax.Expr,
    weight: relax.Expr,
    data_shape: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    out_dtype: str | None,
) -> relax.Expr:
    """dx of ``y = conv(x, w)`` (NC... / OI..., padding begins then ends): the transposed conv
    of dy, its ``output_padding`` the rows of x past the last window; for a dilated conv of
    stride 1, a conv of dy with the flipped kernel (`flipped_kernel_data_grad`)."""
    flipped = flipped_kernel_data_grad(output_grad, weight, strides, padding, dilation, groups, out_dtype)
    if flipped is not None:
        return flipped
    rank = len(strides)
    data_layout, _, transposed_kernel, _ = _LAYOUTS[rank]
    kernel = dims_of(weight)[2:]
    grad = dims_of(output_grad)[2:]
    covered = [
        (g - 1) * s - pb - pe + d * (k - 1) + 1
        for g, s, pb, pe, d, k in zip(grad, strides, padding[:rank], padding[rank:], dilation, kernel)
    ]
    output_padding = [n - c for n, c in zip(data_shape[2:], covered)]
    return _CONV_TRANSPOSE[rank](
        output_grad, weight, strides, padding, output_padding, dilation, groups,
        data_layout, transposed_kernel, data_layout, out_dtype,
    )


def flipped_kernel_data_grad(
    output_grad: relax.Expr,
    weight: relax.Expr,
    strides: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    out_dtype: str | None,
) -> relax.Expr | None:
    """dx of a dilated conv with stride 1 as a conv of dy, dilated the same, with the kernel
    flipped and its in and out channels swapped per group, padded ``d (k - 1) - p`` at each
    end (x's own size, as the transposed conv gives it). None for another conv (a stride, no
    dilation, padding past the dilated kernel, a symbolic kernel or channel count).

    TOPI's transposed conv dilates the kernel with zeros and multiplies them: the input gradient
    of a dilated conv1d (k = 3, d = 8) did (d (k - 1) + 1) / k = 5.7 times the work; a temporal
    conv net's training step spent 43% of its time in such gradients (2026-12-05). As a conv,
    only the kernel's taps are multiplied. 2-D convs (a conv1d's at height 1) only."""
    rank = len(strides)
    kernel = dims_of(weight)
    if any(s != 1 for s in strides) or all(d == 1 for d in dilation) or rank != 2:
        return None
    if not all(isinstance(k, int) for k in kernel):
        return None
    reach = [d * (k - 1) for d, k in zip(dilation, kernel[2:])]
    new_padding = [r - p for r, p in zip(reach * 2, padding)]
    if any(p < 0 for p in new_padding):
        return None
    out_channels, in_per_group, spatial = kernel[0], kernel[1], kernel[2:]
    flipped = weight
    for axis in range(2, 2 + len(spatial)):
        flipped = op.flip(flipped, axis)
    # [O, I/g, k...] -> [g, O/g, I/g, k...] -> [g, I/g, O/g, k...] -> [I, O/g, k...]
    grouped = op.reshape(flipped, [groups, out_channels // groups, in_per_group, *spatial])
    axes = [0, 2, 1, *range(3, 3 + len(spatial))]
    swapped = op.reshape(op.permute_dims(grouped, axes), [groups * in_per_group, out_channels // groups, *spatial])
    if dims_of(output_grad)[2] == 1 and spatial[0] == 1:
        # A conv1d's (dy and kernel of height 1, so no padding along it): as a conv1d, which
        # DirectConv1d computes (relay_passes/direct_conv1d.py).
        dx = op.nn.conv1d(op.squeeze(output_grad, [2]), op.squeeze(swapped, [2]), 1,
                          [new_padding[1], new_padding[3]], dilation[1], groups, "NCW", "OIW", "NCW", out_dtype)
        return op.expand_dims(dx, 2)
    return _CONV[rank](output_grad, swapped, [1] * rank, new_padding, dilation, groups,
                       _LAYOUTS[rank][0], _LAYOUTS[rank][1], _LAYOUTS[rank][0], out_dtype)


def conv_transpose_data_grad(
    output_grad: relax.Expr,
    weight: relax.Expr,
    data_shape: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    out_dtype: str | None,
) -> relax.Expr:
    """dx of ``y = conv_transpose(x, w)`` (NC... / IO...): the conv of dy with the same w read
    as O I..., cropped to x (larger only when ``output_padding >= stride``)."""
    rank = len(strides)
    data_layout, kernel_layout, _, _ = _LAYOUTS[rank]
    grad = _CONV[rank](
        output_grad, weight, strides, padding, dilation, groups,
        data_layout, kernel_layout, data_layout, out_dtype,
    )
    kernel = dims_of(weight)[2:]
    full = [
        (n + pb + pe - d * (k - 1) - 1) // s + 1
        for n, pb, pe, d, k, s in zip(dims_of(output_grad)[2:], padding[:rank], padding[rank:],
                                      dilation, kernel, strides)
    ]
    return _crop(grad, full, data_shape)


def conv_weight_grad(
    data: relax.Expr,
    output_grad: relax.Expr,
    weight_shape: Sequence[int],
    strides: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    out_dtype: str | None,
) -> relax.Expr:
    """dw of ``y = conv(x, w)``, w of shape ``(O, C / groups, k...)``: the correlation of x with
    dy, a conv with strides and dilation swapped in channels-first layouts (per group: the
    batch becomes the channels), cropped to k... (the windows' tail past the last stride)."""
    rank = len(strides)
    _, _, transposed_kernel, channels_first = _LAYOUTS[rank]
    batch, channels, *size = dims_of(data)
    grad_size = dims_of(output_grad)[2:]
    data, size, strides = _strided_taps_only(data, size, grad_size, weight_shape[2:], strides, padding)
    data, size, padding = _window_only(data, size, grad_size, weight_shape[2:], strides, padding, dilation)
    if groups != 1:
        data = op.reshape(data, (batch, groups, channels // groups, *size))
        data = op.permute_dims(data, [1, 0, *range(2, rank + 3)])
        data = op.reshape(data, (batch * groups, channels // groups, *size))
    grad = _CONV[rank](
        data, output_grad, dilation, padding, strides, groups,
        channels_first, transposed_kernel, channels_first, out_dtype,
    )
    full = [
        (n + pb + pe - (g - 1) * s - 1) // d + 1
        for n, pb, pe, g, s, d in zip(size, padding[:rank], padding[rank:], grad_size, strides, dilation)
    ]
    return _crop(grad, full, weight_shape)


def _strided_taps_only(
    data: relax.Expr, size: Sequence[int], grad_size: Sequence[int], kernel: Sequence[int],
    strides: Sequence[int], padding: Sequence[int],
) -> tuple[relax.Expr, list[int], list[int]]:
    """A strided 1x1 kernel without padding reads every s-th pixel: those pixels first (one
    strided copy), then dw's conv runs without dilation. As a conv dilated by the stride it ran
    on the whole image at 9-18% of the FMA peak (ResNet-18's shortcuts: 3.4 ms, now 0.5)."""
    rank = len(strides)
    if any(k != 1 for k in kernel) or all(s == 1 for s in strides) or any(padding) \
            or not all(isinstance(g, int) for g in grad_size):
        return data, list(size), list(strides)
    end = [(g - 1) * s + 1 for g, s in zip(grad_size, strides)]
    taps = op.strided_slice(data, list(range(2, 2 + rank)), [0] * rank, end, list(strides))
    return taps, list(grad_size), [1] * rank


def _window_only(
    data: relax.Expr, size: Sequence[int], grad_size: Sequence[int], kernel: Sequence[int],
    strides: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
) -> tuple[relax.Expr, list[int], list[int]]:
    """The data and padding of dw's conv trimmed at the end of each spatial axis to what the
    kernel's offsets read: that conv's window is then the kernel, with no crop after it. Untrimmed,
    a 3x3 kernel with stride 2 computed 16 offsets to keep 9, and a 1x1 one 4 to keep 1.
    The end padding goes first, then data past the last tap (a stride that does not divide)."""
    rank = len(size)
    if not all(isinstance(v, int) for v in (*size, *grad_size)):
        return data, list(size), list(padding)
    padding, crop = list(padding), list(size)
    for i, (n, k, g, s, d) in enumerate(zip(size, kernel, grad_size, strides, dilation)):
        read = (k - 1) * d + (g - 1) * s + 1  # the last tap of the last kernel offset, plus one
        excess = n + padding[i] + padding[rank + i] - read
        removed = max(0, min(excess, padding[rank + i]))
        padding[rank + i] -= removed
        crop[i] = n - max(0, excess - removed)
    if crop != list(size):
        data = op.strided_slice(data, list(range(2, 2 + rank)), [0] * rank, crop)
    return data, crop, padding


def _check_layouts(name: str, attrs: object, expected: tuple[str, str, str]) -> None:
    """Raise NotImplementedError unless the conv's layouts are ``expected``."""
    keys = ("data_layout", "kernel_layout", "out_layout")
    layouts = tuple(str(getattr(attrs, key)) for key in keys)
    if layouts != expected:
        raise NotImplementedError(
            f"gradient of relax.nn.{name} with layouts {'/'.join(layouts)}: only "
            f"{'/'.join(expected)} is supported"
        )


class _Window:
    """A (transposed) conv's strides, padding, dilation, groups and out_dtype; from a 1-D conv's
    attributes, those of the 2-D conv at height 1 (``unsqueeze`` then adds that height)."""

    def __init__(self, attrs: object) -> None:
        self.strides = [int(s) for s in attrs.strides]
        self.padding = [int(p) for p in attrs.padding]
        self.dilation = [int(d) for d in attrs.dilation]
        self.groups = int(attrs.groups)
        self.out_dtype = attrs.out_dtype
        self.is_1d = len(self.strides) == 1
        if self.is_1d:
            self.strides, self.dilation = [1, *self.strides], [1, *self.dilation]
            self.padding = [0, self.padding[0], 0, self.padding[1]]

    def args(self) -> tuple:
        return self.strides, self.padding, self.dilation, self.groups, self.out_dtype

    def unsqueeze(self, ctx: relax.BlockBuilder, expr: relax.Expr) -> relax.Expr:
        return ctx.emit(op.expand_dims(expr, 2)) if self.is_1d else expr

    def squeeze(self, grads: list[relax.Expr]) -> list[relax.Expr]:
        return [op.squeeze(g, [2]) for g in grads] if self.is_1d else grads


def _empty(orig_call: relax.Call) -> bool:
    """Whether x has no elements (an empty batch): its reshapes would read 0 as "keep"."""
    return any(d == 0 for d in dims_of(orig_call.args[0]) if isinstance(d, int))  # a symbolic batch is >= 1


def _zeros(orig_call: relax.Call) -> list[relax.Expr]:
    return [op.zeros(dims_of(arg), dtype_of(arg)) for arg in orig_call.args]


def _conv_grads(
    orig_call: relax.Call, output_grad: relax.Expr, ctx: relax.BlockBuilder, name: str
) -> list[relax.Expr]:
    """``[dx, dw]`` of ``relax.nn.conv{1,2,3}d`` (``name``)."""
    attrs = orig_call.attrs
    _check_layouts(name, attrs, _CANONICAL[name])
    if _empty(orig_call):
        return _zeros(orig_call)
    window = _Window(attrs)
    data, weight, output_grad = (window.unsqueeze(ctx, e) for e in (*orig_call.args, output_grad))
    return window.squeeze([
        conv_data_grad(output_grad, weight, dims_of(data), *window.args()),
        conv_weight_grad(data, output_grad, dims_of(weight), *window.args()),
    ])


def _conv_transpose_grads(
    orig_call: relax.Call, output_grad: relax.Expr, ctx: relax.BlockBuilder, name: str
) -> list[relax.Expr]:
    """``[dx, dw]`` of ``relax.nn.conv{1,2,3}d_transpose`` (``name``): ``y`` is the input of
    the conv whose output is ``x``, so dw is that conv's, with dy as its input."""
    attrs = orig_call.attrs
    _check_layouts(name, attrs, _CANONICAL[name])
    if _empty(orig_call):
        return _zeros(orig_call)
    window = _Window(attrs)
    data, weight, output_grad = (window.unsqueeze(ctx, e) for e in (*orig_call.args, output_grad))
    return window.squeeze([
        conv_transpose_data_grad(output_grad, weight, dims_of(data), *window.args()),
        conv_weight_grad(output_grad, data, dims_of(weight), *window.args()),
    ])


_CANONICAL = {
    "conv1d": ("NCW", "OIW", "NCW"),
    "conv2d": ("NCHW", "OIHW", "NCHW"),
    "conv3d": ("NCDHW", "OIDHW", "NCDHW"),
    "conv1d_transpose": ("NCW", "IOW", "NCW"),
    "conv2d_transpose": ("NCHW", "IOHW", "NCHW"),
    "conv3d_transpose": ("NCDHW", "IODHW", "NCDHW"),
}


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
    return _conv_grads(orig_call, output_grad, ctx, "conv2d")


@register("relax.nn.conv1d")
def conv1d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv1d(x, w, s, (p_left, p_right), d, g)``, NCW / OIW: the conv2d gradients of
    ``x`` as ``[N, C, 1, L]`` and ``w`` as ``[O, I, 1, K]`` (strides ``(1, s)``, padding
    ``(0, p_left, 0, p_right)``, dilation ``(1, d)``), squeezed back."""
    return _conv_grads(orig_call, output_grad, ctx, "conv1d")


@register("relax.nn.conv3d")
def conv3d_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv3d(x, w)``, NCDHW / OIDHW: conv2d's formulas with one more spatial axis
    (``dx`` a ``conv3d_transpose``, ``dw`` a conv3d in ``CNDHW``/``IODHW``)."""
    return _conv_grads(orig_call, output_grad, ctx, "conv3d")


@register("relax.nn.conv1d_transpose")
def conv1d_transpose_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv1d_transpose(x, w)``, NCW / IOW: conv2d_transpose's gradients at height 1."""
    return _conv_transpose_grads(orig_call, output_grad, ctx, "conv1d_transpose")


@register("relax.nn.conv2d_transpose")
def conv2d_transpose_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv2d_transpose(x, w, s, p, output_padding, d, g)``, NCHW / IOHW.

    It is the adjoint in x of ``conv2d(., w, s, p, d, g)`` (w read as OIHW), so
    ``dx = conv2d(dy, w, s, p, d, g)``, cropped to x (larger only when ``output_padding >= s``).
    ``dw[i, o]`` correlates ``x[:, i]`` with ``dy[:, o]`` as the conv's dw correlates its input
    with its output's gradient: ``dw = conv2d`` of dy (as the input) with x (as the output's
    gradient), strides and dilation swapped, cropped to kh x kw (``output_padding`` rows).
    """
    return _conv_transpose_grads(orig_call, output_grad, ctx, "conv2d_transpose")


@register("relax.nn.conv3d_transpose")
def conv3d_transpose_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = conv3d_transpose(x, w)``, NCDHW / IODHW: conv2d_transpose's formulas in 3-D."""
    return _conv_transpose_grads(orig_call, output_grad, ctx, "conv3d_transpose")

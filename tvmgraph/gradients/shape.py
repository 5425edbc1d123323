"""Gradients of data-movement ops: squeeze, flatten, strided_slice, stack, flip, tile, repeat, pad.

Each gradient moves the output gradient back to where the input element came from; elements
the forward dropped (a slice's gaps, a pad's border) get zero, and copies (tile, repeat) sum.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dims_of, dtype_of, prod, register, scalar_of, shape_of

op = relax.op


@register("relax.squeeze")
def squeeze_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = squeeze(x, axis)``:  ``dx = reshape(dy, x.shape)``."""
    return [op.reshape(output_grad, dims_of(orig_call.args[0]))]


@register("relax.flatten")
def flatten_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = flatten(x)``:  ``dx = reshape(dy, x.shape)``."""
    return [op.reshape(output_grad, dims_of(orig_call.args[0]))]


@register("relax.flip")
def flip_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = flip(x, axis)``:  ``dx = flip(dy, axis)``."""
    return [op.flip(output_grad, int(orig_call.attrs.axis))]


@register("relax.strided_slice")
def strided_slice_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = strided_slice(x, axes, begin, end, strides)``, positive strides only.

    Along each sliced axis ``a`` (size ``d``, start ``b`` clamped into ``[0, d]``, stride ``s``,
    ``n = y.shape[a]`` elements taken): ``dx[b + i*s] = dy[i]`` for ``i < n`` and 0 elsewhere.
    Built one axis at a time: a zero padding of dy for stride 1, a ``slice_scatter`` into zeros
    otherwise; axes, begin, end and strides are not differentiable.
    """
    x, axes, begin = orig_call.args[:3]
    strides = orig_call.args[4] if len(orig_call.args) > 4 else None
    x_shape = dims_of(x)  # a dynamic batch stays symbolic where it is not sliced
    grad: relax.Expr = output_grad
    grad_shape = dims_of(orig_var)
    for i, axis_value in enumerate(axes.fields):
        axis = int(scalar_of(axis_value)) % len(x_shape)
        dim, taken = x_shape[axis], grad_shape[axis]
        if not (isinstance(dim, int) and isinstance(taken, int)):
            shape_of(x)  # slicing the dynamic batch itself: not covered
        step = int(scalar_of(strides.fields[i])) if strides is not None else 1
        if step <= 0:
            raise NotImplementedError(
                f"gradient of relax.strided_slice with stride {step} on axis {axis}: only "
                "positive strides are supported (torch slicing never produces others)"
            )
        start = int(scalar_of(begin.fields[i]))
        start = min(max(start + dim if start < 0 else start, 0), dim)
        if taken == dim:
            continue
        if step == 1 and taken:
            # A contiguous slice: dy padded with zeros, one kernel. (slice_scatter into zeros
            # is two, and its legalization warns about unchecked indices on every compile.)
            widths = [0] * (2 * len(x_shape))
            widths[2 * axis], widths[2 * axis + 1] = start, dim - start - taken
            grad = op.nn.pad(grad, widths)
            grad_shape[axis] = dim
            continue
        grad_shape[axis] = dim
        zeros = op.zeros(list(grad_shape), dtype_of(x))
        stop = start + (taken - 1) * step + 1 if taken else start
        grad = op.slice_scatter(zeros, grad, start, stop, step, axis=axis)
    no_grads = [grad_op.no_grad(arg) for arg in orig_call.args[1:]]
    return [grad, *no_grads]


@register("relax.stack")
def stack_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = stack((x_0, ..., x_{k-1}), axis)``:
    ``dx_i = squeeze(split(dy, k, axis)[i], axis)``."""
    axis = int(orig_call.attrs.axis) % len(dims_of(orig_var))
    count = len(orig_call.args[0].ty.fields)
    parts = ctx.emit(op.split(output_grad, count, axis))
    return [relax.Tuple([op.squeeze(relax.TupleGetItem(parts, i), [axis]) for i in range(count)])]


@register("relax.tile")
def tile_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = tile(x, reps)``: ``y.shape[i] = r_i * d_i`` (x and reps padded with leading 1s).

    ``dx = sum(reshape(dy, [r_0, d_0, r_1, d_1, ...]), axes=[0, 2, ...])``, reshaped to x.
    """
    x = orig_call.args[0]
    x_shape = shape_of(x)
    reps = [int(r) for r in orig_call.attrs.repeats]
    ndim = max(len(x_shape), len(reps))
    dims = [1] * (ndim - len(x_shape)) + x_shape
    reps = [1] * (ndim - len(reps)) + reps
    split_shape = [size for pair in zip(reps, dims) for size in pair]
    grad = op.sum(op.reshape(output_grad, split_shape), list(range(0, 2 * ndim, 2)))
    return [op.reshape(grad, x_shape)]


@register("relax.repeat")
def repeat_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = repeat(x, r, axis)`` (each element r times in a row, like ``repeat_interleave``).

    ``dx = sum(reshape(dy, [..., d_axis, r, ...]), axis + 1)``; with ``axis=None`` x is
    flattened first, so ``dx = reshape(sum(reshape(dy, [x.size, r]), 1), x.shape)``.
    """
    x = orig_call.args[0]
    x_shape = shape_of(x)
    reps = int(orig_call.attrs.repeats)
    if orig_call.attrs.axis is None:
        grad = op.sum(op.reshape(output_grad, [prod(x_shape), reps]), [1])
        return [op.reshape(grad, x_shape)]
    axis = int(orig_call.attrs.axis) % len(x_shape)
    split_shape = x_shape[: axis + 1] + [reps] + x_shape[axis + 1 :]
    return [op.sum(op.reshape(output_grad, split_shape), [axis + 1])]


@register("relax.nn.pad")
def pad_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = pad(x, [before_0, after_0, ...], "constant")``.

    ``dx = dy[before_0 : before_0 + d_0, ...]``: the border holds the constant, which does not
    depend on x. A negative width crops x (`F.pad(x, (2, -1))`): those elements of x reach no
    output, so their gradient is zero, padded back on after the slice.
    """
    attrs = orig_call.attrs
    widths = [int(w) for w in attrs.pad_width]
    if attrs.pad_mode != "constant":
        raise NotImplementedError(
            f"gradient of relax.nn.pad with pad_mode={attrs.pad_mode!r} and pad_width={widths}: "
            "only constant padding is supported"
        )
    x = orig_call.args[0]
    dims = dims_of(x)
    added = [max(w, 0) for w in widths]
    cropped = [max(-w, 0) for w in widths]
    # Only the padded axes are sliced: an unpadded one may be symbolic (a dynamic batch).
    axes = [a for a in range(len(dims)) if widths[2 * a] or widths[2 * a + 1]]
    if any(not isinstance(dims[a], int) for a in axes):
        shape_of(x)  # raises: a padded symbolic axis
    begin = [added[2 * a] for a in axes]
    end = [added[2 * a] + dims[a] - cropped[2 * a] - cropped[2 * a + 1] for a in axes]
    grad = op.strided_slice(output_grad, axes, begin, end) if axes else output_grad
    if any(cropped):
        grad = op.nn.pad(grad, cropped, "constant", 0.0)
    return [grad, *(grad_op.no_grad(arg) for arg in orig_call.args[1:])]

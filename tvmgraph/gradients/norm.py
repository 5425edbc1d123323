"""Gradients of the normalizations: batch_norm (training and inference), layer_norm,
instance_norm, group_norm, rms_norm.

Shared notation: over the normalized axes ``A`` (``n`` elements), ``mu = mean(x)``,
``inv = 1 / sqrt(var(x) + eps)`` (biased variance), ``xh = (x - mu) * inv`` and
``y = gamma * xh + beta``. With ``gh = dy * gamma`` (the gradient w.r.t. ``xh``),

    dx = inv * (gh - mean_A(gh) - xh * mean_A(gh * xh))
    dgamma = sum(dy * xh),  dbeta = sum(dy)      (summed over the axes gamma is broadcast on)

The statistics are recomputed in the backward pass (the forward ops do not expose them).
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import relax
from tvm.relax.op import grad as grad_op

from .batch_norm_backward import batch_norm_backward
from ._common import const, dims_of, normalize_axes, prod, register, shape_of, sum_to_shape
from ._common import tuple_field_grad

op = relax.op


def _statistics(x: relax.Expr, axes: Sequence[int]) -> tuple[relax.Expr, relax.Expr]:
    """``(x - mean_A(x), var_A(x))``, the centered input and its biased variance."""
    centered = x - op.mean(x, list(axes), keepdims=True)
    return centered, op.mean(centered * centered, list(axes), keepdims=True)


def _normalized_input_grad(
    g_hat: relax.Expr, x_hat: relax.Expr, inv_std: relax.Expr, axes: Sequence[int]
) -> relax.Expr:
    """``inv * (gh - mean_A(gh) - xh * mean_A(gh * xh))``, the input gradient of a normalization."""
    axes = list(axes)
    mean_g = op.mean(g_hat, axes, keepdims=True)
    mean_gx = op.mean(g_hat * x_hat, axes, keepdims=True)
    return inv_std * (g_hat - mean_g - x_hat * mean_gx)


@register("relax.nn.batch_norm")
def batch_norm_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``(y, new_mean, new_var) = batch_norm(x, gamma, beta, mean, var, axis, training)``.

    ``A`` is every axis but ``axis`` (the channel), ``n`` its element count, ``m`` the momentum.

    * training: mu and var are the batch statistics, so ``dx`` is the general formula above,
      computed with dgamma and dbeta by one kernel (batch_norm_backward.py) unless the running
      statistics reach the loss;
      the running-stat outputs ``new_mean = (1-m) mean + m mu`` and
      ``new_var = (1-m) var + m var_b`` add ``m/n * d(new_mean)`` and
      ``2m/n * (x - mu) * d(new_var)`` to ``dx``, and ``(1-m)`` times their gradients to the
      running ``mean`` and ``var`` inputs.
    * inference: mu and var are the running inputs, so ``dx = gh * inv``,
      ``dmean = -sum_A(gh * inv)``, ``dvar = -1/2 sum_A(gh * (x - mean) * inv^3)``, and the
      outputs ``new_mean = mean``, ``new_var = var`` pass their gradients through.

    ``Gradient`` passes the adjoint of the whole tuple; fields that are zeros by construction
    (the usual case: only ``y`` feeds the loss) are skipped rather than multiplied out.
    """
    x, gamma, beta, moving_mean, moving_var = orig_call.args
    attrs = orig_call.attrs
    x_shape = dims_of(x)  # a dynamic batch stays symbolic
    axis = int(attrs.axis) % len(x_shape)
    axes = [i for i in range(len(x_shape)) if i != axis]
    channel_shape = [1] * len(x_shape)
    channel_shape[axis] = x_shape[axis]
    momentum = float(attrs.momentum)
    dy = tuple_field_grad(ctx, output_grad, 0)
    d_new_mean = tuple_field_grad(ctx, output_grad, 1)
    d_new_var = tuple_field_grad(ctx, output_grad, 2)

    if attrs.training and dy is not None and d_new_mean is None and d_new_var is None:
        # The usual case (only y feeds the loss): one kernel (batch_norm_backward.py).
        grads = ctx.emit_te(batch_norm_backward, x, dy, gamma if attrs.scale else None, axis,
                            float(attrs.epsilon), primfunc_name_hint="batch_norm_backward")
        dx, dgamma, dbeta = (relax.TupleGetItem(grads, i) for i in range(3))
        return [dx, dgamma if attrs.scale else grad_op.no_grad(gamma),
                dbeta if attrs.center else grad_op.no_grad(beta),
                grad_op.no_grad(moving_mean), grad_op.no_grad(moving_var)]
    if attrs.training:
        centered, var = _statistics(x, axes)
    else:
        centered = x - op.reshape(moving_mean, channel_shape)
        var = op.reshape(moving_var, channel_shape)
    inv_std = ctx.emit(op.rsqrt(var + const(float(attrs.epsilon), x)))
    x_hat = ctx.emit(centered * inv_std)

    partials: list[relax.Expr | None] = [None] * 5
    mean_grad: relax.Expr | None = None
    var_grad: relax.Expr | None = None
    if dy is not None:
        g_hat = dy * op.reshape(gamma, channel_shape) if attrs.scale else dy
        if attrs.training:
            partials[0] = _normalized_input_grad(g_hat, x_hat, inv_std, axes)
        else:
            partials[0] = g_hat * inv_std
            mean_grad = -op.sum(g_hat * inv_std, axes)
            var_grad = const(-0.5, x) * op.sum(g_hat * x_hat * inv_std * inv_std, axes)
        if attrs.scale:
            partials[1] = op.sum(dy * x_hat, axes)
        if attrs.center:
            partials[2] = op.sum(dy, axes)

    if attrs.training:
        count = prod(x_shape[i] for i in axes)
        if not isinstance(count, int) and (d_new_mean is not None or d_new_var is not None):
            shape_of(x)  # a loss of the running statistics over a dynamic batch: not covered
        keep = const(1.0 - momentum, x)
        if d_new_mean is not None:
            shift = const(momentum / count, x) * op.reshape(d_new_mean, channel_shape)
            partials[0] = shift if partials[0] is None else partials[0] + shift
            mean_grad = keep * d_new_mean
        if d_new_var is not None:
            spread = const(2.0 * momentum / count, x) * op.reshape(d_new_var, channel_shape)
            spread = spread * centered
            partials[0] = spread if partials[0] is None else partials[0] + spread
            var_grad = keep * d_new_var
    else:
        if d_new_mean is not None:
            mean_grad = d_new_mean if mean_grad is None else mean_grad + d_new_mean
        if d_new_var is not None:
            var_grad = d_new_var if var_grad is None else var_grad + d_new_var
    partials[3], partials[4] = mean_grad, var_grad
    return [
        grad_op.no_grad(arg) if partial is None else partial
        for arg, partial in zip(orig_call.args, partials)
    ]


def _affine_norm_grads(
    ctx: relax.BlockBuilder,
    call: relax.Call,
    x: relax.Expr,
    dy: relax.Expr,
    axes: list[int],
    param_axes: list[int],
) -> list[relax.Expr]:
    """``[dx, dgamma, dbeta]`` of ``y = gamma * xh + beta`` normalized over ``axes`` of x.

    gamma and beta span x's ``param_axes`` (broadcast over the others, where they are summed)
    and are reshaped back to their own shapes; ``call`` supplies them and eps/scale/center.
    """
    _, gamma, beta = call.args
    attrs = call.attrs
    x_shape = dims_of(x)
    param_shape = [x_shape[i] if i in param_axes else 1 for i in range(len(x_shape))]
    others = [i for i in range(len(x_shape)) if i not in param_axes]
    centered, var = _statistics(x, axes)
    inv_std = ctx.emit(op.rsqrt(var + const(float(attrs.epsilon), x)))
    x_hat = ctx.emit(centered * inv_std)
    g_hat = dy * op.reshape(gamma, param_shape) if attrs.scale else dy
    gamma_grad = sum_to_shape(dy * x_hat, others, shape_of(gamma))
    beta_grad = sum_to_shape(dy, others, shape_of(beta))
    return [
        _normalized_input_grad(g_hat, x_hat, inv_std, axes),
        gamma_grad if attrs.scale else grad_op.no_grad(gamma),
        beta_grad if attrs.center else grad_op.no_grad(beta),
    ]


@register("relax.nn.layer_norm")
def layer_norm_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = layer_norm(x, gamma, beta, axes)``: the general formula with ``A = axes``.

    gamma and beta have the shape of x's normalized axes, so they are summed over the others.
    """
    x = orig_call.args[0]
    axes = normalize_axes(orig_call.attrs.axes, len(dims_of(x)))
    return _affine_norm_grads(ctx, orig_call, x, output_grad, axes, axes)


@register("relax.nn.instance_norm")
def instance_norm_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = instance_norm(x, gamma, beta, channel_axis, axes)``: the general formula with
    ``A = axes`` (each sample and channel on its own); gamma and beta are per channel."""
    x = orig_call.args[0]
    ndim = len(dims_of(x))
    axes = normalize_axes(orig_call.attrs.axes, ndim)
    channel_axis = int(orig_call.attrs.channel_axis) % ndim
    return _affine_norm_grads(ctx, orig_call, x, output_grad, axes, [channel_axis])


@register("relax.nn.group_norm")
def group_norm_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = group_norm(x, gamma, beta, G, channel_axis=1, axes=[2, ...])`` (torch's layout).

    With x viewed as ``[N, G, C/G, *S]`` the general formula applies with ``A = [2, 3, ...]``;
    gamma and beta are per channel (axes 1 and 2 of that view), summed over N and ``S``.
    """
    x = orig_call.args[0]
    attrs = orig_call.attrs
    x_shape = dims_of(x)
    ndim = len(x_shape)
    groups = int(attrs.num_groups)
    axes = normalize_axes(attrs.axes, ndim)
    if int(attrs.channel_axis) % ndim != 1 or axes != list(range(2, ndim)):
        raise NotImplementedError(
            f"gradient of relax.nn.group_norm with channel_axis={attrs.channel_axis} and "
            f"axes={list(attrs.axes)}: only channel_axis=1 with all later axes is supported"
        )
    batch, channels, spatial = x_shape[0], x_shape[1], x_shape[2:]
    grouped_shape = [batch, groups, channels // groups, *spatial]
    grouped = op.reshape(x, grouped_shape)
    dy = op.reshape(output_grad, grouped_shape)
    x_grad, gamma_grad, beta_grad = _affine_norm_grads(
        ctx, orig_call, ctx.emit(grouped), dy, list(range(2, ndim + 1)), [1, 2]
    )
    return [op.reshape(x_grad, x_shape), gamma_grad, beta_grad]


@register("relax.nn.rms_norm")
def rms_norm_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x * r * w`` with ``r = 1 / sqrt(mean_A(x^2) + eps)``.

    ``dx = r * gw - x * r^3 * mean_A(gw * x)`` with ``gw = dy * w``;
    ``dw = sum(dy * x * r)`` over the axes w is broadcast on.
    """
    x, weight = orig_call.args
    attrs = orig_call.attrs
    x_shape = dims_of(x)
    axes = normalize_axes(attrs.axes, len(x_shape))
    others = [i for i in range(len(x_shape)) if i not in axes]
    param_shape = [x_shape[i] if i in axes else 1 for i in range(len(x_shape))]

    mean_square = op.mean(x * x, axes, keepdims=True)
    inv_rms = ctx.emit(op.rsqrt(mean_square + const(float(attrs.epsilon), x)))
    g_w = output_grad * op.reshape(weight, param_shape)
    inv_rms_cubed = inv_rms * inv_rms * inv_rms
    x_grad = inv_rms * g_w - x * inv_rms_cubed * op.mean(g_w * x, axes, keepdims=True)
    return [x_grad, sum_to_shape(output_grad * x * inv_rms, others, shape_of(weight))]

"""Gradients of activations: gelu, gelu_tanh, leakyrelu, prelu, softplus, selu.

Conventions at the kinks follow torch's backward (``x > 0`` takes the positive branch).
"""

from __future__ import annotations

import math

from tvm import relax

from ._common import const, in_float32, register, shape_of, sum_to_shape

op = relax.op

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_GELU_TANH_COEF = 0.044715


@register("relax.nn.gelu")
def gelu_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x * Phi(x)``, ``Phi(x) = (1 + erf(x / sqrt(2))) / 2``.

    ``dx = dy * (Phi(x) + x * phi(x))`` with the normal density
    ``phi(x) = exp(-x^2/2) / sqrt(2 pi)``.
    """

    def dx(x: relax.Expr, dy: relax.Expr) -> relax.Expr:
        cdf = const(0.5, x) + const(0.5, x) * op.erf(x * const(math.sqrt(0.5), x))
        pdf = op.exp(const(-0.5, x) * x * x) * const(1.0 / math.sqrt(2.0 * math.pi), x)
        return dy * (cdf + x * pdf)

    return [in_float32(ctx, dx, orig_call.args[0], output_grad)]


@register("relax.nn.gelu_tanh")
def gelu_tanh_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x/2 * (1 + tanh(u))``, ``u = sqrt(2/pi) * (x + c x^3)``, ``c = 0.044715``.

    ``dx = dy * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2))`` with ``t = tanh(u)``.
    """

    def dx(x: relax.Expr, dy: relax.Expr) -> relax.Expr:
        k = const(math.sqrt(2.0 / math.pi), x)
        x2 = x * x
        t = op.tanh(k * x * (const(1.0, x) + const(_GELU_TANH_COEF, x) * x2))
        du = k * (const(1.0, x) + const(3.0 * _GELU_TANH_COEF, x) * x2)
        half = const(0.5, x)
        return dy * (half * (const(1.0, x) + t) + half * x * (const(1.0, x) - t * t) * du)

    return [in_float32(ctx, dx, orig_call.args[0], output_grad)]


@register("relax.nn.leakyrelu")
def leakyrelu_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x if x > 0 else alpha * x``:  ``dx = dy if x > 0 else alpha * dy``."""
    x = orig_call.args[0]
    alpha = const(float(orig_call.attrs.alpha), x)
    return [op.where(op.greater(x, const(0.0, x)), output_grad, alpha * output_grad)]


@register("relax.nn.prelu")
def prelu_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x if x > 0 else a[c] * x`` with ``c`` the index along ``axis``.

    ``dx = dy if x > 0 else a[c] * dy``;  ``da[c] = sum over all but axis of (x <= 0) * x * dy``
    (summed to one value when ``a`` has a single element).
    """
    x, alpha = orig_call.args
    x_shape = shape_of(x)
    axis = int(orig_call.attrs.axis) % len(x_shape)
    alpha_shape = shape_of(alpha)
    bshape = [1] * len(x_shape)
    bshape[axis] = alpha_shape[0]
    positive = op.greater(x, const(0.0, x))
    zero = const(0.0, x)
    x_grad = op.where(positive, output_grad, op.reshape(alpha, bshape) * output_grad)
    slope_part = op.where(positive, zero, x * output_grad)
    if alpha_shape[0] == x_shape[axis]:
        reduce_axes = [i for i in range(len(x_shape)) if i != axis]
    else:
        reduce_axes = list(range(len(x_shape)))
    return [x_grad, sum_to_shape(slope_part, reduce_axes, alpha_shape)]


@register("relax.nn.softplus")
def softplus_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = log(1 + exp(b x)) / b``, or ``x`` where ``b x > threshold``.

    ``dx = dy * sigmoid(b x)``, or ``dy`` where ``b x > threshold``.
    """
    x = orig_call.args[0]
    beta_x = x * const(float(orig_call.attrs.beta), x)
    linear = op.greater(beta_x, const(float(orig_call.attrs.threshold), x))
    return [op.where(linear, output_grad, output_grad * op.sigmoid(beta_x))]


@register("relax.nn.selu")
def selu_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = s * x if x > 0 else s * a * (exp(x) - 1)``:  ``dx = dy * s * (1 or a * exp(x))``."""
    x = orig_call.args[0]
    negative_slope = const(_SELU_SCALE * _SELU_ALPHA, x) * op.exp(x)
    slope = op.where(op.greater(x, const(0.0, x)), const(_SELU_SCALE, x), negative_slope)
    return [output_grad * slope]

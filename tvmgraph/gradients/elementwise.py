"""Gradients of elementwise math ops: erf, rsqrt, square, clip, the inverse trigonometric and
hyperbolic functions, tan, the remainders, and the piecewise-constant ones.

Each is ``dx = dy * f'(x)``, with ``f'`` written from x or from the output y when cheaper.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import const, register, scalar_of, shape_of

op = relax.op


@register("relax.erf")
def erf_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = erf(x)``:  ``dx = dy * 2/sqrt(pi) * exp(-x^2)``."""
    x = orig_call.args[0]
    return [output_grad * const(2.0 / math.sqrt(math.pi), x) * op.exp(-(x * x))]


@register("relax.rsqrt")
def rsqrt_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = 1/sqrt(x)``:  ``dx = -1/2 * dy * y^3``."""
    y = orig_var
    return [const(-0.5, y) * output_grad * y * y * y]


@register("relax.square")
def square_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x^2``:  ``dx = 2 * x * dy``."""
    x = orig_call.args[0]
    return [const(2.0, x) * x * output_grad]


@register("relax.clip")
def clip_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = clip(x, lo, hi)``:  ``dx = dy where lo < x < hi, else 0``.

    The bounds are strict, as in torch's ``hardtanh_backward`` (``ReLU6``, ``Hardtanh``), which
    the importer lowers to ``clip`` too. ``torch.clamp``'s backward is inclusive instead; the two
    only differ where x sits exactly on a bound, which happens in real networks: a batch-norm
    channel with zero variance outputs exactly ``beta`` (0 at init) into the ``ReLU6``.
    ``lo`` and ``hi`` are not differentiable.

    Written from the output: ``lo < y < hi`` exactly when ``lo < x < hi`` (outside, y sits on a
    bound). The backward pass then keeps ``y``, which the next layer keeps anyway, and not the
    input: in a MobileNet block that input is the batch-norm output, the size of the block's
    biggest activation.
    """
    _, low, high = orig_call.args
    y = orig_var
    inside = op.logical_and(
        op.greater(y, const(scalar_of(low), y)), op.less(y, const(scalar_of(high), y))
    )
    zero = const(0.0, y)
    return [op.where(inside, output_grad, zero), grad_op.no_grad(low), grad_op.no_grad(high)]


def _zero_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """Piecewise-constant ``y = f(x)`` (floor, ceil, round, trunc, sign):  ``dx = 0``."""
    return [grad_op.no_grad(orig_call.args[0])]


for _name in ("relax.floor", "relax.ceil", "relax.round", "relax.trunc", "relax.sign"):
    register(_name)(_zero_grad)


def _unary(formula: str, derivative: Callable[[relax.Expr, relax.Expr], relax.Expr]) -> None:
    """Register ``dx = dy * derivative(x, y)`` for ``relax.<name>``."""
    name, _, _ = formula.partition(":")

    def gradient(
        orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
    ) -> list[relax.Expr]:
        return [output_grad * derivative(orig_call.args[0], orig_var)]

    gradient.__doc__ = f"``{formula.strip()}``."
    register(f"relax.{name}")(gradient)


def _zero(x: relax.Expr) -> relax.Expr:
    return const(0.0, x)


def _one(x: relax.Expr) -> relax.Expr:
    return const(1.0, x)


_unary("acos: dx = -dy / sqrt(1 - x^2)", lambda x, y: -op.rsqrt(_one(x) - x * x))
_unary("asin: dx = dy / sqrt(1 - x^2)", lambda x, y: op.rsqrt(_one(x) - x * x))
_unary("atan: dx = dy / (1 + x^2)", lambda x, y: _one(x) / (_one(x) + x * x))
_unary("acosh: dx = dy / sqrt(x^2 - 1)", lambda x, y: op.rsqrt(x * x - _one(x)))
_unary("asinh: dx = dy / sqrt(x^2 + 1)", lambda x, y: op.rsqrt(x * x + _one(x)))
_unary("atanh: dx = dy / (1 - x^2)", lambda x, y: _one(x) / (_one(x) - x * x))
_unary("tan: dx = dy (1 + y^2)", lambda x, y: _one(y) + y * y)


def _reduce_to(grad: relax.Expr, like: relax.Expr, result: relax.Var) -> relax.Expr:
    """``grad`` (shaped like ``result``) summed over the axes that ``like`` was broadcast along."""
    shape = shape_of(like)
    return grad if shape_of(result) == shape else op.collapse_sum_to(grad, shape)


@register("relax.atan2")
def atan2_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``z = atan2(a, b)``:  ``da = dy b / (a^2 + b^2)``, ``db = -dy a / (a^2 + b^2)``; both 0
    where ``a^2 + b^2`` is 0 (at the origin, or underflowed), as torch's (NaN before)."""
    a, b = orig_call.args
    squares = ctx.emit(a * a + b * b)
    scale = ctx.emit(op.where(op.equal(squares, _zero(squares)), _zero(squares), output_grad / squares))
    return [_reduce_to(scale * b, a, orig_var), _reduce_to(-(scale * a), b, orig_var)]


def _remainder(name: str, rounding: Callable[[relax.Expr], relax.Expr], rounding_name: str) -> None:
    def gradient(
        orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
    ) -> list[relax.Expr]:
        a, b = orig_call.args
        return [_reduce_to(output_grad, a, orig_var), _reduce_to(-(output_grad * rounding(a / b)), b, orig_var)]

    gradient.__doc__ = f"``z = a - b {rounding_name}(a / b)``:  ``da = dy``, ``db = -dy {rounding_name}(a / b)``."
    register(f"relax.{name}")(gradient)


_remainder("mod", op.trunc, "trunc")  # torch.fmod
_remainder("floor_mod", op.floor, "floor")  # torch.remainder


@register("relax.floor_divide")
def floor_divide_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``floor(a / b)`` is piecewise constant:  ``da = db = 0``."""
    return [grad_op.no_grad(arg) for arg in orig_call.args]

"""Gradients of elementwise math ops: erf, rsqrt, square, clip, and the piecewise-constant ones.

Each is ``dx = dy * f'(x)``, with ``f'`` written from x or from the output y when cheaper.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import const, register, scalar_of

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

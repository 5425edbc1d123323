"""Ops whose outputs are booleans, integers or constants: their gradient is zero.

``relax.transform.Gradient`` asks every op on the way from the loss back to a parameter for its
gradient, also an op that only feeds a mask or an index (``nanmean``'s ``logical_not(isnan(x))``,
``interpolate``'s ``arange`` grid, ``quantile``'s ``argsort``). Without a registration the whole
gradient fails; with ``no_grad`` for every argument the other inputs' gradients flow as before.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import register

NON_DIFFERENTIABLE = (
    # boolean and integer results
    "relax.logical_not", "relax.logical_and", "relax.logical_or", "relax.logical_xor",
    "relax.bitwise_not", "relax.bitwise_and", "relax.bitwise_or", "relax.bitwise_xor",
    "relax.left_shift", "relax.right_shift",
    "relax.isnan", "relax.isinf", "relax.isfinite",
    "relax.argsort", "relax.argmax", "relax.argmin", "relax.nonzero", "relax.one_hot",
    # constants
    "relax.arange", "relax.eye", "relax.eye_like",
    # a stop: its input's value with no gradient (the embedding converter's padding_idx)
    "relax.grad.no_grad",
)


def _no_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``dx = 0`` for every argument."""
    return [grad_op.no_grad(arg) for arg in orig_call.args]


for _name in NON_DIFFERENTIABLE:
    register(_name)(_no_grad)

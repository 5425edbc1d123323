"""Gradients of the max/min reductions (``torch.amax``/``amin``, the max of a stable softmax), and
the zero gradients of indices and masks (argmax, argsort, isnan, logical_and, ...)."""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dims_of, dtype_of, normalize_axes, register

op = relax.op


def _extremum_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = max(x, axis)`` or ``min(x, axis)``: the gradient is shared among the ties.

    ``m = (x == y)`` with y broadcast back over ``axis``;  ``dx = m * dy / sum(m, axis)``, which
    is what ``torch.amax``/``amin`` do (``torch.max(x, dim)`` instead picks one index).
    """
    x = orig_call.args[0]
    attrs = orig_call.attrs
    axes = normalize_axes(attrs.axis, len(dims_of(x)))  # any dims: a dynamic batch too
    y, grad = orig_var, output_grad
    if not attrs.keepdims:
        y, grad = op.expand_dims(y, axes), op.expand_dims(grad, axes)
    hits = op.astype(op.equal(x, y), dtype_of(x))
    count = op.sum(hits, axes, keepdims=True)
    return [hits * (grad / count)]


for _name in ("relax.max", "relax.min"):
    register(_name)(_extremum_grad)


def _constant_result_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """An index or mask (argmax, argsort, isnan, logical_and, ...) is constant almost everywhere:
    no gradient. Autodiff still asks for one when the result is cast to float and used."""
    return [grad_op.no_grad(arg) for arg in orig_call.args]


for _name in ("relax.argmax", "relax.argmin", "relax.argsort", "relax.arange", "relax.isnan", "relax.isinf",
              "relax.isfinite", "relax.logical_and", "relax.logical_or", "relax.logical_not", "relax.logical_xor"):
    register(_name)(_constant_result_grad)

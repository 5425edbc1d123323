"""Gradients of the selections: ``topk`` (``torch.topk``, ``torch.max(x, dim)``), ``sort`` and
``median``. Each output value is one input element, so the gradient goes back to the index it
came from (``argsort`` itself is non-differentiable, see ``nondiff.py``).
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dims_of, dtype_of, normalize_axes, register, shape_of, tuple_field_grad

op = relax.op


def _scatter_back(x: relax.Expr, indices: relax.Expr, grad: relax.Expr, axis: int) -> relax.Expr:
    """``dx = scatter_elements(zeros_like(x), indices, grad, axis, reduction="add")``."""
    zeros = op.zeros(dims_of(x), dtype_of(x))
    return op.scatter_elements(zeros, indices, grad, axis=axis, reduction="add")


@register("relax.topk")
def topk_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``(values, indices) = topk(x, k, axis)``: ``dx = scatter-add of d(values) at indices``.

    With ``ret_type="values"`` the indices are computed again; with ``"indices"`` there is no
    float output and ``dx = 0``.
    """
    x = orig_call.args[0]
    attrs = orig_call.attrs
    ret_type = str(attrs.ret_type)
    if ret_type == "indices":
        return [grad_op.no_grad(x)]
    values_grad = tuple_field_grad(ctx, output_grad, 0) if ret_type == "both" else output_grad
    if values_grad is None:
        return [op.zeros(dims_of(x), dtype_of(x))]
    if not shape_of(x):  # a 0-d x is its own top 1
        return [op.reshape(values_grad, [])]
    axis = int(attrs.axis) % len(shape_of(x))
    if ret_type == "both":
        indices = relax.TupleGetItem(orig_var, 1)
    else:
        indices = op.topk(x, int(attrs.k), axis, "indices", bool(attrs.largest), str(attrs.dtype))
    return [_scatter_back(x, indices, values_grad, axis)]


@register("relax.sort")
def sort_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = sort(x, axis)``: ``dx = scatter-add of dy at argsort(x, axis)``."""
    x = orig_call.args[0]
    attrs = orig_call.attrs
    axis = int(attrs.axis) % len(shape_of(x))
    indices = op.argsort(x, axis, bool(attrs.descending), "int64")
    return [_scatter_back(x, indices, output_grad, axis)]


@register("relax.median")
def median_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``median(x)`` over all elements: ``dx = m dy / sum(m)`` with ``m = (x == y)``, shared
    among ties as ``torch.median(x)`` does. ``(values, indices) = median(x, axis)``: ``dx`` is
    ``d(values)`` scattered to the indices, as ``torch.median(x, dim)`` does.
    """
    x = orig_call.args[0]
    attrs = orig_call.attrs
    ndim = len(shape_of(x))
    if attrs.axis is None:
        hits = op.astype(op.equal(x, orig_var), dtype_of(x))
        return [hits * (output_grad / op.sum(hits))]
    axes = normalize_axes(attrs.axis, ndim)
    if len(axes) != 1:
        raise NotImplementedError(f"gradient of relax.median over several axes {axes}")
    values_grad = tuple_field_grad(ctx, output_grad, 0)
    if values_grad is None:
        return [op.zeros(dims_of(x), dtype_of(x))]
    indices = relax.TupleGetItem(orig_var, 1)
    if not attrs.keepdims:
        values_grad, indices = op.expand_dims(values_grad, axes), op.expand_dims(indices, axes)
    return [_scatter_back(x, indices, values_grad, axes[0])]

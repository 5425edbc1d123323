"""Gradients of the scatters: ``index_put`` (``index_fill``/``index_copy``/``index_add``,
``x[idx] = v``, ``max_unpool``) and ``slice_scatter`` (``torch.slice_scatter``, circular
padding). ``scatter_elements`` (``torch.scatter``, ``scatter_reduce``) is in index.py.

The output is the input with some elements replaced (or added to): the input's gradient is dy
with the replaced elements zeroed (all of dy when adding), the source's gradient is dy read at
the positions it was written to; indices are not differentiable.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dims_of, dtype_of, prod, register, scalar_of, shape_of

op = relax.op


def _sum_to(grad: relax.Expr, like: relax.Expr, grad_shape: list[int]) -> relax.Expr:
    """``grad`` summed over the axes ``like`` was broadcast along (a no-op for equal shapes)."""
    shape = shape_of(like)
    return grad if shape == grad_shape else op.collapse_sum_to(grad, shape)


def _is_broadcast(ctx: relax.BlockBuilder, values: relax.Expr, shape: list[int]) -> bool:
    """Whether ``values`` has fewer elements than ``shape`` or is bound to a broadcast of such."""
    if prod(shape_of(values)) < prod(shape):
        return True
    bound = ctx.lookup_binding(values) if isinstance(values, relax.Var) else None
    return (isinstance(bound, relax.Call) and bound.op.same_as(tvm.ir.Op.get("relax.broadcast_to"))
            and prod(shape_of(bound.args[0])) < prod(shape))


@register("relax.index_put")
def index_put_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x; y[idx_0, ..., idx_{n-1}] = v`` (``+=`` with ``accumulate``), v broadcast to the
    indices' shape ``B``.

    ``dv = sum_to(dy[idx], v.shape)``; ``dx = dy`` with ``accumulate``, else
    ``index_put(dy, idx, 0)``. Where an index repeats, torch's ``index_put`` (and
    ``max_unpool``) hand dy to every source written to the position, but ``index_fill`` (one
    value broadcast, lowered to ``index_put(x, idx, broadcast_to(v, B))``) counts each
    position once. So when v is broadcast (here or by a ``broadcast_to`` just before) and not
    accumulated, only the source that stays counts: the
    same index_put of the source numbers ``0 .. |B|-1`` says which, and
    ``dv = sum_to(where(kept, dy[idx], 0), v.shape)``.
    """
    x, indices, values = orig_call.args
    read = ctx.normalize(op.index_tensor(output_grad, indices))
    index_shape = shape_of(read)
    if orig_call.attrs.accumulate:
        return [output_grad, grad_op.no_grad(indices), _sum_to(read, values, index_shape)]
    x_grad = op.index_put(output_grad, indices, op.zeros(dims_of(values), dtype_of(values)))
    if not _is_broadcast(ctx, values, index_shape):
        return [x_grad, grad_op.no_grad(indices), _sum_to(read, values, index_shape)]
    numbers = op.reshape(op.arange(0, prod(index_shape), 1, "int64"), index_shape)
    winners = op.index_put(op.zeros(dims_of(x), "int64"), indices, numbers)
    kept = op.equal(op.index_tensor(winners, indices), numbers)
    values_grad = _sum_to(op.where(kept, read, op.zeros(index_shape, dtype_of(read))), values, index_shape)
    return [x_grad, grad_op.no_grad(indices), values_grad]


@register("relax.slice_scatter")
def slice_scatter_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x; y[start:end:step] = s`` along ``axis``.

    ``ds = dy[start:end:step]``; ``dx = slice_scatter(dy, 0, start, end, step)``.
    """
    x, src, start, end, step = orig_call.args
    axis = int(orig_call.attrs.axis) % len(shape_of(x))
    bounds = [int(scalar_of(v)) for v in (start, end, step)]
    src_grad = op.strided_slice(output_grad, [axis], [bounds[0]], [bounds[1]], [bounds[2]])
    zeros = op.zeros(dims_of(src), dtype_of(src))
    x_grad = op.slice_scatter(output_grad, zeros, *bounds, axis=axis)
    return [x_grad, src_grad, *(grad_op.no_grad(v) for v in (start, end, step))]

"""Gradients of gathers: gather_elements (``torch.gather``, cross-entropy's pick) and index_tensor
(``x[idx]``). Each scatters the output gradient back, adding where an index repeats; the indices
are not differentiable. (``take`` is in ``fixes.py``: TVM has one, but it fails.)
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dtype_of, prod, register, shape_of

op = relax.op


@register("relax.gather_elements")
def gather_elements_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y[..., i, ...] = x[..., idx[..., i, ...], ...]`` along ``axis``.

    ``dx = scatter_elements(zeros_like(x), idx, dy, axis, reduction="add")``.
    """
    x, indices = orig_call.args
    zeros = op.zeros(shape_of(x), dtype_of(x))
    axis = int(orig_call.attrs.axis)
    x_grad = op.scatter_elements(zeros, indices, output_grad, axis=axis, reduction="add")
    return [x_grad, grad_op.no_grad(indices)]


@register("relax.index_tensor")
def index_tensor_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = x[idx_0, ..., idx_{k-1}]`` (advanced indexing of the leading k axes).

    With x viewed as ``[d_0 * ... * d_{k-1}, *rest]`` and the broadcast indices combined into
    one flat index ``f = sum_i idx_i * prod(d_{i+1:k})`` (negative ``idx_i`` count from the end),
    ``dx = take_backward(dy, x, f, axis=0)``, which adds up repeated indices.
    """
    x, indices = orig_call.args
    x_shape = shape_of(x)
    k = len(indices.ty.fields)
    lead, rest = x_shape[:k], x_shape[k:]
    out_shape = shape_of(orig_var)
    index_shape = out_shape[: len(out_shape) - len(rest)]
    count = prod(index_shape)
    flat: relax.Expr | None = None
    for i in range(k):
        index = op.astype(relax.TupleGetItem(indices, i), "int64")
        size = relax.const(lead[i], "int64")
        index = op.where(op.less(index, relax.const(0, "int64")), index + size, index)
        stride = relax.const(prod(lead[i + 1 :]), "int64")
        term = index * stride
        flat = term if flat is None else flat + term
    assert flat is not None
    flat = op.reshape(op.broadcast_to(flat, index_shape), [count])
    grad = op.reshape(output_grad, [count, *rest])
    x_flat = op.reshape(x, [prod(lead), *rest])
    x_grad = op.reshape(grad_op.take_backward(grad, x_flat, flat, 0), x_shape)
    return [x_grad, grad_op.no_grad(indices)]

"""Gradients of gathers: gather_elements (``torch.gather``, cross-entropy's pick) and index_tensor
(``x[idx]``), and of scatter_elements (``scatter``, ``scatter_add``, ``scatter_reduce``). Each gather
scatters the output gradient back, adding where an index repeats; the indices are not
differentiable. (``take`` is in ``fixes.py``: TVM has one, but it fails.)
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import dims_of, dtype_of, prod, register, scalar_operand

op = relax.op


@register("relax.gather_elements")
def gather_elements_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y[..., i, ...] = x[..., idx[..., i, ...], ...]`` along ``axis``.

    ``dx = scatter_elements(zeros_like(x), idx, dy, axis, reduction="add")``; with one index
    per row (idx of x's shape but 1 along ``axis``: cross-entropy's pick of each row's label)
    ``dx = where(arange == idx, dy, 0)``, an element-wise select that fuses with its consumer,
    where the scatter needed a zero tensor of x's size and its own output (the GPT's step: two
    16 MiB tensors at its memory peak, the loss).
    """
    x, indices = orig_call.args
    x_shape, index_shape = dims_of(x), dims_of(indices)
    axis = int(orig_call.attrs.axis) % max(len(x_shape), 1)
    if _one_index_per_row(x_shape, index_shape, axis):
        return [_select_rows(x_shape, indices, output_grad, axis), grad_op.no_grad(indices)]
    zeros = op.zeros(x_shape, dtype_of(x))
    x_grad = op.scatter_elements(zeros, indices, output_grad, axis=axis, reduction="add")
    return [x_grad, grad_op.no_grad(indices)]


def _one_index_per_row(x_shape: list, index_shape: list, axis: int) -> bool:
    """Static shapes (a dynamic batch keeps the scatter), idx 1 long along `axis` and x's size
    on every other axis."""
    if not all(isinstance(d, int) for d in (*x_shape, *index_shape)) or len(x_shape) != len(index_shape):
        return False
    return index_shape[axis] == 1 and all(a == b for d, (a, b) in enumerate(zip(x_shape, index_shape))
                                          if d != axis)


def _select_rows(x_shape: list, indices: relax.Expr, output_grad: relax.Expr, axis: int) -> relax.Expr:
    """dy where the position along `axis` is the row's index, else 0 (a negative index counts
    from the end, as scatter_elements takes it)."""
    size = x_shape[axis]
    index_dtype = dtype_of(indices)
    index = op.where(op.less(indices, relax.const(0, index_dtype)), indices + relax.const(size, index_dtype), indices)
    positions = op.reshape(op.arange(0, size, 1, index_dtype), [size if d == axis else 1 for d in range(len(x_shape))])
    zero = relax.const(0, dtype_of(output_grad))
    return op.where(op.equal(positions, index), output_grad, zero)


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
    x_shape = dims_of(x)  # a dynamic batch's dim stays symbolic (`logits[arange(n), y]`)
    k = len(indices.ty.fields)
    lead, rest = x_shape[:k], x_shape[k:]
    out_shape = dims_of(orig_var)
    index_shape = out_shape[: len(out_shape) - len(rest)]
    count = prod(index_shape)
    flat: relax.Expr | None = None
    for i in range(k):
        index = op.astype(relax.TupleGetItem(indices, i), "int64")
        size = scalar_operand(lead[i], "int64")
        index = op.where(op.less(index, relax.const(0, "int64")), index + size, index)
        term = index * scalar_operand(prod(lead[i + 1 :]), "int64")
        flat = term if flat is None else flat + term
    assert flat is not None
    flat = op.reshape(op.broadcast_to(flat, index_shape), [count])
    grad = op.reshape(output_grad, [count, *rest])
    x_flat = op.reshape(x, [prod(lead), *rest])
    x_grad = op.reshape(grad_op.take_backward(grad, x_flat, flat, 0), x_shape)
    return [x_grad, grad_op.no_grad(indices)]


@register("relax.scatter_elements")
def scatter_elements_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = scatter_elements(x, idx, src, axis, reduction)``; ``g(t) = gather_elements(t, idx)``.

    * ``update``: ``dx = dy`` where nothing lands, 0 elsewhere; ``dsrc = g(dy)``;
    * ``add``: ``dx = dy``, ``dsrc = g(dy)``;
    * ``max``/``min``: the ties with ``y`` share ``dy`` evenly (torch's scatter_reduce amax/amin):
      ``n = (x == y) + scatter_add(src == g(y))``, ``dx = (x == y) dy / n``,
      ``dsrc = (src == g(y)) g(dy / n)``;
    * ``mul``: torch's scatter_reduce prod gradient, exact where x or src hold zeros:
      ``dx = dy * scatter_mul(x|0->1, idx, src) / (x|0->1)``; ``dsrc = g(dy * y) / src``, or for
      the only zero src of its target, ``g(dy * scatter_mul(x, idx, src|0->1))``.
    """
    x, indices, src = orig_call.args
    axis, reduction = int(orig_call.attrs.axis), str(orig_call.attrs.reduction)
    dtype = dtype_of(x)
    one, zero = relax.const(1, dtype), relax.const(0, dtype)
    zeros = op.zeros(dims_of(x), dtype)

    def gather(t: relax.Expr) -> relax.Expr:
        return op.gather_elements(t, indices, axis=axis)

    def scatter(base: relax.Expr, updates: relax.Expr, how: str) -> relax.Expr:
        return op.scatter_elements(base, indices, updates, axis=axis, reduction=how)

    if reduction == "add":
        x_grad, src_grad = output_grad, gather(output_grad)
    elif reduction == "update":
        hit = scatter(zeros, op.ones(dims_of(src), dtype), "update")
        x_grad, src_grad = output_grad * (one - hit), gather(output_grad)
    elif reduction in ("max", "min"):
        self_ties = op.astype(op.equal(x, orig_var), dtype)
        src_ties = op.astype(op.equal(src, gather(orig_var)), dtype)
        share = output_grad / op.maximum(self_ties + scatter(zeros, src_ties, "add"), one)
        x_grad, src_grad = self_ties * share, src_ties * gather(share)
    elif reduction == "mul":
        x_nonzero = op.where(op.equal(x, zero), one, x)
        x_grad = output_grad * scatter(x_nonzero, src, "mul") / x_nonzero
        src_zero = op.equal(src, zero)
        zeros_there = gather(scatter(zeros, op.astype(src_zero, dtype), "add"))
        single_zero = op.logical_and(src_zero, op.equal(zeros_there, one))
        without_it = scatter(x, op.where(single_zero, one, src), "mul")
        src_grad = op.where(single_zero, gather(output_grad * without_it),
                            gather(output_grad * orig_var) / op.where(src_zero, one, src))
    else:
        raise NotImplementedError(f"gradient of relax.scatter_elements with reduction={reduction!r}")
    return [x_grad, grad_op.no_grad(indices), src_grad]

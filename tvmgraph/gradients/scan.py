"""Gradients of the products: ``cumprod`` (``torch.cumprod``, ``masked.cumprod``) and ``prod``.

Both are exact where the input has zeros, like torch: ``y / x`` is used only where no zero is
involved, and the factor that a zero removes is computed as a product without that zero.
"""

from __future__ import annotations

from tvm import relax

from ._common import const, dtype_of, normalize_axes, prod, register, shape_of

op = relax.op


def _reverse_cumsum(expr: relax.Expr, axis: int) -> relax.Expr:
    """``out[i] = sum_{j >= i} expr[j]`` along ``axis``."""
    return op.flip(op.cumsum(op.flip(expr, axis), axis), axis)


@register("relax.cumprod")
def cumprod_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y_j = prod_{i <= j} x_i`` along ``axis`` (x flattened when ``axis`` is None).

    ``dx_k = sum_{j >= k} dy_j prod_{i <= j, i != k} x_i``. With ``z`` the first zero of x along
    the axis (the end when none):

    * ``k < z``: ``dx_k = rcumsum(dy y)_k / x_k`` (``rcumsum`` sums from the end);
    * ``k = z``: ``dx_k = rcumsum(dy y')_k`` with ``y' = cumprod(x with x_z := 1)``;
    * ``k > z``: ``dx_k = 0`` (every product holds ``x_z = 0``).
    """
    x = orig_call.args[0]
    attrs = orig_call.attrs
    if attrs.exclusive:
        raise NotImplementedError("gradient of an exclusive relax.cumprod (torch has none)")
    x_shape = shape_of(x)
    dtype = dtype_of(x)
    if not prod(x_shape) or not x_shape:  # empty (dx is too), or 0-d (y = x)
        return [op.reshape(op.astype(output_grad, dtype), x_shape)]
    y, grad = orig_var, output_grad
    if attrs.axis is None:
        x, y, grad = op.reshape(x, [-1]), op.reshape(y, [-1]), op.reshape(grad, [-1])
        axis = 0
    else:
        axis = int(attrs.axis) % len(x_shape)
    if dtype_of(orig_var) != dtype:
        y, grad = op.astype(y, dtype), op.astype(grad, dtype)
    zero = op.equal(x, relax.const(0, dtype))
    zeros_so_far = op.cumsum(op.astype(zero, "int32"), axis)
    before = op.equal(zeros_so_far, relax.const(0, "int32"))
    first_zero = op.logical_and(zero, op.equal(zeros_so_far, relax.const(1, "int32")))
    one = relax.const(1, dtype)
    x_safe = op.where(before, x, one)
    before_term = _reverse_cumsum(grad * y, axis) / x_safe
    y_without_zero = op.cumprod(op.where(first_zero, one, x), axis)
    zero_term = _reverse_cumsum(grad * y_without_zero, axis)
    x_grad = op.where(before, before_term, op.where(first_zero, zero_term, relax.const(0, dtype)))
    return [op.reshape(x_grad, x_shape)]


@register("relax.prod")
def prod_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = prod_A(x)``: ``dx_k = dy prod_{i in A, i != k} x_i``.

    With ``p = prod_A(x with zeros := 1)`` and ``c`` the number of zeros in the group:
    ``dx = dy p / x`` where ``c = 0``; ``dy p`` at the zero where ``c = 1``; 0 elsewhere.
    """
    x = orig_call.args[0]
    attrs = orig_call.attrs
    axes = normalize_axes(attrs.axis, len(shape_of(x)))
    grad = output_grad if attrs.keepdims else op.expand_dims(output_grad, axes)
    zero = op.equal(x, const(0, x))
    zero_count = op.sum(op.astype(zero, dtype_of(x)), axes, keepdims=True)
    x_safe = op.where(zero, const(1, x), x)
    nonzero_prod = op.prod(x_safe, axes, keepdims=True)
    no_zero = op.equal(zero_count, const(0, x))
    the_zero = op.logical_and(zero, op.equal(zero_count, const(1, x)))
    factor = op.where(no_zero, nonzero_prod / x_safe, op.where(the_zero, nonzero_prod, const(0, x)))
    return [grad * factor]

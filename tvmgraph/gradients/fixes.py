"""Overrides of TVM 0.27 gradients that are wrong, fail, or disagree with torch at kinks.

Each is registered above TVM's level (``fixes_tvm=True``); the reason is in its docstring:

* ``relax.nn.conv2d`` (in ``conv.py``, with conv1d): wrong ``output_padding`` with
  dilation > 1 (fails to build).
* ``relax.take``: 0-d and N-d indices fail (``take_backward`` takes 1-D indices only).
* ``relax.where``: the branch gradients are not summed back to broadcast branch shapes.
* ``relax.nn.relu``, ``relax.abs``, ``relax.maximum``, ``relax.minimum``: at the kink
  (``x == 0``, ``x == y``) TVM passes the whole gradient one way; torch passes 0 (relu, abs)
  or half to each side (maximum, minimum). Exact kinks are common in training, see ``relu_grad``.
* ``relax.astype``: TVM casts dy back through integer casts, so a truncation
  (``quantile``'s ``ranks - ranks.long()``) gets gradient 1 instead of 0.
* ``relax.concat``: ``split`` at the running offsets fails for one part (``torch.stack`` of one
  tensor) and for an empty part (``block_diag`` with an empty block).
* ``relax.split``: a split into one part (``x.split(n)`` with ``n`` at least the axis's size)
  is a tensor, not a tuple, and TVM's ``concat`` of its gradient fails to build.
* ``relax.power``: ``y * x ** (y - 1)`` is ``0 * inf`` (NaN) at ``x = 0, y = 0`` and
  ``z * log(x)`` is ``0 * -inf`` at ``x = 0, y > 0``; torch's pow_backward masks both to 0.
* ``relax.reshape``: reads the input's shape from its type, which a dynamic batch can leave
  unknown (autodiff's copy of the forward pass): the transformer failed to train.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.op import grad as grad_op

from ._common import const, dims_of, dtype_of, normalize_axes, prod, register, same_dims, scalar_operand

op = relax.op


def _sum_to(ctx: relax.BlockBuilder, grad: relax.Expr, like: relax.Expr) -> relax.Expr:
    """``grad`` summed over the axes ``like`` was broadcast along (a no-op for equal shapes)."""
    if same_dims(dims_of(like), dims_of(ctx.normalize(grad))):
        return grad
    return op.collapse_sum_to(grad, dims_of(like))


@register("relax.take", fixes_tvm=True)
def take_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = take(x, idx, axis)``:  ``dx[..., k, ...] = sum of dy[..., j, ...] over idx[j] == k``.

    TVM hands the indices straight to ``take_backward``, whose legalization asserts 1-D indices,
    so ``x[:, 0]`` (``torch.select``, a 0-d index) and embedding lookups with ``[batch, seq]``
    indices fail to build. Here the indices are flattened to 1-D (and dy's index dimensions with
    them) and resolved like the forward's ``mode`` (``fast``: ``k < 0`` means ``k + d``;
    ``clip``: clamped into ``[0, d-1]``; ``wrap``: ``k mod d``) before ``take_backward``.
    """
    x, indices = orig_call.args
    x_shape = dims_of(x)  # the indices of a dynamic batch's tokens are symbolic: n * seq of them
    count = prod(dims_of(indices))
    axis = orig_call.attrs.axis
    if axis is None:
        size = prod(x_shape)
        grad = op.reshape(output_grad, [count])
    else:
        axis = int(axis) % len(x_shape)
        size = x_shape[axis]
        grad = op.reshape(output_grad, x_shape[:axis] + [count] + x_shape[axis + 1 :])
    if not isinstance(size, int):
        raise NotImplementedError(f"take along a symbolic axis ({size}): train this graph with a static batch")
    flat = op.reshape(indices, [count])
    dtype = dtype_of(indices)
    mode = str(orig_call.attrs.mode)
    if mode == "clip":
        flat = op.clip(flat, 0, size - 1)
    elif mode == "wrap":
        flat = op.floor_mod(flat, relax.const(size, dtype))
    else:
        negative = op.less(flat, relax.const(0, dtype))
        flat = op.where(negative, flat + relax.const(size, dtype), flat)
    return [grad_op.take_backward(grad, x, flat, axis), grad_op.no_grad(indices)]


@register("relax.where", fixes_tvm=True)
def where_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = where(c, a, b)``:  ``da = sum_to(where(c, dy, 0), a)``,
    ``db = sum_to(where(c, 0, dy), b)``; c is not differentiable.

    TVM returns the full-shape ``where(...)`` terms, so a branch broadcast into y (a bias row,
    a scalar tensor) gets an adjoint of the wrong shape.
    """
    cond, on_true, on_false = orig_call.args
    zero = const(0.0, orig_var)
    return [
        grad_op.no_grad(cond),
        _sum_to(ctx, op.where(cond, output_grad, zero), on_true),
        _sum_to(ctx, op.where(cond, zero, output_grad), on_false),
    ]


@register("relax.nn.relu", fixes_tvm=True)
def relu_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = max(x, 0)``:  ``dx = dy where x > 0, else 0``.

    TVM's is ``where(x < 0, 0, dy)``, which passes dy at ``x == 0``; torch, JAX and TensorFlow
    pass 0. Exact zeros do reach a ReLU in training: a batch-norm channel with zero variance (a
    dead channel) outputs exactly ``beta``, 0 at initialization, and the batch-norm backward
    then scales the difference by ``1 / sqrt(eps)``.

    Written from the output (``y > 0`` exactly when ``x > 0``): the backward pass then keeps
    ``y``, which the next layer keeps anyway, and ``x`` dies after the forward pass.
    """
    y = orig_var
    zero = const(0.0, y)
    return [op.where(op.greater(y, zero), output_grad, zero)]


@register("relax.abs", fixes_tvm=True)
def abs_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = |x|``:  ``dx = sign(x) * dy``, 0 at ``x == 0`` (TVM's passes ``+dy`` there)."""
    return [op.sign(orig_call.args[0]) * output_grad]


def _split_at_ties(
    ctx: relax.BlockBuilder, orig_call: relax.Call, output_grad: relax.Var, first_loses: relax.Expr,
    second_loses: relax.Expr
) -> list[relax.Expr]:
    """``[sum_to(g_x, x), sum_to(g_y, y)]``, torch's way: each side gets dy unless it loses,
    ties half each. Where either is NaN neither loses: both get dy, as in torch (a side chosen
    by `x > y` gave the NaN's gradient to y alone)."""
    x, y = orig_call.args
    half = const(0.5, x) * output_grad
    zero = const(0.0, x)
    tie = op.equal(x, y)
    x_grad = op.where(tie, half, op.where(first_loses, zero, output_grad))
    y_grad = op.where(tie, half, op.where(second_loses, zero, output_grad))
    return [_sum_to(ctx, x_grad, x), _sum_to(ctx, y_grad, y)]


@register("relax.maximum", fixes_tvm=True)
def maximum_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``z = maximum(x, y)``:  ``dx = dy`` where ``x > y``, ``dy/2`` where ``x == y``, else 0;
    dy symmetrically. TVM gives a tie's whole gradient to x; torch splits it."""
    x, y = orig_call.args
    return _split_at_ties(ctx, orig_call, output_grad, op.less(x, y), op.greater(x, y))


@register("relax.minimum", fixes_tvm=True)
def minimum_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``z = minimum(x, y)``:  ``dx = dy`` where ``x < y``, ``dy/2`` where ``x == y``, else 0;
    dy symmetrically. TVM gives a tie's whole gradient to y; torch splits it."""
    x, y = orig_call.args
    return _split_at_ties(ctx, orig_call, output_grad, op.greater(x, y), op.less(x, y))


def _nonzero_constant(y: relax.Expr) -> bool:
    return isinstance(y, tvm.ir.expr.Constant) and bool((y.value.numpy() != 0).all())


@register("relax.power", fixes_tvm=True)
def power_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``z = x ** y``:  ``dx = dy * y * x ** (y - 1)``, 0 where ``y == 0``;
    ``dy = dy * z * log(x)``, 0 where ``x == 0`` and ``y >= 0`` (torch's pow_backward and
    pow_backward_exponent). TVM's were NaN there (``0 * inf``): `pow(x, e)` of a tensor
    exponent holding zeros, `0.0 ** p` (torch.pow of a scalar base)."""
    x, y = orig_call.args
    zero = const(0.0, x)
    x_grad = output_grad * y * op.power(x, y - const(1.0, y))
    if not _nonzero_constant(y):
        x_grad = op.where(op.equal(y, const(0.0, y)), zero, x_grad)
    y_grad = op.where(op.logical_and(op.equal(x, zero), op.greater_equal(y, const(0.0, y))), zero,
                      output_grad * orig_var * op.log(x))
    return [_sum_to(ctx, x_grad, x), _sum_to(ctx, y_grad, y)]


@register("relax.concat", fixes_tvm=True)
def concat_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = concat((x_0, ..., x_{k-1}), axis)``: ``dx_i = dy[o_i : o_i + x_i.shape[axis]]``
    along ``axis``, ``o_i`` the running offset.

    TVM's gradient splits dy at the offsets: with one part the split's result is no tuple
    ("Expected nested to match tuple"), and an empty part repeats an offset, which split's
    legalization rejects ("split_indices must be sorted"). One strided_slice per part has
    neither problem.
    """
    axis = int(orig_call.attrs.axis) % len(dims_of(orig_var))  # other axes may be symbolic
    parts, offset = [], 0
    for field in orig_call.args[0].ty.fields:
        if field.shape is None or not isinstance(field.shape[axis], tvm.tirx.IntImm):
            raise NotImplementedError(f"the gradient of concat needs the sizes along its axis, got {field}")
        size = int(field.shape[axis])
        parts.append(op.strided_slice(output_grad, [axis], [offset], [offset + size]))
        offset += size
    return [relax.Tuple(parts)]


@register("relax.split", fixes_tvm=True)
def split_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``(y_0, ..., y_{k-1}) = split(x, indices, axis)``: ``dx = concat((dy_0, ..., dy_{k-1}), axis)``.

    A split into one part is that tensor in Relax, not a tuple of one, and so is its gradient:
    TVM's ``concat`` of it failed to build ("relax.concat expects the input to be a Tuple of
    Tensors"). The gradient of that split is the part's.
    """
    if isinstance(ctx.normalize(output_grad).ty, relax.TensorType):
        return [output_grad]
    return [op.concat(output_grad, int(orig_call.attrs.axis))]


@register("relax.astype", fixes_tvm=True)
def astype_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = astype(x, dtype)``: ``dx = astype(dy, x.dtype)`` between float types, and no
    gradient when either side is an integer or bool (a cast to an integer is piecewise
    constant). TVM casts dy back whatever the types, so ``x - float(int(x))`` had gradient 0
    where torch has 1 (quantile's interpolation weight w.r.t. q).
    """
    x = orig_call.args[0]
    if not all(_is_float(dtype_of(e)) for e in (x, orig_var)):
        return [grad_op.no_grad(x)]
    return [op.astype(output_grad, dtype_of(x))]


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _reduced_count(ctx: relax.BlockBuilder, x: relax.Expr, axis: object, dtype: str) -> int | relax.Expr:
    """The number of elements `mean`/`variance` reduce over `axis` (all when None): an int, or
    for a symbolic (dynamic batch) dim a 0-d tensor, the sum of that many ones."""
    dims = dims_of(x)
    count = prod(dims[i] for i in normalize_axes(axis, len(dims)))
    if isinstance(count, int):
        return count
    return ctx.emit(op.sum(op.ones(relax.ShapeExpr([count]), dtype)))


@register("relax.mean", fixes_tvm=True)
def mean_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = mean(x, axis)``:  ``dx = broadcast(dy / n)``, n the reduced count.

    TVM's is the same but takes n as a Python int: it fails for a dynamic batch's symbolic dim.
    """
    x, attrs = orig_call.args[0], orig_call.attrs
    dtype = dtype_of(output_grad)
    n = _reduced_count(ctx, x, attrs.axis, dtype)
    grad = output_grad / scalar_operand(n, dtype)
    if not attrs.keepdims and attrs.axis:
        grad = op.expand_dims(grad, attrs.axis)
    return [op.broadcast_to(grad, dims_of(x))]


@register("relax.variance", fixes_tvm=True)
def variance_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = variance(x, axis)`` (biased):  ``dx = dy * (2/n x - 2/n^2 sum(x, axis))``.

    TVM's formula, with n a tensor where it is symbolic (a dynamic batch; TVM's takes an int).
    """
    x, attrs = orig_call.args[0], orig_call.attrs
    dtype = dtype_of(x)
    n = _reduced_count(ctx, x, attrs.axis, dtype)
    if isinstance(n, int):  # TVM's constants exactly
        first, second = relax.const(2.0 / n, dtype), relax.const(2.0 / n / n, dtype)
    else:
        two = relax.const(2.0, dtype)
        first, second = two / n, two / n / n
    grad = first * x - second * op.sum(x, attrs.axis, keepdims=True)
    if not attrs.keepdims and attrs.axis:
        output_grad = op.expand_dims(output_grad, attrs.axis)
    return [output_grad * grad]


@register("relax.reshape", fixes_tvm=True)
def reshape_grad(
    orig_var: relax.Var, orig_call: relax.Call, output_grad: relax.Var, ctx: relax.BlockBuilder
) -> list[relax.Expr]:
    """``y = reshape(x, s)``:  ``dx = reshape(dy, x.shape)``; s is not differentiable.

    TVM takes x's shape from x's type. Under a dynamic batch, autodiff copies the forward pass
    and re-infers the copies' types, and the copy of a reshape to a symbolic shape (lifted to a
    parameter, training/symbolic_shapes.py) can have a type with no shape: TVM's gradient then
    fails (an encoder layer's attention reshapes). Such a shape is read at run time instead.
    """
    x = orig_call.args[0]
    shape = x.ty.shape if isinstance(x.ty, relax.TensorType) else None
    return [op.reshape(output_grad, op.shape_of(x) if shape is None else shape), grad_op.no_grad(orig_call.args[1])]

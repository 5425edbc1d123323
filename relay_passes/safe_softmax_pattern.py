"""How the converter writes torch's `_safe_softmax(x, -1)`, and how a pass finds it.

tvmgraph/converters_nn.py (`safe_softmax`) writes it as

    finite = astype(not_equal(x, -inf), "int32")
    empty = equal(max(finite, axis=[-1], keepdims=True), 0)
    probs = softmax(x, axis=-1)                  (or softmax(where(empty, 0, x), axis=-1))
    y = where(empty, 0, probs)

SafeSoftmaxAsOneKernel (safe_softmax.py) makes it one kernel; AttentionAsOneKernel
(attention.py) takes it, with the products around it, into the attention kernel. Both find it
from its last step with `safe_softmax_parts`; the small matchers below are theirs too.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

Bound = Callable[[relax.Expr], "relax.Expr | None"]  # the value a variable is bound to, if any


def call_of(expr: relax.Expr | None, name: str) -> relax.Call | None:
    """`expr` when it is a call of the operator `name` ("relax.where"), else None."""
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == name:
        return expr
    return None


def scalar_value(expr: relax.Expr, dtype: str | None = None) -> float | None:
    """The value of `expr` when it is a scalar constant (of `dtype`, if given), else None."""
    if not isinstance(expr, tvm.ir.expr.GenericConst):
        return None
    data = expr.value.numpy()
    if data.shape != () or (dtype is not None and str(data.dtype) != dtype):
        return None
    return float(data)


def is_scalar(expr: relax.Expr, value: float) -> bool:
    """Whether `expr` is a scalar constant equal to `value`."""
    return scalar_value(expr) == value


def reduces_last_axis(call: relax.Call) -> bool:
    """Whether the call's `axis` attribute is the last axis of its first argument, alone."""
    axes = call.attrs.axis
    ndim = call.args[0].ty.ndim
    axes = [axes] if isinstance(axes, (int, tvm.tirx.IntImm)) else list(axes or [])
    return len(axes) == 1 and int(axes[0]) % ndim == ndim - 1


def _empty_rows_of(cond: relax.Expr, bound: Bound) -> relax.Expr | None:
    """The x of `equal(max(astype(not_equal(x, -inf), int32), [-1], keepdims), 0)`."""
    equal = call_of(bound(cond), "relax.equal")
    if equal is None or not is_scalar(equal.args[1], 0):
        return None
    reduced = call_of(bound(equal.args[0]), "relax.max")
    if reduced is None or not bool(reduced.attrs.keepdims) or not reduces_last_axis(reduced):
        return None
    cast = call_of(bound(reduced.args[0]), "relax.astype")
    finite = call_of(bound(cast.args[0]), "relax.not_equal") if cast is not None else None
    if finite is None or not is_scalar(finite.args[1], float("-inf")):
        return None
    return finite.args[0]


def safe_softmax_parts(where: relax.Call | None, bound: Bound) -> tuple[relax.Expr, relax.Expr] | None:
    """(x, probs) when `where` is the last step of the converter's `_safe_softmax(x, -1)`, with
    `probs` its softmax; None for anything else."""
    if where is None or not is_scalar(where.args[1], 0.0):
        return None
    cond, probs = where.args[0], where.args[2]
    softmax = call_of(bound(probs), "relax.nn.softmax")
    if softmax is None or not reduces_last_axis(softmax):
        return None
    x = _empty_rows_of(cond, bound)
    logits = softmax.args[0]
    masked = call_of(bound(logits), "relax.where")
    if masked is not None and masked.args[0].same_as(cond) and is_scalar(masked.args[1], 0.0):
        logits = masked.args[2]  # softmax(where(empty, 0, x)): the same rows of x
    return (x, probs) if x is not None and logits.same_as(x) else None

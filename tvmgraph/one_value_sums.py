"""Sums, means and variances to one value, legalized as 0-d reductions (reshaped if kept).

The CPU schedules sum a reduction to one value in chunks, in parallel (schedules/reduction.py,
`_chunk_partials`): a chain of float32 additions over a whole tensor loses digits. A reduction
that keeps its axes as ones (`x.mean(keepdim=True)`, `x.sum((0, 1), keepdim=True)`, and the mean
inside TVM's `variance`, which it always keeps) has a spatial loop of extent 1, so it was
scheduled as one row instead: 8 chains of 125,000 additions on one thread. Over 1e6 float32
values of 1e4 + U(0, 1), `x.mean(keepdim=True)` came out 9994.30 (float64: 10000.50) and
`x.var()` 38.5 (0.0833): silently wrong.

Here such a sum, mean or variance is computed as a reduction to a 0-d value (the variance's
mean too), which the schedules chunk, then reshaped to the kept shape:

    mean(x (1000, 1000), keepdims=True)  ->  reshape(sum(x) / 1e6, (1, 1))
    variance(x)                          ->  sum((x - sum(x) / n)^2) / n, its mean 0-d

A length with no divisor for a chunk is cut after whole chunks (`cut`), and the two parts
summed apart: `sum(x (1000003,))  ->  sum(x[:999424]) + sum(x[999424:])`.

Registered at a level above ragged_sums' legalizations (it falls back to them, and they to
TVM's, for a reduction that keeps an axis longer than 1). Exact up to the order of the sums.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.transform.legalize_ops.statistical import _compute_shape_prod, _has_const_zero_reduction_dim

from tvmgraph.schedules.chunk_sizes import divisor_between
from tvmgraph.ragged_sums import reduced_axes  # (registers its legalizations first: the fallbacks)

_LEVEL = 12  # above ragged_sums' 11, itself above TVM's 10


def to_one_value(shape: list, axis: object) -> bool:
    """Whether reducing a tensor of `shape` over `axis` (None: all) leaves one value: every
    axis it keeps has extent 1."""
    kept = set(range(len(shape))) - set(reduced_axes(len(shape), axis))
    return all(isinstance(shape[i], tirx.IntImm) and int(shape[i]) == 1 for i in kept)


# The schedules' chunks hold about sqrt(lanes n) elements (schedules/reduction.py
# `_chunk_partials`), whole vectors of the innermost axis; 16 lanes is the most (AVX-512).
CHUNKED_FROM = 1 << 12
_LANES = 16


def cut(shape: list) -> tuple[int, int] | None:
    """(axis, m): where a sum of all of `shape` is cut in two, [0, m) and [m, extent) of that
    axis, so that the schedules can chunk the first part; None to leave it whole.

    The chunks are whole runs of the innermost axes, the outermost of them split at a divisor:
    a length with no divisor near the chunk size (a prime 3999971, 2 x 1000003) was summed in one
    chain per vector lane, and `x.var()` of such a tensor of 1e3 + randn came out 408 (eager 1).
    The axis cut is the one the chunks split; m is a multiple of a power of two that makes a
    chunk (so a divisor exists), the tail a short sum."""
    if not all(isinstance(d, (int, tirx.IntImm)) for d in shape):
        return None
    dims = [int(d) for d in shape]
    n = math.prod(dims)
    if n < CHUNKED_FROM:
        return None
    target = math.isqrt(_LANES * n)
    inner = 1
    for axis in reversed(range(len(dims))):
        extent = dims[axis]
        if extent * inner >= target:
            lanes = _LANES if axis == len(dims) - 1 else 1  # whole vectors in the innermost axis
            least = max(lanes, math.ceil(target / inner))
            if divisor_between(extent, least, min(extent // 2, 64 * least), lanes) is not None:
                return None  # the schedules find a chunk of this axis (within 64 chunk sizes)
            step = 1 << math.ceil(math.log2(least))
            return (axis, extent - extent % step) if extent >= 2 * step else None
        inner *= extent
    return None


def _total(x: te.Tensor, term=None) -> te.Tensor:
    """The 0-d sum of `term(*index)` (default: x's elements) over x's index space, cut (`cut`)."""
    term = term or (lambda *i: x(*i))
    where = cut(list(x.shape))
    if where is None:
        return te.compute((), lambda: _sum_over(x.shape, term, None), name="total")
    axis, m = where
    head = te.compute((), lambda: _sum_over(x.shape, term, (axis, 0, m)), name="total_head")
    tail = te.compute((), lambda: _sum_over(x.shape, term, (axis, m, int(x.shape[axis]))), name="total_tail")
    return te.compute((), lambda: head() + tail(), name="total")


def _sum_over(shape: list, term, span: tuple[int, int, int] | None) -> tirx.PrimExpr:
    """te.sum of `term` over `shape`, axis `span[0]` over [span[1], span[2]) only."""
    axes = []
    for k, extent in enumerate(shape):
        if span is not None and k == span[0]:
            axes.append(te.reduce_axis((0, span[2] - span[1]), name=f"k{k}"))
        else:
            axes.append(te.reduce_axis((0, extent), name=f"k{k}"))
    index = [a + span[1] if span is not None and k == span[0] and span[1] else a for k, a in enumerate(axes)]
    return te.sum(term(*index), axis=axes)


def _sum(x: te.Tensor) -> te.Tensor:
    return _total(x)


def _mean(x: te.Tensor) -> te.Tensor:
    return topi.divide(_total(x), _compute_shape_prod(x, None))


def _variance(x: te.Tensor) -> te.Tensor:
    mean = _mean(x)
    squares = _total(x, lambda *i: (x(*i) - mean()) * (x(*i) - mean()))
    return topi.divide(squares, _compute_shape_prod(x, None))


_ZERO_DIM = {"relax.sum": _sum, "relax.mean": _mean, "relax.variance": _variance}


def _register(op_name: str) -> None:
    fallback = tvm.ir.Op.get(op_name).get_attr("FLegalize")
    zero_dim = _ZERO_DIM[op_name]

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        shape = getattr(x.ty, "shape", None)
        out_shape = getattr(call.ty, "shape", None)
        if (shape is None or out_shape is None or len(shape) == 0 or not to_one_value(list(shape), call.attrs.axis)
                or _has_const_zero_reduction_dim(call)):  # (nothing to sum: the fallbacks' 0 or NaN)
            return fallback(bb, call)

        def reduce(data: te.Tensor) -> te.Tensor:
            value = zero_dim(data)  # (0-d: left unreshaped, or FuseOps saw an opaque kernel)
            return topi.reshape(value, list(out_shape.values)) if len(out_shape.values) else value
        return bb.call_te(reduce, x, primfunc_name_hint=op_name.split(".")[-1])

    tvm.ir.register_op_attr(op_name, "FLegalize", legalize, level=_LEVEL)


for _op in _ZERO_DIM:
    _register(_op)

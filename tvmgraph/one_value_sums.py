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

Registered at a level above ragged_sums' legalizations (it falls back to them, and they to
TVM's, for a reduction that keeps an axis longer than 1). Exact up to the order of the sums.
"""

from __future__ import annotations


import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.transform.legalize_ops.statistical import _compute_shape_prod, _has_const_zero_reduction_dim

from tvmgraph.ragged_sums import reduced_axes  # (registers its legalizations first: the fallbacks)

_LEVEL = 12  # above ragged_sums' 11, itself above TVM's 10


def to_one_value(shape: list, axis: object) -> bool:
    """Whether reducing a tensor of `shape` over `axis` (None: all) leaves one value: every
    axis it keeps has extent 1."""
    kept = set(range(len(shape))) - set(reduced_axes(len(shape), axis))
    return all(isinstance(shape[i], tirx.IntImm) and int(shape[i]) == 1 for i in kept)


def _mean(x: te.Tensor) -> te.Tensor:
    return topi.divide(topi.sum(x), _compute_shape_prod(x, None))


def _variance(x: te.Tensor) -> te.Tensor:
    mean = _mean(x)
    squares = te.compute(x.shape, lambda *i: (x(*i) - mean()) * (x(*i) - mean()), name="squared_deviation")
    return _mean(squares)


_ZERO_DIM = {"relax.sum": topi.sum, "relax.mean": _mean, "relax.variance": _variance}


def _register(op_name: str) -> None:
    fallback = tvm.ir.Op.get(op_name).get_attr("FLegalize")
    zero_dim = _ZERO_DIM[op_name]

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        x = call.args[0]
        shape = getattr(x.ty, "shape", None)
        out_shape = getattr(call.ty, "shape", None)
        if (shape is None or out_shape is None or len(shape) == 0 or not to_one_value(list(shape), call.attrs.axis)
                or (op_name != "relax.sum" and _has_const_zero_reduction_dim(call))):
            return fallback(bb, call)

        def reduce(data: te.Tensor) -> te.Tensor:
            return topi.reshape(zero_dim(data), list(out_shape.values))
        return bb.call_te(reduce, x, primfunc_name_hint=op_name.split(".")[-1])

    tvm.ir.register_op_attr(op_name, "FLegalize", legalize, level=_LEVEL)


for _op in _ZERO_DIM:
    _register(_op)

"""Sums along an innermost axis that no vector divides, cut after its whole vectors.

A sum that keeps some axes and reduces the innermost one (a batch norm's statistics over N and
L of (N, C, L), a bias gradient `dy.sum((0, 2))`) is vectorized by the CPU schedules along the
innermost reduced loops whose elements a vector divides (schedules/reduction.py). Over a
raw-audio net's 1981 samples none does, so N and L were fused to fill vectors, and every lane
gathered its element through a division by 1981: the net's batch-norm and bias-gradient sums
ran at 8-22% of the memory bandwidth. Here such a sum is two: over the axis's first whole
vectors (1968 = 123 x 16 samples: contiguous vectors) and over its tail (13), then added:

    sum(x, axes) = sum(x[..., :1968], axes) + sum(x[..., 1968:], axes)

Legalizations of `relax.sum`, `relax.mean`, `relax.variance`, `relax.collapse_sum_to` (and
`_like`: autodiff's gradient of a broadcast bias) and of the training batch norm
(`relax.nn.batch_norm`, TOPI's formula: its mean and variance are such sums) are registered at a
level above TVM's, and fall back to TVM's for every other sum. Exact up to the order of the sums.
A mean or variance over an axis of extent 0 is a NaN `full`, as torch's 0 / 0 (TVM's folded the
division by the count and stopped the compile: `torch.zeros(0, 3).mean(0)`).
Limits: static innermost extent above two vectors; a sum to one value (a loss: every axis) keeps
TVM's, whose schedule splits it into chunks for precision; integer and float types alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.transform.legalize_ops.statistical import _compute_shape_prod, _has_const_zero_reduction_dim

_LEVEL = 11  # TVM registers its legalizations at level 10
# Whole vectors of this many (one AVX-512 vector of float32, two AVX2 ones) before the tail.
ROW_VECTOR = 16


def ragged_split(extent: object) -> int | None:
    """Where to cut a summed innermost axis of `extent` elements: after its whole vectors; None
    to leave it whole (symbolic, at most two vectors, or whole vectors already)."""
    if not isinstance(extent, (int, tirx.IntImm)):
        return None
    extent = int(extent)
    if extent <= 2 * ROW_VECTOR or extent % ROW_VECTOR == 0:
        return None
    return extent - extent % ROW_VECTOR


def reduced_axes(ndim: int, axis: object) -> list[int]:
    """The axes a sum over `axis` (None: all) of an `ndim`-dim tensor reduces, sorted."""
    if axis is None:
        return list(range(ndim))
    return sorted(int(a) % ndim for a in axis)


def collapsed_axes(dims: list, target: list) -> list[int]:
    """The axes `collapse_sum_to(x, target)` sums for an `x` of shape `dims`: the leading ones
    `target` lacks, and those it has as 1 where `x` does not."""
    lead = len(dims) - len(target)

    def one(d: object) -> bool:
        return isinstance(d, tirx.IntImm) and int(d) == 1

    return [i for i in range(len(dims)) if i < lead or (one(target[i - lead]) and not one(dims[i]))]


def splits(x: te.Tensor | relax.Expr, axis: object) -> bool:
    """Whether a sum of `x` over `axis` is cut: it reduces the innermost axis, keeps another,
    and `ragged_split` cuts the innermost one."""
    shape = x.shape if isinstance(x, te.Tensor) else getattr(x.ty, "shape", None)
    if shape is None:
        return False
    ndim = len(shape)
    axes = reduced_axes(ndim, axis)
    return ndim - 1 in axes and len(axes) < ndim and ragged_split(shape[-1]) is not None


def ragged_sum(x: te.Tensor, axis: object, keepdims: bool = False,
               term: Callable[[list], tirx.PrimExpr] | None = None, name: str = "sum") -> te.Tensor:
    """`topi.sum(x, axis, keepdims)` of `term(index)` (default: x at index) with the innermost
    axis summed as its whole vectors, then its tail (`splits(x, axis)` must hold)."""
    shape = list(x.shape)
    ndim = len(shape)
    axes = reduced_axes(ndim, axis)
    whole = ragged_split(shape[-1])
    assert whole is not None and ndim - 1 in axes, (shape, axes)
    value = term or (lambda index: x[tuple(index)])
    kept = [i for i in range(ndim) if i not in axes]
    out_shape = [1 if i in axes else shape[i] for i in range(ndim)] if keepdims else [shape[i] for i in kept]

    def part(start: int, stop: int, suffix: str) -> te.Tensor:
        def body(*out):
            reduce = {i: te.reduce_axis((0, shape[i]), name=f"k{i}") for i in axes[:-1]}
            reduce[ndim - 1] = te.reduce_axis((0, stop - start), name=f"k{ndim - 1}")
            outer = iter(out) if not keepdims else iter(out[i] for i in kept)
            index = [reduce[i] if i in reduce else next(outer) for i in range(ndim)]
            index[-1] = index[-1] + start if start else index[-1]
            return te.sum(value(index), axis=[reduce[i] for i in axes])
        return te.compute(out_shape, body, name=name + suffix)

    main, tail = part(0, whole, "_whole_vectors"), part(whole, int(shape[-1]), "_tail")
    return te.compute(out_shape, lambda *i: main[i] + tail[i], name=name)


def ragged_mean(x: te.Tensor, axis: object, keepdims: bool) -> te.Tensor:
    """TVM's `_te_mean` with the sum cut."""
    total = ragged_sum(x, axis, keepdims)
    return topi.divide(total, _compute_shape_prod(x, reduced_axes(len(x.shape), axis)))


def ragged_variance(x: te.Tensor, axis: object, keepdims: bool) -> te.Tensor:
    """TVM's `_te_variance` (the mean of squared deviations from the mean) with the sums cut."""
    mean = ragged_mean(x, axis, True)
    axes = reduced_axes(len(x.shape), axis)

    def deviation(index: list) -> tirx.PrimExpr:
        centered = x[tuple(index)] - mean[tuple(0 if i in axes else v for i, v in enumerate(index))]
        return centered * centered

    total = ragged_sum(x, axis, keepdims, deviation, name="squared_deviation_sum")
    return topi.divide(total, _compute_shape_prod(x, axes))


def ragged_batch_norm(data: te.Tensor, gamma: te.Tensor, beta: te.Tensor, moving_mean: te.Tensor,
                      moving_var: te.Tensor, axis: int, epsilon: float, center: bool, scale: bool,
                      momentum: float) -> list[te.Tensor]:
    """TOPI's training `batch_norm` (output, new moving mean, new moving variance) with its
    mean and variance summed by `ragged_sum`."""
    ndim = len(data.shape)
    axis = axis % ndim
    reduced = [i for i in range(ndim) if i != axis]
    mean = ragged_mean(data, reduced, False)
    var = ragged_variance(data, reduced, False)

    def out(*index):
        c = index[axis]
        value = (data[index] - mean[c]) / tirx.sqrt(var[c] + tirx.const(epsilon, data.dtype))
        if scale:
            value = value * gamma[c]
        if center:
            value = value + beta[c]
        return value

    keep = tirx.const(1 - momentum, data.dtype)
    take = tirx.const(momentum, data.dtype)
    return [te.compute(data.shape, out, name="batch_norm"),
            te.compute(moving_mean.shape, lambda c: keep * moving_mean[c] + take * mean[c], name="moving_mean"),
            te.compute(moving_var.shape, lambda c: keep * moving_var[c] + take * var[c], name="moving_var")]


def _with_fallback(op_name: str, legalize: Callable[[relax.BlockBuilder, relax.Call], relax.Expr | None]) -> None:
    """Register `legalize` for `op_name`, TVM's legalization where it returns None."""
    tvm_legalize = tvm.ir.Op.get(op_name).get_attr("FLegalize")

    def legalize_or_tvm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        result = legalize(bb, call)
        return tvm_legalize(bb, call) if result is None else result

    tvm.ir.register_op_attr(op_name, "FLegalize", legalize_or_tvm, level=_LEVEL)


def _statistic(te_func: Callable, name: str) -> Callable[[relax.BlockBuilder, relax.Call], relax.Expr | None]:
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        x = call.args[0]
        if name != "sum" and _has_const_zero_reduction_dim(call):  # torch: 0 / 0 (TVM's folded
            # division by the count 0 stopped the compile)
            return bb.call_te(topi.full, call.ty.shape.values, str(call.ty.dtype.dtype), math.nan,
                              primfunc_name_hint="full")
        if not splits(x, call.attrs.axis):
            return None
        return bb.call_te(te_func, x, call.attrs.axis, bool(call.attrs.keepdims), primfunc_name_hint=name)
    return legalize


def _collapse_sum(like: bool) -> Callable[[relax.BlockBuilder, relax.Call], relax.Expr | None]:
    """`collapse_sum_to(x, shape)` (autodiff's gradient of a broadcast: a bias's is a sum over
    N and L) as the sum over the axes it collapses, kept as ones, reshaped to `shape`."""
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        x = call.args[0]
        target = call.args[1].ty.shape if like else call.args[1]
        x_shape = getattr(x.ty, "shape", None)
        if x_shape is None or not isinstance(target, relax.ShapeExpr):
            return None
        dims, out = list(x_shape.values), list(target.values)
        axes = collapsed_axes(dims, out)
        if not axes or not splits(x, axes):
            return None

        def collapse(data: te.Tensor) -> te.Tensor:
            return topi.reshape(ragged_sum(data, axes, keepdims=True), out)
        return bb.call_te(collapse, x, primfunc_name_hint="collapse_sum")
    return legalize


def _batch_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    attrs = call.attrs
    data = call.args[0]
    ndim = len(data.ty.shape) if getattr(data.ty, "shape", None) is not None else 0
    if not attrs.training or ndim < 2 or not splits(data, [i for i in range(ndim) if i != int(attrs.axis) % ndim]):
        return None
    if len({str(arg.ty.dtype) for arg in call.args}) != 1:
        return None  # TOPI's formula in mixed types: TVM's
    return bb.call_te(ragged_batch_norm, *call.args, int(attrs.axis), float(attrs.epsilon), bool(attrs.center),
                      bool(attrs.scale), float(attrs.momentum), primfunc_name_hint="batch_norm")


_with_fallback("relax.sum", _statistic(ragged_sum, "sum"))
_with_fallback("relax.mean", _statistic(ragged_mean, "mean"))
_with_fallback("relax.variance", _statistic(ragged_variance, "variance"))
_with_fallback("relax.collapse_sum_to", _collapse_sum(like=False))
_with_fallback("relax.collapse_sum_like", _collapse_sum(like=True))
_with_fallback("relax.nn.batch_norm", _batch_norm)

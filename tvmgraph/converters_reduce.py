"""Converters for reductions, scans, scatters and strided views that TVM 0.27's importer lacks
or gets wrong. Each one is written with Relax ops that have gradients (tvmgraph/gradients), so
training through them works: a value picked by an index (`min.dim`, `kthvalue`, `cummax`, ...)
is a `gather_elements` of the input at that index, whose gradient scatters back to the index,
as torch's does.

- `amax`, `amin`: `max`/`min` (ties share the gradient evenly, as in torch), then NaN and
  all-infinite slices put right (TVM's reductions start from the lowest finite float and skip
  NaN); a 0-d input is itself.
- `argmax`, `argmin`: the first position equal to that extremum (TVM's argmax returned -1 for
  an all -inf row); `sum` of a 0-d tensor: TVM refuses to reduce 0-d.
- `max.dim`, `min.dim`: that index, then a gather (the stock `max.dim` used `topk`, which
  has no gradient).
- `var_mean`, `median`, `nanmedian`, `kthvalue`, `mode`, `cummax`, `cummin`, `logcumsumexp`: built
  from sorts, masks and reductions; `mode` compares every pair, the scans every prefix
  (`logcumsumexp` is a masked logsumexp of each prefix: exact for any range of values), so
  their memory is quadratic in the length of dim.
- `scatter_add`, `scatter_reduce`, `index_reduce`: `scatter_elements` with the matching
  reduction; `include_self=False` first resets the scattered positions to the reduction's
  identity, `mean` is a sum divided by the count.
- `searchsorted` (TOPI's kernel), `masked_scatter`, `nonzero_static`, `repeat_interleave` of a tensor
  of repeats with its `output_size`.
- `unfold`, `as_strided` (any strides), `as_strided_scatter`, `diagonal_scatter`: `take` or
  `where` with constant index maps, computed on the contiguous input.
- `addbmm`, `_trilinear` (`bilinear`), `_cdist_forward`, `_pdist_forward`, embedding bags.
- `prod.dim_int` (`torch.prod(x, dim)`): the importer lowers only the product of every element;
  its converter reads `dim` and `keepdim` too.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable

import numpy as np
import torch
import tvm
from tvm import relax, topi
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import symbolic_scalars
from .converters_nn import _arg, _dtype, _static_dim, _static_shape, stock_converter
from .converters_nn import isnan as _isnan
from .converters_sort import pick as _pick
from .converters_sort import sorted_index as _sorted_index

op = relax.op


def _env(importer: ExportedProgramImporter, value: object) -> relax.Expr | None:
    return importer.env[value] if isinstance(value, torch.fx.Node) else None


def _used(node: torch.fx.Node, index: int) -> bool:
    return any(u.target is operator.getitem and u.args[1] == index for u in node.users)


def _lowest(dtype: object, largest: bool) -> float | int:
    """The identity of max (largest=True) or min in `dtype`."""
    dtype = str(dtype)
    if "float" in dtype:
        return -math.inf if largest else math.inf
    info = np.iinfo(dtype)
    return int(info.min if largest else info.max)


# ---- reductions ----

def self_comparison(key: str):
    """`x != x` (torch's isnan idiom, in `nanmean`'s decomposition), `x == x`, `x <= x`,
    `x >= x` on one float tensor: TVM's simplifier folds them to a constant, as if no value
    were NaN (nanmean divided by the count of every element). Here: isnan / not isnan."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        x = importer.env.get(node.args[0])
        if node.args[0] is not node.args[1] or x is None or "float" not in _dtype(x):
            return stock_converter(importer, key)(node)
        nan = _isnan(x)
        return importer.block_builder.emit(nan if key.startswith("ne") else op.logical_not(nan))

    return convert


def _extremum(bb: relax.BlockBuilder, x: relax.Expr, axes: list[int] | None, keepdims: bool,
              largest: bool) -> relax.Expr:
    """max (largest) or min of float `x` over `axes` with torch's special values: NaN when the
    slice holds a NaN, -inf (+inf for min) when every element is -inf (+inf).

    TVM's max starts from the lowest finite float and its comparisons skip NaN: an all -inf row
    came out as -3.4e38 and [NaN, 2] as 2. One more pass over `x` classifies each slice (2: has
    a NaN; 0: all at the edge; 1: otherwise); the gradient still flows through max/min alone.
    """
    reduce = op.max if largest else op.min
    out = bb.emit(reduce(x, axes, keepdims=keepdims))
    if "float" not in _dtype(x):
        return out
    dtype = _dtype(x)
    edge = relax.const(-math.inf if largest else math.inf, dtype)
    code = bb.emit(op.where(_isnan(x), relax.const(2, "int8"),
                            op.where(op.equal(x, edge), relax.const(0, "int8"), relax.const(1, "int8"))))
    kind = bb.emit(op.max(code, axes, keepdims=keepdims))
    out = bb.emit(op.where(op.equal(kind, relax.const(0, "int8")), edge, out))
    return bb.emit(op.where(op.equal(kind, relax.const(2, "int8")), relax.const(math.nan, dtype), out))


def _first_extremum_index(bb: relax.BlockBuilder, x: relax.Expr, dim: int, largest: bool) -> relax.Expr:
    """int64 index of the first max (min) along `dim`, keepdims, as torch's argmax: the first
    NaN when there is one, the first element of an all -inf row.

    TVM's argmax starts from (-1, lowest finite float) and never moves off it on such rows: it
    returned -1, and `max.dim` then gathered another element's value. Here: the first position
    equal to the (NaN-aware) extremum, a min over positions.
    """
    if _dtype(x) == "bool":
        x = bb.emit(op.astype(x, "int8"))
    size = x.ty.shape.values[dim]
    best = _extremum(bb, x, [dim], True, largest)
    hit = op.equal(x, best)
    if "float" in _dtype(x):
        hit = op.where(_isnan(best), _isnan(x), hit)
    positions = bb.emit(op.reshape(op.arange(0, size, 1, "int64"),
                                   [size if i == dim else 1 for i in range(x.ty.ndim)]))
    # Every slice has a hit (its extremum is one of its elements), so the fill is never chosen.
    never = relax.const(np.iinfo(np.int64).max, "int64")
    return bb.emit(op.min(op.where(hit, positions, never), [dim], keepdims=True))


def extremum(largest: bool):
    """amax / amin over `dim` (all axes when empty)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        dims = list(_arg(node, 1, "dim", []) or [])
        keepdim = bool(_arg(node, 2, "keepdim", False))
        if x.ty.ndim == 0:
            return x
        data = bb.emit(op.astype(x, "int8")) if _dtype(x) == "bool" else x
        out = _extremum(bb, data, [int(d) for d in dims] or None, keepdim, largest)
        return bb.emit(op.astype(out, "bool")) if data is not x else out

    return convert


def sum_over_dims(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """sum(x, dims): a 0-d x (which torch lets name dim 0 or -1, as logsumexp does) is itself."""
    x = importer.env[node.args[0]]
    if x.ty.ndim != 0:
        return importer._sum(node)
    dtype = node.kwargs.get("dtype")
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
    elif "float" not in _dtype(x):
        dtype = "int64"  # torch sums bool and integer tensors in int64
    if dtype is None or dtype == _dtype(x):
        return x
    return importer.block_builder.emit(op.astype(x, dtype))


def arg_extremum(largest: bool):
    """argmax / argmin: the first extremum (`_first_extremum_index`); 0-d input: index 0 (TVM
    cannot reduce a 0-d tensor)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        if x.ty.ndim == 0:
            return relax.const(0, "int64")
        dim = _arg(node, 1, "dim", None)
        keepdim = bool(_arg(node, 2, "keepdim", False))
        if dim is None:  # over every element: of the flattened tensor
            index = _first_extremum_index(bb, bb.emit(op.reshape(x, [-1])), 0, largest)
            return bb.emit(op.reshape(index, [1] * x.ty.ndim if keepdim else []))
        dim = int(dim) % x.ty.ndim
        index = _first_extremum_index(bb, x, dim, largest)
        return index if keepdim else bb.emit(op.squeeze(index, axis=[dim]))

    return convert


def extremum_with_index(largest: bool):
    """max.dim / min.dim: (values, int64 indices of the first extremum)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        keepdim = bool(_arg(node, 2, "keepdim", False))
        if x.ty.ndim == 0:
            return bb.emit(relax.Tuple([x, relax.const(0, "int64")]))
        dim = int(node.args[1]) % x.ty.ndim
        return _pick(bb, x, _first_extremum_index(bb, x, dim, largest), dim, keepdim)

    return convert


def _root_zero_at_zero(x: relax.Expr, root: Callable[[relax.Expr], relax.Expr]) -> relax.Expr:
    """root(x) for x >= 0, with 0 (and a zero gradient) at x == 0: TVM's gradient of a root
    there is inf * 0 = NaN, and torch masks it to 0 (norms, distances). NaN stays NaN (the test
    is `x == 0`: `x > 0` sent a NaN sum to the 0 branch, and a norm of a row holding NaN came
    out 0)."""
    dtype = _dtype(x)
    zero = op.equal(x, relax.const(0, dtype))
    return op.where(zero, relax.const(0, dtype), root(op.where(zero, relax.const(1, dtype), x)))


def _power_of_nonnegative(x: relax.Expr, exponent: float) -> relax.Expr:
    """x ** exponent for x >= 0, 0 with a zero gradient at 0 (`_root_zero_at_zero`)."""
    return _root_zero_at_zero(x, lambda safe: op.power(safe, relax.const(exponent, _dtype(x))))


def _vector_norm(bb: relax.BlockBuilder, x: relax.Expr, order: float, axes: list[int] | None,
                 keepdim: bool) -> relax.Expr:
    """torch.linalg.vector_norm with torch's gradient at 0: zero, where the stock
    `sum(|x|^p)^(1/p)` gave NaN (the zero rows of `F.normalize`, `torch.dist(x, x)`)."""
    magnitude = bb.emit(op.abs(x))
    if order == math.inf or order == -math.inf:  # an all-inf slice is inf (TVM's min gave 3.4e38)
        return _extremum(bb, magnitude, axes, keepdim, largest=order > 0)
    if order == 0:
        return bb.emit(op.sum(op.astype(op.not_equal(x, relax.const(0, _dtype(x))), _dtype(x)), axes,
                              keepdims=keepdim))
    if order == 1:
        return bb.emit(op.sum(magnitude, axes, keepdims=keepdim))
    powered = op.multiply(x, x) if order == 2 else _power_of_nonnegative(magnitude, order)
    total = bb.emit(op.sum(powered, axes, keepdims=keepdim))
    return bb.emit(_power_of_nonnegative(total, 1.0 / order))


def vector_norm(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """linalg_vector_norm(x, ord, dim, keepdim, dtype=)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dtype = node.kwargs.get("dtype")
    if dtype is not None:
        x = bb.emit(op.astype(x, str(dtype).removeprefix("torch.")))
    order = float(_arg(node, 1, "ord", 2))
    dims = _arg(node, 2, "dim", None)
    if x.ty.ndim == 0:
        x, dims = bb.emit(op.reshape(x, [1])), None
    axes = [int(d) for d in dims] if dims else None
    out = _vector_norm(bb, x, order, axes, bool(_arg(node, 3, "keepdim", False)))
    return bb.emit(op.reshape(out, [])) if importer.env[node.args[0]].ty.ndim == 0 else out


def variance(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """var(x, dim, correction=c): the mean square deviation times n / (n - c), and where n - c
    <= 0 the sum of squares over 0 as in torch (inf, NaN for a constant slice: the stock
    converter made every such slice NaN)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dims = _arg(node, 1, "dim", None)
    correction = node.kwargs.get("correction")
    correction = 1 if correction is None else correction
    var = bb.emit(op.variance(x, dims, keepdims=bool(node.kwargs.get("keepdim", False))))
    if correction == 0:
        return var
    n = importer._reduction_size(x, dims)
    if n is None:
        shape = getattr(x.ty, "shape", None)
        if shape is None:
            return importer._var_correction(node)  # (it says what it cannot do)
        return bb.emit(op.multiply(var, _symbolic_correction(bb, shape, dims, correction, x.ty.dtype.dtype)))
    scale = float(n) / float(n - correction) if n - correction > 0 else math.inf
    return bb.emit(op.multiply(var, relax.const(scale, x.ty.dtype.dtype)))


def _symbolic_correction(bb: relax.BlockBuilder, shape: relax.ShapeExpr, dims: object, correction: float,
                         dtype: str) -> relax.Expr:
    """n / max(n - correction, 0) as a 0-d tensor, n the symbolic count of reduced elements (a
    dynamic batch: `x.var(0)`, refused before; symbolic_scalars.counted). Where n - correction
    <= 0 it is inf, as the static scale."""
    axes = range(len(shape)) if not dims else [int(d) % len(shape) for d in dims]
    n = symbolic_scalars.counted(bb, functools.reduce(operator.mul, [shape[a] for a in axes]), dtype)
    kept = op.maximum(op.subtract(n, relax.const(float(correction), dtype)), relax.const(0.0, dtype))
    return bb.emit(op.divide(n, kept))


def var_mean(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(var, mean): `variance` (it reads the same arguments) and a mean."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dims = _arg(node, 1, "dim", None)
    keepdim = bool(node.kwargs.get("keepdim", False))
    var = variance(node, importer)
    mean = bb.emit(op.mean(x, [int(d) for d in dims] if dims else None, keepdims=keepdim))
    return bb.emit(relax.Tuple([var, mean]))


def median(ignore_nan: bool):
    """median / nanmedian, (values, indices) along dim or one value over all elements: the lower
    median. median: NaN (at the slice's first NaN) where the slice holds one; nanmedian: of the
    non-NaN values (NaN, index 0, where all are NaN). Over all elements, the gradient is shared
    among the ties, as in torch."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        with_dim = node.target.__name__.endswith(".dim")
        if x.ty.ndim == 0:
            return bb.emit(relax.Tuple([x, relax.const(0, "int64")])) if with_dim else x
        data = x if with_dim else bb.emit(op.reshape(x, [-1]))
        dim = int(node.args[1]) % x.ty.ndim if with_dim else 0
        keepdim = bool(_arg(node, 2, "keepdim", False))
        length = _static_dim(data, node.target.__name__, dim)
        one, zero = relax.const(1, "int64"), relax.const(0, "int64")
        if "float" not in _dtype(x):
            index = _sorted_index(bb, data, dim, (length - 1) // 2)
        elif ignore_nan:  # NaN sorts last: the median of the first `count`
            nan = bb.emit(_isnan(data))
            count = bb.emit(op.sum(op.astype(op.logical_not(nan), "int64"), [dim], keepdims=True))
            position = bb.emit(op.maximum(op.floor_divide(op.subtract(count, one), relax.const(2, "int64")), zero))
            index = _sorted_index(bb, data, dim, position)
            index = bb.emit(op.where(op.greater(count, zero), index, op.zeros_like(index)))
        else:
            nan = bb.emit(op.astype(_isnan(data), "int8"))
            first_nan = bb.emit(op.astype(op.argmax(nan, dim, keepdims=True), "int64"))
            index = _sorted_index(bb, data, dim, (length - 1) // 2)
            index = bb.emit(op.where(op.greater(op.max(nan, [dim], keepdims=True), relax.const(0, "int8")),
                                     first_nan, index))
        if with_dim:
            return _pick(bb, x, index, dim, keepdim)
        return _shared_by_ties(bb, data, bb.emit(op.take(data, op.reshape(index, []), axis=0)))

    return convert


def _shared_by_ties(bb: relax.BlockBuilder, flat: relax.Expr, value: relax.Expr) -> relax.Expr:
    """`value` (an element of 1-D `flat`), with the gradient shared evenly among the elements
    equal to it (torch's evenly_distribute_backward): the max of those elements."""
    dtype = _dtype(flat)
    if "float" not in dtype:
        return value
    ties = bb.emit(op.equal(flat, value))
    masked = bb.emit(op.where(ties, flat, relax.const(-math.inf, dtype)))
    return bb.emit(op.where(_isnan(value), value, op.max(masked)))


def mode(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(most frequent value along dim, the smallest such on ties; index of its last occurrence),
    counted by comparing every pair (quadratic in the length of dim)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    keepdim = bool(_arg(node, 2, "keepdim", False))
    if x.ty.ndim == 0:
        return bb.emit(relax.Tuple([x, relax.const(0, "int64")]))
    dim = int(_arg(node, 1, "dim", -1)) % x.ty.ndim
    n = _static_dim(x, "mode", dim)
    ordered = bb.emit(op.astype(x, "uint8")) if _dtype(x) == "bool" else x  # TVM: no min or == of bool
    dtype = _dtype(ordered)
    pairs = bb.emit(op.equal(op.expand_dims(ordered, dim + 1), op.expand_dims(ordered, dim)))
    counts = bb.emit(op.sum(op.astype(pairs, "int64"), [dim + 1]))
    best = bb.emit(op.equal(counts, op.max(counts, [dim], keepdims=True)))
    # _extremum: a mode of +inf is inf (TVM's min starts from the largest finite float)
    value = _extremum(bb, op.where(best, ordered, relax.const(_lowest(dtype, False), dtype)), [dim], True, False)
    positions = relax.const(np.arange(n).reshape([n] + [1] * (x.ty.ndim - dim - 1)), "int64")
    at_value = bb.emit(op.logical_and(best, op.equal(ordered, value)))
    index = bb.emit(op.max(op.where(at_value, positions, relax.const(-1, "int64")), [dim], keepdims=True))
    return _pick(bb, x, index, dim, keepdim)


def _cum_extremum_index(bb: relax.BlockBuilder, x: relax.Expr, dim: int, largest: bool) -> relax.Expr:
    """Index of the running max (min) along `dim`: its last occurrence so far, or the last NaN so
    far (torch's cummax/cummin), from a prefix mask over every pair (i, j <= i)."""
    n = _static_dim(x, "cummax", dim)
    dtype = _dtype(x)
    trailing = [1] * (x.ty.ndim - dim - 1)
    prefix = relax.const(np.tril(np.ones((n, n), dtype=bool)).reshape([n, n] + trailing), "bool")
    positions = relax.const(np.arange(n).reshape([n] + trailing), "int64")  # along j
    earlier = bb.emit(op.expand_dims(x, dim))  # x_j, broadcast over i
    # _extremum: a prefix of -inf (cummax) is -inf, not TVM's lowest finite float, which no x_j equals
    best = _extremum(bb, op.where(prefix, earlier, relax.const(_lowest(dtype, largest), dtype)), [dim + 1], True,
                     largest)

    def last(hit: relax.Expr) -> relax.Expr:
        return bb.emit(op.max(op.where(op.logical_and(prefix, hit), positions, relax.const(-1, "int64")), [dim + 1]))

    last_best = last(op.equal(earlier, best))
    if "float" not in dtype:
        return last_best
    last_nan = last(_isnan(earlier))
    return bb.emit(op.where(op.greater_equal(last_nan, relax.const(0, "int64")), last_nan, last_best))


def cum_extremum(largest: bool):
    """cummax / cummin: (values, indices), the values gathered at the indices."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        x = importer.env[node.args[0]]
        if x.ty.ndim == 0:
            return bb.emit(relax.Tuple([x, relax.const(0, "int64")]))
        dim = int(node.args[1]) % x.ty.ndim
        data = bb.emit(op.astype(x, "int8")) if _dtype(x) == "bool" else x  # bool has no lowest value
        index = _cum_extremum_index(bb, data, dim, largest)
        return bb.emit(relax.Tuple([bb.emit(op.gather_elements(x, index, axis=dim)), index]))

    return convert


def logcumsumexp(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """log(cumsum(exp(x))) along dim, as a logsumexp of each prefix (a masked square)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    if x.ty.ndim == 0:
        return x
    dim = int(node.args[1]) % x.ty.ndim
    n = _static_dim(x, "logcumsumexp", dim)
    dtype = _dtype(x)
    rows = bb.emit(op.expand_dims(x, dim))  # [..., 1 (i), n (j), ...]
    prefix = np.tril(np.ones((n, n), dtype=bool)).reshape([n, n] + [1] * (x.ty.ndim - dim - 1))
    masked = bb.emit(op.where(relax.const(prefix, "bool"), rows, relax.const(-math.inf, dtype)))
    top = bb.emit(op.max(masked, [dim + 1], keepdims=True))
    top = bb.emit(op.where(op.isfinite(top), top, op.zeros_like(top)))
    total = bb.emit(op.sum(op.exp(op.subtract(masked, top)), [dim + 1], keepdims=True))
    return bb.emit(op.squeeze(op.add(op.log(total), top), axis=[dim + 1]))


# ---- scatters ----

def _scatter_reduce(bb: relax.BlockBuilder, x: relax.Expr, dim: int, index: relax.Expr, src: relax.Expr,
                    reduce: str, include_self: bool) -> relax.Expr:
    """torch's scatter_reduce(x, dim, index, src, reduce, include_self) for a full-size index."""
    dtype = _dtype(x)
    shape = _static_shape(x, "scatter_reduce")

    def scattered(base: relax.Expr, updates: relax.Expr, reduction: str) -> relax.Expr:
        return bb.emit(op.scatter_elements(base, index, updates, axis=dim, reduction=reduction))

    ones = relax.const(np.ones(_static_shape(index, "scatter_reduce")), dtype)
    if not include_self or reduce == "mean":
        count = scattered(relax.const(np.full(shape, int(include_self)), dtype), ones, "add")
    if not include_self:
        identity = {"sum": 0, "mean": 0, "prod": 1, "amax": _lowest(dtype, True), "amin": _lowest(dtype, False)}
        hit = bb.emit(op.greater(count, relax.const(0, dtype)))
        x = bb.emit(op.where(hit, relax.const(identity[reduce], dtype), x))
    reduction = {"sum": "add", "mean": "add", "prod": "mul", "amax": "max", "amin": "min"}[reduce]
    out = scattered(x, src, reduction)
    if reduce != "mean":
        return out
    count = bb.emit(op.maximum(count, relax.const(1, dtype)))
    return bb.emit(op.divide(out, count) if "float" in dtype else op.floor_divide(out, count))


def _src_like_index(bb: relax.BlockBuilder, src: relax.Expr, index: relax.Expr) -> relax.Expr:
    """src cut to the index's shape (torch uses only that corner of a larger src)."""
    src_shape, index_shape = _static_shape(src, "scatter"), _static_shape(index, "scatter")
    if src_shape == index_shape:
        return src
    return bb.emit(op.strided_slice(src, axes=list(range(len(index_shape))), begin=[0] * len(index_shape),
                                    end=index_shape))


def _clamped_index(bb: relax.BlockBuilder, index: relax.Expr, size: int) -> relax.Expr:
    """Indices clamped into the tensor (TOPI's scatter does not check them), negative ones wrapped."""
    index = bb.emit(op.where(op.less(index, relax.const(0, _dtype(index))),
                             op.add(index, relax.const(size, _dtype(index))), index))
    return bb.emit(op.clip(index, 0, size - 1))


def scatter_reduce(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """scatter_add(x, dim, index, src) and scatter_reduce(x, dim, index, src, reduce, include_self)."""
    bb = importer.block_builder
    x, index, src = importer.env[node.args[0]], importer.env[node.args[2]], importer.env[node.args[3]]
    squeezed = x.ty.ndim == 0
    if squeezed:
        x, index, src = (bb.emit(op.reshape(v, [1])) for v in (x, index, src))
    dim = int(node.args[1]) % x.ty.ndim
    index = _clamped_index(bb, index, _static_shape(x, "scatter")[dim])
    src = _src_like_index(bb, src, index)
    if node.target.__name__ == "scatter_add.default":
        reduce, include_self = "sum", True
    else:
        reduce, include_self = str(node.args[4]), bool(_arg(node, 5, "include_self", True))
    if _dtype(x) == "bool":  # TVM's scatter kernels take no bool: or (and) is max (min) of 0/1
        x, src = (bb.emit(op.astype(v, "uint8")) for v in (x, src))
        reduce = {"sum": "amax", "prod": "amin"}.get(reduce, reduce)
        out = bb.emit(op.not_equal(_scatter_reduce(bb, x, dim, index, src, reduce, include_self),
                                   relax.const(0, "uint8")))
    else:
        out = _scatter_reduce(bb, x, dim, index, src, reduce, include_self)
    return bb.emit(op.reshape(out, [])) if squeezed else out


def index_reduce(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """index_reduce(x, dim, index, source, reduce, include_self): a scatter_reduce whose index is
    the 1-D index broadcast over source."""
    bb = importer.block_builder
    x, index, src = importer.env[node.args[0]], importer.env[node.args[2]], importer.env[node.args[3]]
    reduce, include_self = str(node.args[4]), bool(_arg(node, 5, "include_self", True))
    squeezed = x.ty.ndim == 0
    if squeezed:
        x, src = (bb.emit(op.reshape(v, [1])) for v in (x, src))
    dim = int(node.args[1]) % x.ty.ndim
    src_shape = _static_shape(src, "index_reduce")
    index = bb.emit(op.astype(index, "int64"))
    index = bb.emit(op.reshape(index, [-1] + [1] * (len(src_shape) - dim - 1)))
    index = _clamped_index(bb, bb.emit(op.broadcast_to(index, src_shape)), _static_shape(x, "index_reduce")[dim])
    out = _scatter_reduce(bb, x, dim, index, src, reduce, include_self)
    return bb.emit(op.reshape(out, [])) if squeezed else out


def masked_scatter(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x where mask is false; the next element of source (in row-major order) where it is true."""
    bb = importer.block_builder
    x, mask, source = (importer.env[a] for a in node.args[:3])
    shape = list(np.broadcast_shapes(tuple(_static_shape(x, "masked_scatter")), tuple(_static_shape(mask, "masked_scatter"))))
    x = bb.emit(op.broadcast_to(x, shape)) if _static_shape(x, "") != shape else x
    mask = bb.emit(op.broadcast_to(mask, shape)) if _static_shape(mask, "") != shape else mask
    flat_mask = bb.emit(op.reshape(mask, [-1]))
    position = bb.emit(op.subtract(op.cumsum(op.astype(flat_mask, "int64"), axis=0), relax.const(1, "int64")))
    # An empty source (nothing is masked) still needs an element for take to read.
    flat_source = bb.emit(op.reshape(source, [-1])) if math.prod(_static_shape(source, "masked_scatter")) else \
        bb.emit(op.zeros([1], _dtype(source)))
    picked = bb.emit(op.take(flat_source, position, axis=0, mode="clip"))
    return bb.emit(op.where(mask, op.reshape(picked, shape), x))


def searchsorted(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """searchsorted(sorted_sequence, values, out_int32, right, side, sorter) with TOPI's kernel;
    a NaN value's index is the sequence's length, as torch's (its search advances unless
    `sorted[mid] >= value`)."""
    bb = importer.block_builder
    sequence = importer.env[node.args[0]]
    values = _env(importer, node.args[1])
    if values is None:
        values = relax.const(node.args[1], _dtype(sequence))
    right = bool(node.kwargs.get("right", False)) or node.kwargs.get("side") == "right"
    dtype = "int32" if node.kwargs.get("out_int32", False) else "int64"
    sorter = _env(importer, node.kwargs.get("sorter"))
    if sorter is not None:
        sequence = bb.emit(op.gather_elements(sequence, sorter, axis=-1))
    return _search(bb, sequence, values, right, dtype)


def bucketize(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """bucketize(input, boundaries, out_int32, right): searchsorted(boundaries, input, right)."""
    bb = importer.block_builder
    values = _env(importer, node.args[0])
    if values is None:
        values = relax.const(node.args[0], _dtype(importer.env[node.args[1]]))
    dtype = "int32" if _arg(node, 2, "out_int32", False) else "int64"
    return _search(bb, importer.env[node.args[1]], values, bool(_arg(node, 3, "right", False)), dtype)


def _search(bb: relax.BlockBuilder, sequence: relax.Expr, values: relax.Expr, right: bool, dtype: str) -> relax.Expr:
    """TOPI's searchsorted, a NaN value's index set to the sequence's length."""
    if _static_shape(sequence, "searchsorted")[-1] == 0:  # nothing to search: every value goes first
        return bb.emit(op.zeros(_static_shape(values, "searchsorted"), dtype))
    squeezed = values.ty.ndim == 0
    if squeezed:
        values = bb.emit(op.reshape(values, [1]))
    if _dtype(values) != _dtype(sequence):
        values = bb.emit(op.astype(values, _dtype(sequence)))
    out = bb.emit_te(topi.searchsorted, sequence, values, right, dtype)
    if "float" in _dtype(values):  # NaN goes last, as in torch (TOPI's `<` put it first)
        count = relax.const(_static_shape(sequence, "searchsorted")[-1], dtype)
        out = bb.emit(op.where(_isnan(values), count, out))
    return bb.emit(op.reshape(out, [])) if squeezed else out


def repeat_interleave_indices(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """repeat_interleave(repeats, output_size=N) (what `x.repeat_interleave(repeats_tensor, dim,
    output_size=N)` becomes: this, then index_select): each i repeated repeats[i] times, the
    number of running totals of `repeats` at or below each position 0..N-1. Without output_size
    the length is the sum of the values, which a compiled program cannot know in advance."""
    size = node.kwargs.get("output_size")
    if not isinstance(size, int):
        raise NotImplementedError("repeat_interleave with a tensor of repeats: its length is the sum of the "
                                  "repeats; pass output_size= (that sum) to repeat_interleave")
    bb = importer.block_builder
    repeats = importer.env[node.args[0]]
    dtype = _dtype(repeats)
    totals = bb.emit(relax.op.cumsum(repeats, axis=0))
    positions = bb.emit(relax.op.arange(0, size, 1, dtype))
    return _search(bb, totals, positions, True, dtype)


def nonzero_static(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """The first `size` coordinates of nonzero elements (row-major), padded with fill_value."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    size = int(node.kwargs.get("size", node.args[1] if len(node.args) > 1 else 0))
    fill = int(node.kwargs.get("fill_value", -1))
    shape = _static_shape(x, "nonzero_static")
    numel = math.prod(shape)
    flat = bb.emit(op.reshape(x, [-1]))
    nonzero = flat if _dtype(x) == "bool" else bb.emit(op.not_equal(flat, relax.const(0, _dtype(x))))
    rank = bb.emit(op.subtract(op.cumsum(op.astype(nonzero, "int64"), axis=0), relax.const(1, "int64")))
    slots = relax.const(np.arange(size).reshape(size, 1), "int64")
    chosen = bb.emit(op.logical_and(op.expand_dims(nonzero, 0), op.equal(op.expand_dims(rank, 0), slots)))
    flat = bb.emit(op.sum(op.multiply(op.astype(chosen, "int64"),
                                      relax.const(np.arange(numel), "int64")), [1], keepdims=True))
    found = bb.emit(op.max(op.astype(chosen, "int8"), [1], keepdims=True))
    strides = np.array(_contiguous_strides(shape), dtype="int64")
    coords = bb.emit(op.mod(op.floor_divide(flat, relax.const(strides, "int64")),
                            relax.const(np.array(shape), "int64")))
    return bb.emit(op.where(op.astype(found, "bool"), coords, relax.const(fill, "int64")))


# ---- strided views ----

def _strided_positions(size: list[int], stride: list[int], offset: int) -> np.ndarray:
    """The storage position of every element of an as_strided view, in its row-major order."""
    positions = np.full(size, offset, dtype="int64")
    for axis, (n, s) in enumerate(zip(size, stride)):
        positions += (np.arange(n, dtype="int64") * s).reshape([n] + [1] * (len(size) - axis - 1))
    return positions


def _contiguous_strides(shape: list[int]) -> list[int]:
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _storage_positions(node: torch.fx.Node, x: relax.Expr, at: int) -> np.ndarray:
    size, stride = [int(v) for v in node.args[at]], [int(v) for v in node.args[at + 1]]
    offset = int(_arg(node, at + 2, "storage_offset", 0) or 0)
    positions = _strided_positions(size, stride, offset)
    numel = math.prod(_static_shape(x, "as_strided"))
    if positions.size and (positions.max() >= numel or positions.min() < 0):
        raise NotImplementedError("as_strided reads outside the (contiguous) input tensor")
    return positions


def as_strided(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.as_strided(size, stride, offset) over x's contiguous storage: a take of constant positions."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    positions = _storage_positions(node, x, 1)
    contiguous = _strided_positions(list(positions.shape), _contiguous_strides(list(positions.shape)), 0)
    if np.array_equal(positions, contiguous) and positions.size == math.prod(_static_shape(x, "as_strided")):
        return bb.emit(op.reshape(x, list(positions.shape)))
    flat = bb.emit(op.reshape(x, [-1]))
    picked = bb.emit(op.take(flat, relax.const(positions.reshape(-1), "int64"), axis=0, mode="clip"))
    return bb.emit(op.reshape(picked, list(positions.shape)))


def _scatter_positions(bb: relax.BlockBuilder, x: relax.Expr, src: relax.Expr, positions: np.ndarray) -> relax.Expr:
    """x (contiguous) with the storage `positions` replaced by src's elements, in order."""
    numel = math.prod(_static_shape(x, "scatter"))
    source = np.zeros(numel, dtype="int64")
    hit = np.zeros(numel, dtype=bool)
    source[positions.reshape(-1)] = np.arange(positions.size)
    hit[positions.reshape(-1)] = True
    flat_src = bb.emit(op.reshape(src, [-1]))
    picked = bb.emit(op.take(flat_src, relax.const(source, "int64"), axis=0, mode="clip")) if positions.size else \
        bb.emit(op.reshape(x, [-1]))
    out = bb.emit(op.where(relax.const(hit, "bool"), picked, op.reshape(x, [-1])))
    return bb.emit(op.reshape(out, _static_shape(x, "scatter")))


def as_strided_scatter(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x with its as_strided(size, stride, offset) view replaced by src."""
    x, src = importer.env[node.args[0]], importer.env[node.args[1]]
    return _scatter_positions(importer.block_builder, x, src, _storage_positions(node, x, 2))


def diagonal_scatter(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x with its diagonal(offset, dim1, dim2) replaced by src."""
    x, src = importer.env[node.args[0]], importer.env[node.args[1]]
    shape = _static_shape(x, "diagonal_scatter")
    rank = len(shape)
    offset = int(_arg(node, 2, "offset", 0))
    dim1, dim2 = int(_arg(node, 3, "dim1", 0)) % rank, int(_arg(node, 4, "dim2", 1)) % rank
    strides = _contiguous_strides(shape)
    length = max(0, min(shape[dim1] - max(-offset, 0), shape[dim2] - max(offset, 0)))
    rest = [i for i in range(rank) if i not in (dim1, dim2)]
    start = offset * strides[dim2] if offset >= 0 else -offset * strides[dim1]
    positions = _strided_positions([shape[i] for i in rest] + [length],
                                   [strides[i] for i in rest] + [strides[dim1] + strides[dim2]], start)
    return _scatter_positions(importer.block_builder, x, src, positions)


def unfold(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.unfold(dim, size, step): windows along dim, each window's elements in a new last axis."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    size, step = int(node.args[2]), int(node.args[3])
    if x.ty.ndim == 0:
        return bb.emit(op.broadcast_to(op.reshape(x, [1]), [size]))
    dim = int(node.args[1]) % x.ty.ndim
    n = _static_shape(x, "unfold")[dim]
    windows = (n - size) // step + 1
    index = np.arange(windows, dtype="int64")[:, None] * step + np.arange(size, dtype="int64")[None, :]
    taken = bb.emit(op.take(x, relax.const(index, "int64"), axis=dim, mode="clip"))  # [..., windows, size, ...]
    order = [i for i in range(x.ty.ndim + 1) if i != dim + 1] + [dim + 1]
    return bb.emit(op.permute_dims(taken, order))


# ---- products and distances ----

def addbmm(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """beta * input + alpha * sum_b(batch1[b] @ batch2[b])."""
    bb = importer.block_builder
    bias, a, b = (importer.env[v] for v in node.args[:3])
    alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
    dtype = _dtype(a)
    product = bb.emit(op.sum(op.matmul(a, b, out_dtype=dtype), [0]))
    if alpha != 1:
        product = bb.emit(op.multiply(product, relax.const(alpha, dtype)))
    if beta == 0:
        return bb.emit(op.broadcast_to(product, _static_shape(bias, "addbmm"))) if bias.ty.ndim == 2 else product
    if beta != 1:
        bias = bb.emit(op.multiply(bias, relax.const(beta, dtype)))
    return bb.emit(op.add(bias, product))


def trilinear(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim): the three inputs unsqueezed at
    their expand dims, multiplied, summed over sumdim."""
    bb = importer.block_builder
    inputs = [importer.env[v] for v in node.args[:3]]
    expanded = []
    for x, dims in zip(inputs, node.args[3:6]):
        for d in sorted(int(d) for d in dims):
            x = op.expand_dims(x, d)
        expanded.append(x)
    product = bb.emit(op.multiply(op.multiply(expanded[0], expanded[1]), expanded[2]))
    sumdim = [int(d) for d in node.args[6]]
    return bb.emit(op.sum(product, sumdim)) if sumdim else product


def _p_norm(bb: relax.BlockBuilder, diff: relax.Expr, p: float) -> relax.Expr:
    """The p-norm over the last axis, with torch's zero gradient where the norm is 0 (and, for
    p < 1, where a difference is 0)."""
    dtype = _dtype(diff)
    if p == 0:
        return bb.emit(op.sum(op.astype(op.not_equal(diff, relax.const(0, dtype)), dtype), [-1]))
    magnitude = bb.emit(op.abs(diff))
    if p == 1:
        return bb.emit(op.sum(magnitude, [-1]))
    if math.isinf(p):
        return _extremum(bb, magnitude, [-1], False, largest=True)
    if p == 2:
        powered = bb.emit(op.multiply(diff, diff))
    elif p < 1:  # |d| ** p has an infinite slope at d == 0, where torch's gradient is 0
        powered = bb.emit(_power_of_nonnegative(magnitude, p))
    else:
        powered = bb.emit(op.power(magnitude, relax.const(p, dtype)))
    total = bb.emit(op.sum(powered, [-1]))
    return bb.emit(_root_zero_at_zero(
        total, lambda safe: op.sqrt(safe) if p == 2 else op.power(safe, relax.const(1.0 / p, dtype))))


def cdist(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """_cdist_forward(x1 [.., P, M], x2 [.., R, M], p): every pairwise p-distance [.., P, R]."""
    bb = importer.block_builder
    x1, x2 = importer.env[node.args[0]], importer.env[node.args[1]]
    diff = bb.emit(op.subtract(op.expand_dims(x1, -2), op.expand_dims(x2, -3)))
    return _p_norm(bb, diff, float(node.args[2]))


def pdist(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """_pdist_forward(x [N, M], p): the p-distance of rows i < j, in row-major order of (i, j)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    n = _static_shape(x, "pdist")[0]
    pairs = np.array(list(itertools.combinations(range(n), 2)), dtype="int64").reshape(-1, 2)
    if not len(pairs):
        return bb.emit(op.zeros([0], _dtype(x)))
    first, second = (bb.emit(op.take(x, relax.const(pairs[:, i].copy(), "int64"), axis=0)) for i in (0, 1))
    return _p_norm(bb, bb.emit(op.subtract(first, second)), float(_arg(node, 1, "p", 2.0)))


def embedding_bag(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """_embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
    per_sample_weights, include_last_offset, padding_idx): the bags' sum, mean or max (empty
    bags give 0), as a bag-membership mask times the looked-up rows."""
    bb = importer.block_builder
    for i in (1, 2, 3):
        if _used(node, i):
            raise NotImplementedError("only the bags' values (output 0) of an embedding bag are supported")
    weight, indices, offsets = (importer.env[v] for v in node.args[:3])
    mode = int(_arg(node, 4, "mode", 0))
    if bool(_arg(node, 3, "scale_grad_by_freq", False)):
        raise NotImplementedError("embedding_bag with scale_grad_by_freq")
    per_sample = _env(importer, _arg(node, 6, "per_sample_weights", None))
    include_last = bool(_arg(node, 7, "include_last_offset", False))
    padding_idx = _arg(node, 8, "padding_idx", -1)
    padding_idx = -1 if padding_idx is None else int(padding_idx)
    dtype = _dtype(weight)
    length = _static_shape(indices, "embedding_bag")[0]
    bags = _static_shape(offsets, "embedding_bag")[0] - int(include_last)
    offsets = bb.emit(op.astype(offsets, "int64"))
    starts = bb.emit(op.strided_slice(offsets, axes=[0], begin=[0], end=[bags]))
    if include_last:
        ends = bb.emit(op.strided_slice(offsets, axes=[0], begin=[1], end=[bags + 1]))
    else:
        ends = bb.emit(op.concat([op.strided_slice(offsets, axes=[0], begin=[1], end=[bags]),
                                  relax.const(np.array([length]), "int64")], axis=0))
    positions = relax.const(np.arange(length).reshape(1, length), "int64")
    member = bb.emit(op.logical_and(op.greater_equal(positions, op.expand_dims(starts, 1)),
                                    op.less(positions, op.expand_dims(ends, 1))))  # [bags, length]
    ids = bb.emit(op.astype(indices, "int64"))
    if padding_idx >= 0:
        kept = bb.emit(op.not_equal(ids, relax.const(padding_idx, "int64")))
        member = bb.emit(op.logical_and(member, op.expand_dims(kept, 0)))
    rows = bb.emit(op.take(weight, ids, axis=0, mode="clip"))  # [length, dim]
    if per_sample is not None:
        rows = bb.emit(op.multiply(rows, op.expand_dims(per_sample, 1)))
    weights = bb.emit(op.where(member, relax.const(1, dtype), relax.const(0, dtype)))
    count = bb.emit(op.sum(weights, [1], keepdims=True))
    if mode == 2:
        # Each bag's maximum read at its first position (argmax), as eager's `max_indices`: the
        # gradient goes to that row alone; a `max` would share it between tied rows.
        candidates = bb.emit(op.where(op.expand_dims(member, 2), op.expand_dims(rows, 0),
                                      relax.const(-math.inf, dtype)))
        first = _first_extremum_index(bb, candidates, 1, True)  # TVM's argmax: -1 for an all -inf bag
        best = bb.emit(op.squeeze(op.gather_elements(candidates, first, axis=1), [1]))
        out = bb.emit(op.where(op.greater(count, relax.const(0, dtype)), best, relax.const(0, dtype)))
    else:
        out = bb.emit(op.matmul(weights, rows, out_dtype=dtype))
        if mode == 1:
            out = bb.emit(op.divide(out, op.maximum(count, relax.const(1, dtype))))
    return bb.emit(relax.Tuple([out, out, out, out]))


def prod_dim(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """prod(x, dim, keepdim) (its `dtype=` is type_promotion's: the input is cast first)."""
    return stock_converter(importer, "prod.default")(node)


CONVERTERS = {
    "prod.dim_int": prod_dim,
    "amax.default": extremum(True),
    "amin.default": extremum(False),
    "max.default": extremum(True),  # x.max(): over every element
    "min.default": extremum(False),
    "sum.dim_IntList": sum_over_dims,
    "argmax.default": arg_extremum(True),
    "argmin.default": arg_extremum(False),
    "max.dim": extremum_with_index(True),
    "min.dim": extremum_with_index(False),
    "var_mean.correction": var_mean,
    "var.correction": variance,
    "linalg_vector_norm.default": vector_norm,
    "ne.Tensor": self_comparison("ne.Tensor"),
    "eq.Tensor": self_comparison("eq.Tensor"),
    "le.Tensor": self_comparison("le.Tensor"),
    "ge.Tensor": self_comparison("ge.Tensor"),
    "median.default": median(ignore_nan=False),
    "median.dim": median(ignore_nan=False),
    "nanmedian.default": median(ignore_nan=True),
    "nanmedian.dim": median(ignore_nan=True),
    "mode.default": mode,
    "cummax.default": cum_extremum(True),
    "cummin.default": cum_extremum(False),
    "logcumsumexp.default": logcumsumexp,
    "scatter_add.default": scatter_reduce,
    "scatter_reduce.two": scatter_reduce,
    "index_reduce.default": index_reduce,
    "masked_scatter.default": masked_scatter,
    "searchsorted.Tensor": searchsorted,
    "searchsorted.Scalar": searchsorted,
    "bucketize.Tensor": bucketize,
    "bucketize.Scalar": bucketize,
    "nonzero_static.default": nonzero_static,
    "repeat_interleave.Tensor": repeat_interleave_indices,
    "as_strided.default": as_strided,
    "as_strided_copy.default": as_strided,
    "as_strided_scatter.default": as_strided_scatter,
    "diagonal_scatter.default": diagonal_scatter,
    "unfold.default": unfold,
    "addbmm.default": addbmm,
    "_trilinear.default": trilinear,
    "_cdist_forward.default": cdist,
    "_pdist_forward.default": pdist,
    "_embedding_bag.default": embedding_bag,
    "_embedding_bag_forward_only.default": embedding_bag,
}

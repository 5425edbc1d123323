"""Converters for pooling, interpolation, normalization and grid sampling, where TVM 0.27's stock
ones give silently wrong numbers (each found against torch eager; tests/numeric/test_silent_ops.py).

- `max_pool{2,3}d_with_indices` (also `max_pool1d`, which decomposes to the 2-D op): the stock
  converter returns float zeros as the indices. Here they are int64 and point, as in torch, at
  the first maximum of each window, counted in the flattened input plane (a window holding
  NaN points at its first NaN, torch at its last).
- `avg_pool{2,3}d` with `divisor_override` or `ceil_mode`: the stock converter ignores
  `divisor_override` (divides by the window size), and TVM's gradient of a ceil-mode pool
  divides the clipped last windows wrongly. Here both are a floor-mode window sum times
  torch's divisors (a constant map).
- `grid_sampler_2d`: TVM's `grid_sample` reads the grid as (N, 2, H, W), torch's is
  (N, H, W, 2); the stock converter passes it unchanged (wrong shape and values). Bicubic is
  refused (TVM's cubic kernel differs from torch's).
- `_upsample_bilinear2d_aa` (`interpolate(..., antialias=True)`): the stock converter drops the
  anti-aliasing. Here it is torch's separable triangle filter, written as two matmuls with
  constant weight matrices (so its gradient is the transposed matmuls).
- `upsample_nearest2d`: the stock converter rounds half-pixel centres (`nearest-exact`); torch's
  `nearest` takes `floor(dst * in / out)` in float32. Here it is two `take`s with those indices;
  1-D and 3-D and `nearest-exact` too (torch's decompositions of those index with broadcast
  index tensors: a CompileError in 3-D).
- `upsample_bilinear2d` given a scale factor: the stock resize maps positions by in / out where
  torch uses 1 / scale_factor (`scale_factor=1.7`: wrong pixels), and computes them in float32
  (float64 off by 1e-7). Those cases are `take`s of the neighbours blended by constant weights.
- `native_layer_norm`, `native_group_norm`: the stock converters return only the normalized
  output, so the saved mean and rstd (outputs 1 and 2) were that output again; a group norm
  without weight or bias crashed.
- `adaptive_max_pool{2,3}d`, `grid_sampler_3d`, the chunked `linear_cross_entropy` custom ops:
  no stock converter. `im2col` (`F.unfold`), `upsample_linear1d`, `upsample_trilinear3d` (kept
  whole by lowering.decompose): torch's decompositions index with broadcast index tensors, which
  the stock `index.Tensor` converter rejects. Each is written with ops that have Relax
  gradients (docs/gradients.md).
- `_safe_softmax` (kept whole by lowering.decompose): torch's decomposition has a NaN gradient
  on fully masked rows.
- `_softmax`, `_log_softmax` with `half_to_float` (what CUDA autocast makes of a float16
  softmax: `softmax(x, dim, dtype=float32)` of a CUDA half tensor becomes
  `_softmax(x, dim, True)`): the stock converters ignore the flag and compute in float16,
  returning float16 where torch returns float32 (a float16 AMP loss on CUDA rounded to float16).
- `_native_batch_norm_legit_no_training` in float16/bfloat16: the stock result is float32.
  Here it computes in float32 (as torch does) and returns the input's dtype.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence

import numpy as np
import torch
import tvm
from tvm import relax, te
from tvm import tirx as tir
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import stop_gradient

_HALF = ("float16", "bfloat16")


def _arg(node: torch.fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _dtype(expr: relax.Expr) -> str:
    return expr.ty.dtype.dtype


def result_dtype(node: torch.fx.Node) -> str:
    """The dtype torch gives `node`'s result (`float32`), read from the traced value."""
    return str(node.meta["val"].dtype).removeprefix("torch.")


def operand(importer: ExportedProgramImporter, value: object, dtype: str) -> relax.Expr:
    """An op's argument: a traced tensor's Relax value, or a Python number as a `dtype` constant."""
    return importer.env[value] if isinstance(value, torch.fx.Node) else relax.const(value, dtype)


def as_dtype(bb: relax.BlockBuilder, x: relax.Expr, dtype: str) -> relax.Expr:
    """x in `dtype` (x itself when it is already)."""
    return x if x.ty.dtype.dtype == dtype else bb.emit(relax.op.astype(x, dtype))


def isnan(x: relax.Expr) -> relax.Expr:
    """isnan for every float dtype: TVM's rejects bfloat16 (and its simplifier folds `x != x`)."""
    return relax.op.isnan(relax.op.astype(x, "float32") if _dtype(x) in _HALF else x)


def stock_converter(importer: ExportedProgramImporter, key: str):
    """The importer's own converter for `key` (`add.Tensor`), which a custom one replaces."""
    stock = importer.__dict__.get("_tvmgraph_stock_converters")
    if stock is None:  # made once per importer (setdefault would make the whole map every call)
        stock = importer.__dict__["_tvmgraph_stock_converters"] = importer.create_convert_map()
    return stock[key]


def _static_shape(expr: relax.Expr, what: str) -> list[int]:
    shape = expr.ty.shape
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
        raise NotImplementedError(f"{what} needs a static input shape, got {shape}")
    return [int(d) for d in shape]


def _static_tail(expr: relax.Expr, what: str, count: int) -> list[int]:
    """The last `count` dims as ints; the leading ones (a dynamic batch) may be symbolic."""
    shape = expr.ty.shape
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in list(shape)[-count:]):
        raise NotImplementedError(f"{what} needs static sizes of its last {count} dims, got {shape}")
    return [int(d) for d in list(shape)[-count:]]


def _static_dim(expr: relax.Expr, what: str, dim: int) -> int:
    """Dim `dim` as an int; the others (a dynamic batch) may be symbolic."""
    shape = expr.ty.shape
    if shape is None or not isinstance(shape[dim], tvm.tirx.IntImm):
        raise NotImplementedError(f"{what} needs a static size of dim {dim}, got {shape}")
    return int(shape[dim])


def _per_dim(value: object, rank: int, default: int) -> list[int]:
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return [default] * rank
    if isinstance(value, int):
        return [value] * rank
    values = [int(v) for v in value]
    return values * rank if len(values) == 1 else values


def _output_used(node: torch.fx.Node, index: int) -> bool:
    return any(u.target is operator.getitem and u.args[1] == index for u in node.users)


# ---- pooling ----

def _window(node: torch.fx.Node, rank: int) -> tuple[list[int], list[int], list[int]]:
    """kernel, stride (the kernel when empty, as in aten) and padding of a pooling node."""
    kernel = _per_dim(node.args[1], rank, 1)
    stride = _arg(node, 2, "stride", None)
    return kernel, _per_dim(stride, rank, 1) if stride else kernel, _per_dim(_arg(node, 3, "padding", 0), rank, 0)


def _pool_indices(x: te.Tensor, values: te.Tensor, kernel: list[int], stride: list[int],
                  padding: list[int], dilation: list[int]) -> te.Tensor:
    """torch's max-pool indices: the flat offset in the input plane of each window's first max.

    A plain min-reduction over the positions holding the window's max (`values`); a tuple
    (argmax) reducer came out wrong under the default CPU schedules.
    """
    rank = len(kernel)
    spatial = [int(d) for d in x.shape[-rank:]]
    axes = [te.reduce_axis((0, k), name=f"r{d}") for d, k in enumerate(kernel)]
    none = tir.const(np.iinfo(np.int64).max, "int64")

    def compute(*index):
        batch, out = index[:-rank], index[-rank:]
        pos = [out[d] * stride[d] - padding[d] + axes[d] * dilation[d] for d in range(rank)]
        valid = tir.all(*[tir.all(p >= 0, p < spatial[d]) for d, p in enumerate(pos)])
        flat = tir.Cast("int64", pos[0])
        for d in range(1, rank):
            flat = flat * spatial[d] + pos[d]
        clamped = [tir.max(tir.min(p, spatial[d] - 1), 0) for d, p in enumerate(pos)]
        value, best = x(*batch, *clamped), values(*index)
        hit = tir.all(valid, tir.any(value == best, tir.all(tir.isnan(value), tir.isnan(best))))
        return te.min(tir.Select(hit, flat, none), axis=axes)

    return te.compute(values.shape, compute, name="max_pool_indices")


def max_pool_with_indices(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(values, int64 indices) of `max_pool{2,3}d_with_indices`; the indices kernel only when used."""
    bb = importer.block_builder
    rank = 3 if node.target.__name__.startswith("max_pool3d") else 2
    x = importer.env[node.args[0]]
    kernel, stride, padding = _window(node, rank)
    dilation = _per_dim(_arg(node, 4, "dilation", 1), rank, 1)
    ceil_mode = bool(_arg(node, 5, "ceil_mode", False))
    unbatched = x.ty.ndim == rank + 1
    data = bb.emit(relax.op.expand_dims(x, axis=0)) if unbatched else x
    pool = relax.op.nn.max_pool2d if rank == 2 else relax.op.nn.max_pool3d
    # ceil_mode becomes extra padding at the end (max pooling pads with the lowest value): TVM's
    # ceil-mode gradient read past the input (garbage like 7e22 in max_pool1d's gradient).
    spatial = _static_tail(data, f"max_pool{rank}d", rank)
    end = [_ceil_extra(n, k, s, p, d) for n, k, s, p, d in zip(spatial, kernel, stride, padding, dilation)] \
        if ceil_mode else [0] * rank
    # Along a dim with one window the stride is moot: the kernel's, so that a window over a
    # whole plane is non-overlapping (max_pool_backward.py's gradient gives ties to the first
    # maximum, as torch; TOPI's, for a 1-wide output of several channels, was wrong).
    stride = [k if _floor_windows(n + 2 * p + e, k, s, d) == 1 else s
              for n, k, s, p, e, d in zip(spatial, kernel, stride, padding, end, dilation)]
    pad = [*padding, *(p + e for p, e in zip(padding, end))]
    if rank == 2 and any(d != 1 for d in dilation):
        # TVM legalizes no dilated max_pool2d gradient: a 3-D pooling of depth 1 (gradients/pool3d.py)
        values = bb.emit(relax.op.squeeze(relax.op.nn.max_pool3d(
            relax.op.expand_dims(data, axis=2), pool_size=[1, *kernel], strides=[1, *stride],
            padding=[0, *padding, 0, *pad[2:]], dilation=[1, *dilation], layout="NCDHW"), axis=[2]))
    else:
        values = bb.emit(pool(data, pool_size=kernel, strides=stride, padding=pad, dilation=dilation,
                              ceil_mode=False, layout="NCHW" if rank == 2 else "NCDHW"))
    indices = None
    if _output_used(node, 1):
        _static_tail(data, f"max_pool{rank}d indices", rank)
        # the tuple's adjoint would reach the kernel otherwise (max_unpool reads both fields)
        indices = stop_gradient.emit_te(bb, _pool_indices, data, values, kernel, stride, padding, dilation)
    if unbatched:
        values = bb.emit(relax.op.squeeze(values, axis=[0]))
        indices = bb.emit(relax.op.squeeze(indices, axis=[0])) if indices is not None else None
    # Unused indices are never computed; the tuple still needs a second field.
    return bb.emit(relax.Tuple([values, indices if indices is not None else values]))


def _floor_windows(padded: int, kernel: int, stride: int, dilation: int) -> int:
    """The number of floor-mode windows along a dim of `padded` elements."""
    return (padded - dilation * (kernel - 1) - 1) // stride + 1


def _ceil_extra(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    """Padding to add at the end so that a floor-mode pool has torch's ceil-mode windows."""
    span = dilation * (kernel - 1) + 1
    out = -(-(size + 2 * pad - span) // stride) + 1
    if (out - 1) * stride >= size + pad:  # torch drops a last window that starts in the padding
        out -= 1
    return max(0, (out - 1) * stride + span - (size + 2 * pad))


def avg_pool(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`avg_pool{2,3}d`; with `ceil_mode` or `divisor_override`, a window sum times a constant map.

    The sum is a floor-mode, count-include-pad pool over an input padded far enough for the
    ceil-mode windows (every window is then divided by its full size, undone by the map), so
    that its gradient is TVM's floor-mode one, which is right; the ceil-mode one is not.
    """
    rank = 3 if node.target.__name__.startswith("avg_pool3d") else 2
    ceil_mode = bool(_arg(node, 4, "ceil_mode", False))
    divisor = _arg(node, 6, "divisor_override", None)
    if divisor is None and not ceil_mode:
        return importer._avg_pool2d(node) if rank == 2 else importer._avg_pool3d(node)
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    kernel, stride, padding = _window(node, rank)
    count_include_pad = bool(_arg(node, 5, "count_include_pad", True))
    size = _static_tail(x, f"avg_pool{rank}d", rank)
    out_size = [_pool_size(*dims, ceil_mode) for dims in zip(size, padding, kernel, stride)]
    extra = [max(0, (o - 1) * st + k - (n + 2 * p))
             for o, st, k, n, p in zip(out_size, stride, kernel, size, padding)]
    window = math.prod(kernel)
    if divisor is not None:
        divisors = np.full(out_size, float(divisor))
    else:
        counts = [_window_counts(*dims, count_include_pad)
                  for dims in zip(size, padding, kernel, stride, out_size)]
        divisors = math.prod(np.ix_(*counts))  # each window's divisor, torch's
    unbatched = x.ty.ndim == rank + 1
    data = bb.emit(relax.op.expand_dims(x, axis=0)) if unbatched else x
    dtype = x.ty.dtype.dtype
    integer = dtype.startswith(("int", "uint"))
    if integer:  # torch sums the integers and divides with truncation: sum exactly in float64
        data = bb.emit(relax.op.astype(data, "float64"))
    pool = relax.op.nn.avg_pool2d if rank == 2 else relax.op.nn.avg_pool3d
    after = [p + e for p, e in zip(padding, extra)]
    total = bb.emit(pool(data, pool_size=kernel, strides=stride, padding=padding + after,
                         ceil_mode=False, count_include_pad=True, layout="NCHW" if rank == 2 else "NCDHW"))
    if integer:
        window_sum = relax.op.round(relax.op.multiply(total, relax.const(float(window), "float64")))
        out = bb.emit(relax.op.divide(relax.op.astype(window_sum, dtype), relax.const(divisors.astype(dtype), dtype)))
    else:
        out = bb.emit(relax.op.multiply(total, relax.const((window / divisors).astype(dtype), dtype)))
    return bb.emit(relax.op.squeeze(out, axis=[0])) if unbatched else out


def _pool_size(size: int, pad: int, kernel: int, stride: int, ceil_mode: bool) -> int:
    """aten pooling_output_shape (dilation 1)."""
    span = size + 2 * pad - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad:  # the last window must start inside the input
        out -= 1
    return out


def _window_counts(size: int, pad: int, kernel: int, stride: int, out: int, count_include_pad: bool) -> np.ndarray:
    """torch's per-dimension divisor of each window (aten avg_pool2d: clipped to the padded
    input, and to the input itself without count_include_pad)."""
    start = np.arange(out) * stride - pad
    end = np.minimum(start + kernel, size + pad)
    if not count_include_pad:
        start, end = np.maximum(start, 0), np.minimum(end, size)
    return np.maximum(end - start, 1).astype(np.float64)


def _adaptive_max_indices(x: te.Tensor, out_size: list[int]) -> te.Tensor:
    """torch's adaptive max-pool indices: the flat offset in the input plane of each window's
    first maximum (its last NaN if it holds one); window ``i`` of ``n -> o`` spans
    ``[floor(i n / o), ceil((i + 1) n / o))``."""
    rank = len(out_size)
    spatial = [int(d) for d in x.shape[-rank:]]
    longest = [max(-(-(i + 1) * n // o) - i * n // o for i in range(o)) for n, o in zip(spatial, out_size)]
    none = tir.const(np.iinfo(np.int64).max, "int64")
    shape = [*x.shape[:-rank], *out_size]

    def window(index: tuple, axes: list) -> tuple[tir.PrimExpr, tir.PrimExpr, tir.PrimExpr]:
        """(the value at a window offset, whether it is in the window, its flat offset)."""
        batch, out = index[:-rank], index[-rank:]
        start = [tir.floordiv(out[d] * spatial[d], out_size[d]) for d in range(rank)]
        stop = [tir.floordiv((out[d] + 1) * spatial[d] + out_size[d] - 1, out_size[d]) for d in range(rank)]
        pos = [start[d] + axes[d] for d in range(rank)]
        valid = tir.all(*[p < e for p, e in zip(pos, stop)])
        flat = tir.Cast("int64", pos[0])
        for d in range(1, rank):
            flat = flat * spatial[d] + pos[d]
        clamped = [tir.min(p, spatial[d] - 1) for d, p in enumerate(pos)]
        return x(*batch, *clamped), valid, flat

    def reduce_axes(tag: str) -> list:
        return [te.reduce_axis((0, k), name=f"{tag}{d}") for d, k in enumerate(longest)]

    def best(*index):
        axes = reduce_axes("m")
        value, valid, _ = window(index, axes)
        return te.max(tir.Select(valid, value, tir.min_value(x.dtype)), axis=axes)

    maximum = te.compute(shape, best, name="adaptive_max")

    def first(*index):
        axes = reduce_axes("f")
        value, valid, flat = window(index, axes)
        hit = tir.all(valid, tir.any(value == maximum(*index), tir.isnan(value)))
        # a NaN counts first, the last NaN first of all: -(offset + 1) (negative), so that min()
        # prefers it, as torch's scan (`val > max || isnan(val)`) keeps the last NaN
        key = tir.Select(tir.isnan(value), -flat - 1, flat)
        return te.min(tir.Select(hit, key, none), axis=axes)

    keyed = te.compute(shape, first, name="adaptive_max_first")
    return te.compute(shape, lambda *i: tir.Select(keyed(*i) < 0, -keyed(*i) - 1, keyed(*i)),
                      name="adaptive_max_indices")


def _adaptive_max_along(bb: relax.BlockBuilder, x: relax.Expr, axis: int, out: int) -> relax.Expr:
    """The max over each adaptive window along `axis`: x with a -inf row appended, `take` of
    each window's rows padded to the longest window with that row, then the row torch's kernel
    picks read from each window (`gather_elements`), so that the gradient goes to it alone: the
    first maximum, or the last NaN where the window holds one (torch's `val > max || isnan(val)`
    scan). The -inf rows never win, nor get a gradient."""
    shape = _static_shape(x, "adaptive_max_pool")
    size = shape[axis]
    if size == out:
        return x
    starts = [i * size // out for i in range(out)]
    stops = [-(-(i + 1) * size // out) for i in range(out)]
    longest = max(b - a for a, b in zip(starts, stops))
    rows = np.array([[a + k if a + k < b else size for k in range(longest)] for a, b in zip(starts, stops)])
    lowest = relax.const(np.full([*shape[:axis], 1, *shape[axis + 1:]], -np.inf), x.ty.dtype.dtype)
    extended = bb.emit(relax.op.concat([x, lowest], axis=axis))
    taken = bb.emit(relax.op.take(extended, relax.const(rows.reshape(-1), "int64"), axis=axis))
    windows = bb.emit(relax.op.reshape(taken, [*shape[:axis], out, longest, *shape[axis + 1:]]))
    window = axis + 1
    from .converters_reduce import _first_extremum_index  # (it imports this module)

    nan = bb.emit(relax.op.isnan(windows))
    finite = bb.emit(relax.op.where(nan, relax.const(-np.inf, x.ty.dtype.dtype), windows))
    # the first maximum; an all -inf window's first element (TVM's argmax gave -1 there)
    first_max = _first_extremum_index(bb, finite, window, True)
    positions = relax.const(np.arange(1, longest + 1).reshape([longest] + [1] * (len(shape) - window)), "int64")
    nan_at = bb.emit(relax.op.multiply(relax.op.astype(nan, "int64"), positions))  # 0, or the position + 1
    last_nan = bb.emit(relax.op.max(nan_at, axis=[window], keepdims=True))
    picked = bb.emit(relax.op.where(relax.op.greater(last_nan, relax.const(0, "int64")),
                                    relax.op.subtract(last_nan, relax.const(1, "int64")), first_max))
    return bb.emit(relax.op.squeeze(relax.op.gather_elements(windows, picked, axis=window), [window]))


def adaptive_max_pool(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(values, int64 indices) of `adaptive_max_pool{2,3}d` (and `adaptive_max_pool1d`, which
    decomposes to the 2-D op). Windows that tile the plane are a max pooling; others are
    separable: one axis at a time, the last axis first, so that a window's pick is the first
    maximum in torch's row-major scan (or its last NaN) and gets the whole gradient."""
    bb = importer.block_builder
    rank = 3 if node.target.__name__.startswith("adaptive_max_pool3d") else 2
    x = importer.env[node.args[0]]
    out_size = _per_dim(node.args[1], rank, 1)
    spatial = _static_tail(x, f"adaptive_max_pool{rank}d", rank)
    if all(n % o == 0 for n, o in zip(spatial, out_size)):
        # Equal windows that tile the plane: a max pooling, whose gradient gives a window's ties
        # to its first maximum, as torch's does (the windows' `max` shares them).
        kernel = [n // o for n, o in zip(spatial, out_size)]
        pool = relax.op.nn.max_pool2d if rank == 2 else relax.op.nn.max_pool3d
        unbatched = x.ty.ndim == rank + 1
        data = relax.op.expand_dims(x, axis=0) if unbatched else x
        values = pool(data, pool_size=kernel, strides=kernel, layout="NCHW" if rank == 2 else "NCDHW")
        values = bb.emit(relax.op.squeeze(values, axis=[0]) if unbatched else values)
    else:
        values = x
        for axis, out in reversed(list(enumerate(out_size))):
            values = _adaptive_max_along(bb, values, x.ty.ndim - rank + axis, out)
    indices = values
    if _output_used(node, 1):
        _static_shape(x, f"adaptive_max_pool{rank}d indices")
        indices = stop_gradient.emit_te(bb, _adaptive_max_indices, x, out_size)
    # Unused indices are never computed; the tuple still needs a second field.
    return bb.emit(relax.Tuple([values, indices]))


# ---- sampling and interpolation ----

def grid_sampler_2d(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`grid_sample` with torch's (N, H, W, 2) grid, for bilinear and nearest."""
    bb = importer.block_builder
    x, grid = importer.env[node.args[0]], importer.env[node.args[1]]
    mode, padding_mode, align_corners = int(node.args[2]), int(node.args[3]), bool(node.args[4])
    if mode not in (0, 1):
        raise NotImplementedError("grid_sample(mode='bicubic') is not supported (TVM's cubic "
                                  "kernel differs from torch's); use 'bilinear' or 'nearest'")
    grid = bb.emit(relax.op.permute_dims(grid, [0, 3, 1, 2]))
    return bb.emit(relax.op.image.grid_sample(
        x, grid, method=("bilinear", "nearest")[mode], layout="NCHW",
        padding_mode=("zeros", "border", "reflection")[padding_mode], align_corners=align_corners))


def grid_sampler_3d(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """3-D `grid_sample` (trilinear or nearest; zeros or border padding): each output point is a
    weighted sum of input voxels gathered at flat indices, so that Relax differentiates it in
    the input (a scatter of the gathers) and in the grid (through the weights)."""
    bb = importer.block_builder
    x, grid = importer.env[node.args[0]], importer.env[node.args[1]]
    mode, padding_mode, align_corners = int(node.args[2]), int(node.args[3]), bool(node.args[4])
    if mode not in (0, 1) or padding_mode not in (0, 1):
        raise NotImplementedError("3-D grid_sample supports mode 'bilinear' or 'nearest' with padding_mode "
                                  "'zeros' or 'border'")
    batch, channels, *size = _static_shape(x, "grid_sample")
    out = _static_shape(grid, "grid_sample")[1:4]
    dtype = x.ty.dtype.dtype
    points = math.prod(out)
    const = lambda v: relax.const(v, dtype)  # noqa: E731
    # grid[..., 0] is x (width), 1 is y (height), 2 is z (depth)
    coords = []
    for axis, n in enumerate(reversed(size)):
        g = bb.emit(relax.op.reshape(relax.op.strided_slice(grid, [4], [axis], [axis + 1]), [batch, points]))
        if align_corners:
            c = relax.op.multiply(relax.op.add(g, const(1.0)), const((n - 1) / 2))
        else:
            c = relax.op.divide(relax.op.subtract(relax.op.multiply(relax.op.add(g, const(1.0)), const(n)),
                                                  const(1.0)), const(2.0))
        if padding_mode == 1:
            c = relax.op.clip(c, 0, n - 1)
        coords.append(bb.emit(c))
    coords = coords[::-1]  # depth, height, width
    if mode == 1:
        corners = [[(bb.emit(relax.op.round(c)), None)] for c in coords]
    else:
        corners = []
        for c in coords:
            low = bb.emit(relax.op.floor(c))
            high_weight = bb.emit(relax.op.subtract(c, low))
            corners.append([(low, bb.emit(relax.op.subtract(const(1.0), high_weight))),
                            (bb.emit(relax.op.add(low, const(1.0))), high_weight)])
    flat_x = bb.emit(relax.op.reshape(x, [batch, channels, math.prod(size)]))
    total = None
    for corner in itertools.product(*corners):
        inside, flat, weight = None, None, None
        for (position, w), n in zip(corner, size):
            # float masks, multiplied: Gradient follows them, and logical_and has no gradient
            ok = relax.op.multiply(relax.op.astype(relax.op.greater_equal(position, const(0.0)), dtype),
                                   relax.op.astype(relax.op.less_equal(position, const(n - 1.0)), dtype))
            inside = ok if inside is None else relax.op.multiply(inside, ok)
            index = relax.op.astype(relax.op.clip(position, 0, n - 1), "int64")
            flat = index if flat is None else relax.op.add(relax.op.multiply(flat, relax.const(n, "int64")), index)
            if w is not None:
                weight = w if weight is None else relax.op.multiply(weight, w)
        weight = inside if weight is None else relax.op.multiply(weight, inside)
        flat = bb.emit(relax.op.broadcast_to(relax.op.expand_dims(flat, 1), [batch, channels, points]))
        values = bb.emit(relax.op.gather_elements(flat_x, flat, axis=2))
        term = bb.emit(relax.op.multiply(values, relax.op.expand_dims(weight, 1)))
        total = term if total is None else bb.emit(relax.op.add(total, term))
    return bb.emit(relax.op.reshape(total, [batch, channels, *out]))


def _aa_weights(in_size: int, out_size: int, align_corners: bool, scale_factor: float | None) -> np.ndarray:
    """torch's anti-aliased bilinear weights (aten UpSampleKernel.cpp, _compute_weights_aa) as an
    (out_size, in_size) matrix: a triangle filter widened by the scale when downsampling."""
    if align_corners:
        scale = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        scale = 1.0 / scale_factor if scale_factor else in_size / out_size
    support = scale if scale >= 1.0 else 1.0  # bilinear: interp_size / 2 = 1, scaled
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        w = np.maximum(0.0, 1.0 - np.abs((np.arange(lo, hi) - center + 0.5) * invscale))
        if w.sum() != 0:
            weights[i, lo:hi] = w / w.sum()
    return weights


def upsample_bilinear2d_aa(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """Anti-aliased bilinear resize: `Wh @ x @ Ww^T` over the last two dimensions."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    size = _arg(node, 1, "output_size", None)
    align_corners = bool(_arg(node, 2, "align_corners", False))
    scale_h, scale_w = _arg(node, 3, "scales_h", None), _arg(node, 4, "scales_w", None)
    in_h, in_w = _static_tail(x, "interpolate(antialias=True)", 2)
    dtype = x.ty.dtype.dtype
    wh = _aa_weights(in_h, int(size[0]), align_corners, scale_h)
    ww = _aa_weights(in_w, int(size[1]), align_corners, scale_w)
    rows = bb.emit(relax.op.matmul(x, relax.const(ww.T.astype(dtype), dtype), out_dtype=dtype))
    return bb.emit(relax.op.matmul(relax.const(wh.astype(dtype), dtype), rows, out_dtype=dtype))


def _output_size(size: Sequence[int] | None, spatial: Sequence[int], scales: Sequence[float] | None) -> list[int]:
    """An interpolation's output size: `output_size` when given, else floor(input * scale)."""
    if size is None:
        return [int(math.floor(n * s)) for n, s in zip(spatial, scales)]
    return [int(o) for o in size]


def _linear_taps(in_size: int, out_size: int, align_corners: bool,
                 scale_factor: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """torch's linear interpolation along one axis (aten area_pixel_compute_source_index): for
    each output position, its two neighbouring source positions and the second one's weight.
    An axis that keeps its size is copied whatever the scale factor, as eager's kernels do
    (`scale_factor=1.3` on 3 pixels)."""
    if in_size == out_size:
        same = np.arange(out_size, dtype=np.int64)
        return same, same, np.zeros(out_size)
    dst = np.arange(out_size, dtype=np.float64)
    if align_corners:
        src = dst * ((in_size - 1) / (out_size - 1) if out_size > 1 else 0.0)
    else:
        scale = 1.0 / scale_factor if scale_factor else in_size / out_size
        src = np.maximum(scale * (dst + 0.5) - 0.5, 0.0)
    low = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
    high = np.minimum(low + 1, in_size - 1)
    return low, high, src - low


def _linear_weights(in_size: int, out_size: int, align_corners: bool, scale_factor: float | None) -> np.ndarray:
    """The same interpolation as an (out_size, in_size) matrix: two weights per row."""
    low, high, frac = _linear_taps(in_size, out_size, align_corners, scale_factor)
    weights = np.zeros((out_size, in_size))
    np.add.at(weights, (np.arange(out_size), low), 1.0 - frac)
    np.add.at(weights, (np.arange(out_size), high), frac)
    return weights


def upsample_linear(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`interpolate(mode='linear' | 'trilinear')` (`upsample_linear1d.vec`,
    `upsample_trilinear3d.vec`, kept whole by lowering.decompose): separable, one matmul with a
    constant weight matrix per axis. torch's decomposition indexes with broadcast index tensors
    (which the stock `index.Tensor` converter rejects) and the stock 1-D resize divided by an
    infinite scale."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    rank = x.ty.ndim - 2
    size = _arg(node, 1, "output_size", None)
    align_corners = bool(_arg(node, 2, "align_corners", False))
    scales = _arg(node, 3, "scale_factors", None)
    shape = _static_shape(x, f"interpolate(mode={'linear' if rank == 1 else 'trilinear'!r})")
    spatial = shape[2:]
    size = _output_size(size, spatial, scales)
    dtype = x.ty.dtype.dtype
    out = x
    for axis in reversed(range(rank)):  # (..., n_axis, o_{axis+1}, ...) -> (..., o_axis, ...)
        n, o = spatial[axis], size[axis]
        weights = relax.const(_linear_weights(n, o, align_corners, scales[axis] if scales else None), dtype)
        lead, tail = shape[:2 + axis], size[axis + 1:]
        rows = bb.emit(relax.op.reshape(out, [*lead, n, math.prod(tail)]))
        out = bb.emit(relax.op.matmul(weights, rows, out_dtype=dtype))
        out = bb.emit(relax.op.reshape(out, [*lead, o, *tail]))
    return out


def upsample_bilinear2d(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`interpolate(mode='bilinear')`. The stock converter (TVM's resize2d) maps output to input
    positions by in / out; torch, given a scale factor (not recomputed: the default), by
    1 / scale_factor: `scale_factor=1.7` on 4 pixels (6 out) read other pixels, max error 1.4 on
    values near 8. It also computes positions in float32, so float64 results were off by 1e-7.
    Those cases are two `take`s of the neighbouring rows blended by constant weights, then the
    same along the columns; the rest keeps the stock resize."""
    x = importer.env[node.args[0]]
    size = _arg(node, 1, "output_size", None)
    align_corners = bool(_arg(node, 2, "align_corners", False))
    scales = _arg(node, 3, "scale_factors", None)
    spatial = _static_tail(x, "interpolate(mode='bilinear')", 2)
    size = _output_size(size, spatial, scales)
    scales = list(scales) if scales is not None else [None, None]
    by_scale = not align_corners and any(
        s is not None and n != o and 1.0 / s != n / o for n, o, s in zip(spatial, size, scales))
    if not by_scale and _dtype(x) != "float64":
        return stock_converter(importer, "upsample_bilinear2d.vec")(node)
    bb = importer.block_builder
    dtype = _dtype(x)
    out = bb.emit(relax.op.astype(x, "float32")) if dtype in _HALF else x
    compute, ndim = _dtype(out), x.ty.ndim
    for axis, (n, o, s) in zip((-2, -1), zip(spatial, size, scales)):
        low, high, frac = _linear_taps(n, o, align_corners, s)
        shape = [o, 1] if axis == -2 else [o]  # the weights broadcast along the axis
        near = bb.emit(relax.op.take(out, relax.const(low, "int64"), axis=ndim + axis))
        far = bb.emit(relax.op.take(out, relax.const(high, "int64"), axis=ndim + axis))
        out = bb.emit(relax.op.add(
            relax.op.multiply(near, relax.const((1.0 - frac).reshape(shape).astype(compute), compute)),
            relax.op.multiply(far, relax.const(frac.reshape(shape).astype(compute), compute))))
    return bb.emit(relax.op.astype(out, dtype)) if dtype in _HALF else out


def im2col(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`F.unfold` (`im2col`, kept whole by lowering.decompose): (N, C * kh * kw, L), the window
    offsets as strided slices of the zero-padded input, stacked in torch's (c, i, j) order.
    torch's decomposition indexes with broadcast index tensors (which the stock `index.Tensor`
    converter rejects)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    kernel, dilation, padding, stride = (_per_dim(node.args[i], 2, 1) for i in range(1, 5))
    unbatched = x.ty.ndim == 3
    data = bb.emit(relax.op.expand_dims(x, axis=0)) if unbatched else x
    batch, channels, *spatial = _static_shape(data, "unfold")
    out = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, p, d, k, s in zip(spatial, padding, dilation, kernel, stride)]
    if any(padding):
        data = bb.emit(relax.op.nn.pad(data, [0, 0, 0, 0, padding[0], padding[0], padding[1], padding[1]]))
    slices = []
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            begin = [i * dilation[0], j * dilation[1]]
            end = [b + (o - 1) * s + 1 for b, o, s in zip(begin, out, stride)]
            slices.append(bb.emit(relax.op.strided_slice(data, [2, 3], begin, end, stride)))
    stacked = bb.emit(relax.op.stack(slices, axis=2))
    columns = bb.emit(relax.op.reshape(stacked, [batch, channels * len(slices), math.prod(out)]))
    return bb.emit(relax.op.squeeze(columns, axis=[0])) if unbatched else columns


def _nearest_indices(in_size: int, out_size: int, scale_factor: float | None, exact: bool,
                     shortcuts: bool = False) -> np.ndarray:
    """torch's source rows, float32 arithmetic included: `nearest` or `nearest-exact`
    (aten nearest_neighbor[_exact]_compute_source_index, pixel corners or centres). With
    `shortcuts`, as eager's 2-D `nearest` kernel (aten nearest_idx): out = in copies and
    out = 2 * in halves whatever the scale factor (`scale_factor=1.3` on 3 pixels keeps all 3;
    1-D and 3-D, and torch's decompositions, give 0, 0, 1)."""
    if shortcuts and out_size == in_size:
        return np.arange(out_size, dtype=np.int64)
    if shortcuts and out_size == 2 * in_size:
        return np.arange(out_size, dtype=np.int64) >> 1
    if scale_factor:
        scale = np.float32(1.0 / scale_factor)
    else:
        scale = np.float32(in_size) / np.float32(out_size)
    dst = np.arange(out_size, dtype=np.float32)
    src = np.floor((dst + np.float32(0.5)) * scale if exact else dst * scale).astype(np.int64)
    return np.minimum(src, in_size - 1)


def upsample_nearest(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`interpolate(mode='nearest' | 'nearest-exact')` in 1, 2 or 3 dims (`upsample_nearest{1,2,3}d`,
    `_upsample_nearest_exact{1,2,3}d`, kept whole by lowering.decompose): a `take` of torch's
    source rows per axis. The stock 2-D converter rounds half-pixel centres (`nearest-exact`)
    for `nearest`; torch's decompositions of the others index with broadcast index tensors,
    which the stock `index.Tensor` converter rejects (3-D: a CompileError)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    exact = "exact" in node.target.__name__
    rank = int(node.target.__name__.split(".")[0][-2])  # upsample_nearest3d.vec -> 3
    size = _arg(node, 1, "output_size", None)
    scales = _arg(node, 2, "scale_factors", None)
    mode = "nearest-exact" if exact else "nearest"
    spatial = _static_tail(x, f"interpolate(mode={mode!r})", rank)
    size = _output_size(size, spatial, scales)
    out = x
    for axis in range(rank):
        n, m = spatial[axis], size[axis]
        index = _nearest_indices(n, m, scales[axis] if scales is not None else None, exact,
                                 shortcuts=rank == 2 and not exact)
        if m == n and (index == np.arange(n)).all():
            continue
        dim = x.ty.ndim - rank + axis
        out = bb.emit(relax.op.take(out, relax.const(index, "int64"), axis=dim, mode="clip"))
    return out


# ---- normalization ----

def native_layer_norm(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(out, mean, rstd) with torch's shapes; mean and rstd are computed only when used."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    normalized = list(node.args[1])
    eps = float(_arg(node, 4, "eps", 1e-5))
    axes = list(range(x.ty.ndim - len(normalized), x.ty.ndim))
    if x.ty.dtype.dtype not in ("float32", "float16"):
        return _layer_norm_by_parts(bb, importer, node, x, axes, eps)
    out = importer._native_layer_norm(node)
    mean = rstd = out
    if _output_used(node, 1) or _output_used(node, 2):
        mean, rstd = _mean_rstd(bb, x, axes, eps)
    return bb.emit(relax.Tuple([out, mean, rstd]))


def _layer_norm_by_parts(bb: relax.BlockBuilder, importer: ExportedProgramImporter, node: torch.fx.Node,
                         x: relax.Expr, axes: list[int], eps: float) -> relax.Expr:
    """Layer norm from mean, centred square and rsqrt: TVM's own layer_norm legalizes float32
    and float16 only (float64 and bfloat16 failed in LegalizeOps)."""
    dtype = x.ty.dtype.dtype
    mean = bb.emit(relax.op.mean(x, axis=axes, keepdims=True))
    centred = bb.emit(relax.op.subtract(x, mean))
    var = bb.emit(relax.op.mean(relax.op.multiply(centred, centred), axis=axes, keepdims=True))
    rstd = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(eps, dtype))))
    out = bb.emit(relax.op.multiply(centred, rstd))
    weight, bias = (node.args[i] if len(node.args) > i else None for i in (2, 3))
    if weight is not None:
        out = bb.emit(relax.op.multiply(out, importer.env[weight]))
    if bias is not None:
        out = bb.emit(relax.op.add(out, importer.env[bias]))
    return bb.emit(relax.Tuple([out, mean, rstd]))


def _mean_rstd(bb: relax.BlockBuilder, x: relax.Expr, axes: list[int],
               eps: float, keepdims: bool = True) -> tuple[relax.Expr, relax.Expr]:
    mean = bb.emit(relax.op.mean(x, axis=axes, keepdims=keepdims))
    var = relax.op.variance(x, axis=axes, keepdims=keepdims)
    rstd = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(eps, x.ty.dtype.dtype))))
    return mean, rstd


def native_group_norm(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(out, mean, rstd), mean and rstd of shape (N, groups), computed only when used."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    # The batch from x's shape: node.args[3] is a symbol (an fx Node) with a dynamic batch.
    n = x.ty.shape[0]
    channels, groups, eps = int(node.args[4]), int(node.args[6]), float(node.args[7])
    dtype = x.ty.dtype.dtype
    # The stock converter passes a missing weight or bias on as a null argument (a crash later).
    gamma, beta = (importer.env[a] if a is not None else relax.const(np.full(channels, fill, dtype=dtype), dtype)
                   for a, fill in ((node.args[1], 1.0), (node.args[2], 0.0)))
    out = bb.emit(relax.op.nn.group_norm(x, gamma, beta, num_groups=groups, channel_axis=1,
                                         axes=list(range(2, x.ty.ndim)), epsilon=eps))
    mean = rstd = out
    if _output_used(node, 1) or _output_used(node, 2):
        grouped = bb.emit(relax.op.reshape(x, (n, groups, -1)))
        mean, rstd = _mean_rstd(bb, grouped, [2], eps)
        mean = bb.emit(relax.op.reshape(mean, (n, groups)))
        rstd = bb.emit(relax.op.reshape(rstd, (n, groups)))
    return bb.emit(relax.Tuple([out, mean, rstd]))


def batch_norm_eval(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """Eval-mode batch norm; float16/bfloat16 compute in float32 and return the input's dtype."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dtype = x.ty.dtype.dtype
    if not isinstance(x.ty.shape[1], tvm.tirx.IntImm):
        return _batch_norm_eval_written_out(bb, x, node, importer)
    if dtype not in _HALF:
        return importer._batch_norm_legit_no_training(node)
    channels = _static_dim(x, "half-precision batch norm", 1)

    def f32(arg: object, fill: float) -> relax.Expr:
        if arg is None:
            return relax.const(np.full(channels, fill, dtype="float32"))
        return bb.emit(relax.op.astype(importer.env[arg], "float32"))

    weight, bias = f32(node.args[1], 1.0), f32(node.args[2], 0.0)
    mean, var = f32(node.args[3], 0.0), f32(node.args[4], 1.0)
    eps = float(_arg(node, 6, "eps", 1e-5))
    normalized = bb.emit(relax.op.nn.batch_norm(
        bb.emit(relax.op.astype(x, "float32")), weight, bias, mean, var, axis=1, epsilon=eps,
        center=node.args[2] is not None, scale=node.args[1] is not None, training=False))
    return bb.emit(relax.op.astype(bb.emit(relax.TupleGetItem(normalized, 0)), dtype))


def per_channel_affine(bb: relax.BlockBuilder, out: relax.Expr, weight: relax.Expr | None,
                       bias: relax.Expr | None) -> relax.Expr:
    """`out * weight + bias` with weight and bias along dim 1 (either may be None)."""
    per_channel = [1, -1] + [1] * (out.ty.ndim - 2)
    for value, combine in ((weight, relax.op.multiply), (bias, relax.op.add)):
        if value is not None:
            out = bb.emit(combine(out, relax.op.reshape(value, per_channel)))
    return out


def _batch_norm_eval_written_out(bb: relax.BlockBuilder, x: relax.Expr, node: torch.fx.Node,
                                 importer: ExportedProgramImporter) -> relax.Expr:
    """An eval-mode instance norm under a dynamic batch normalizes (1, n * C, ...) by its
    running statistics repeated n times: a symbolic channel count, which TVM's batch_norm
    refuses. Written out, in float32 for 16-bit inputs."""
    dtype = x.ty.dtype.dtype
    compute = "float32" if dtype in _HALF else dtype
    per_channel = [1, -1] + [1] * (x.ty.ndim - 2)

    def channel_values(arg: object) -> relax.Expr | None:
        return bb.emit(relax.op.astype(importer.env[arg], compute)) if arg is not None else None

    weight, bias, mean, var = (channel_values(a) for a in node.args[1:5])
    eps = relax.const(float(_arg(node, 6, "eps", 1e-5)), compute)
    out = bb.emit(relax.op.multiply(relax.op.subtract(relax.op.astype(x, compute), relax.op.reshape(mean, per_channel)),
                                    relax.op.rsqrt(relax.op.add(relax.op.reshape(var, per_channel), eps))))
    out = per_channel_affine(bb, out, weight, bias)
    return bb.emit(relax.op.astype(out, dtype)) if compute != dtype else out


def _linear_cross_entropy(bb: relax.BlockBuilder, x: relax.Expr, linear_weight: relax.Expr, target: relax.Expr,
                          linear_bias: relax.Expr | None, class_weight: relax.Expr | None, reduction: str,
                          ignore_index: int, label_smoothing: float) -> relax.Expr:
    """`cross_entropy(x @ W^T + b, target, weight, reduction, ignore_index, label_smoothing)`
    with class-index targets, written out so that Relax differentiates it."""
    if x.ty.ndim == 1:  # one sample
        x, target = bb.emit(relax.op.expand_dims(x, 0)), bb.emit(relax.op.expand_dims(target, 0))
    dtype = x.ty.dtype.dtype
    logits = bb.emit(relax.op.matmul(x, relax.op.permute_dims(linear_weight, [1, 0]), out_dtype=dtype))
    if linear_bias is not None:
        logits = bb.emit(relax.op.add(logits, linear_bias))
    classes = _static_dim(logits, "linear_cross_entropy", -1)
    log_probs = bb.emit(relax.op.nn.log_softmax(logits, axis=-1))
    valid = bb.emit(relax.op.not_equal(target, relax.const(ignore_index, target.ty.dtype.dtype)))
    safe_target = bb.emit(relax.op.where(valid, target, relax.const(0, target.ty.dtype.dtype)))
    picked = bb.emit(relax.op.squeeze(relax.op.gather_elements(
        log_probs, relax.op.expand_dims(safe_target, -1), axis=-1), axis=[-1]))
    zero = relax.const(0.0, dtype)
    weight_of_sample = bb.emit(relax.op.where(
        valid, relax.op.take(class_weight, safe_target, axis=0) if class_weight is not None
        else relax.const(1.0, dtype), zero))
    loss = bb.emit(relax.op.negative(relax.op.multiply(picked, weight_of_sample)))
    if label_smoothing > 0.0:
        weighted = log_probs if class_weight is None else relax.op.multiply(log_probs, class_weight)
        smooth = bb.emit(relax.op.where(valid, relax.op.negative(relax.op.sum(weighted, axis=[-1])), zero))
        loss = bb.emit(relax.op.add(relax.op.multiply(loss, relax.const(1.0 - label_smoothing, dtype)),
                                    relax.op.multiply(smooth, relax.const(label_smoothing / classes, dtype))))
    if reduction == "none":
        return loss
    total = bb.emit(relax.op.sum(loss))
    if reduction == "sum":
        return total
    return bb.emit(relax.op.divide(total, relax.op.sum(weight_of_sample)))


def linear_cross_entropy_chunked(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`linear_cross_entropy` with `batch_chunk_size` (torch_nn custom ops). Chunking only saves
    eager memory; here it is the unchunked loss, whose gradient Relax computes. The mean/sum op
    also returns the gradients it precomputes for its own backward: refused if the graph uses them."""
    bb = importer.block_builder
    env = lambda arg: importer.env[arg] if arg is not None else None  # noqa: E731
    x, linear_weight, target, linear_bias, class_weight = (env(a) for a in node.args[:5])
    if node.target.__name__.startswith("_linear_cross_entropy_batch_chunked_no_reduction"):
        return _linear_cross_entropy(bb, x, linear_weight, target, linear_bias, class_weight, "none",
                                     int(node.args[5]), 0.0)
    if any(_output_used(node, i) for i in (1, 2, 3)):
        raise NotImplementedError("the gradients that chunked linear_cross_entropy precomputes")
    reduction, ignore_index, label_smoothing = str(node.args[5]), int(node.args[6]), float(node.args[7])
    loss = _linear_cross_entropy(bb, x, linear_weight, target, linear_bias, class_weight, reduction,
                                 ignore_index, label_smoothing)
    # The unused gradient fields still need a value each.
    return bb.emit(relax.Tuple([loss, loss, loss, loss]))


_SCORE_PATH = {"view.default", "_unsafe_view.default", "expand.default", "clone.default", "mul.Tensor",
               "mul.Scalar", "div.Tensor", "div.Scalar"}
_MATMULS = {"bmm.default", "mm.default", "matmul.default"}


def _from_matmul(node: object) -> bool:
    """Whether an fx value is a matmul's result through views and scales (finite scores)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if name in _MATMULS:
            return True
        if name not in _SCORE_PATH:
            return False
        node = node.args[0]
    return False


def _empty_rows(bb: relax.BlockBuilder, x: relax.Expr, dim: int) -> relax.Expr:
    """Rows of `x` along `dim` (negative) that are all -inf, keepdims; elementwise where `x`
    lacks `dim` (it broadcasts along it)."""
    neg_inf = relax.const(-math.inf, x.ty.dtype.dtype)
    if x.ty.ndim + dim < 0:
        return bb.emit(relax.op.equal(x, neg_inf))
    # Not max(x) == -inf: TVM's max starts from the lowest finite value, so an all -inf row's
    # max is -FLT_MAX.
    finite = relax.op.astype(relax.op.not_equal(x, neg_inf), "int32")
    return bb.emit(relax.op.equal(relax.op.max(finite, axis=[dim], keepdims=True), relax.const(0, "int32")))


def safe_softmax(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`_safe_softmax` (torch attention): softmax, 0 on rows that are all -inf.

    torch's decomposition computes the NaN softmax of such a row and then replaces it by 0; its
    gradient (0 times NaN) is NaN and reaches q and k through the additive mask. Here no softmax
    row is all -inf: for `scores + mask` (SDPA with a mask) the mask's all -inf rows become 0
    before the add, which keeps the attention's shape for RecomputeAttention; any other input
    that is not plain scores has its empty rows zeroed before the softmax.
    """
    bb = importer.block_builder
    arg = node.args[0]
    x = importer.env[arg]
    dim = int(node.args[1]) % x.ty.ndim - x.ty.ndim
    dtype = _arg(node, 2, "dtype", None)
    if dtype is not None:
        x = bb.emit(relax.op.astype(x, str(dtype).removeprefix("torch.")))
    zero = relax.const(0.0, x.ty.dtype.dtype)
    is_add = isinstance(arg, torch.fx.Node) and getattr(arg.target, "__name__", "") == "add.Tensor"
    masked_scores = is_add and _from_matmul(arg.args[0]) and isinstance(arg.args[1], torch.fx.Node) \
        and importer.env[arg.args[1]].ty.dtype.dtype == x.ty.dtype.dtype
    if dtype is None and _from_matmul(arg):
        empty, logits = _empty_rows(bb, x, dim), x
    elif dtype is None and masked_scores:
        mask = importer.env[arg.args[1]]
        empty = _empty_rows(bb, mask, dim)
        logits = bb.emit(relax.op.add(importer.env[arg.args[0]], bb.emit(relax.op.where(empty, zero, mask))))
    else:
        empty = _empty_rows(bb, x, dim)
        logits = bb.emit(relax.op.where(empty, zero, x))
    probs = bb.emit(relax.op.nn.softmax(logits, axis=dim))
    return bb.emit(relax.op.where(empty, zero, probs))


def softmax_half_to_float(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`_softmax` / `_log_softmax(x, dim, half_to_float)`; with the flag, the input is cast to
    float32 first, as torch's CUDA kernel reads it."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dim = int(_arg(node, 1, "dim", -1))
    if _arg(node, 2, "half_to_float", False) and _dtype(x) != "float32":
        x = bb.emit(relax.op.astype(x, "float32"))
    op = relax.op.nn.log_softmax if node.target.__name__.startswith("_log_softmax") else relax.op.nn.softmax
    return bb.emit(op(x, dim))


CONVERTERS = {
    "_safe_softmax.default": safe_softmax,
    "_softmax.default": softmax_half_to_float,
    "_log_softmax.default": softmax_half_to_float,
    "max_pool2d_with_indices.default": max_pool_with_indices,
    "max_pool3d_with_indices.default": max_pool_with_indices,
    "adaptive_max_pool2d.default": adaptive_max_pool,
    "adaptive_max_pool3d.default": adaptive_max_pool,
    "avg_pool2d.default": avg_pool,
    "avg_pool3d.default": avg_pool,
    "grid_sampler_2d.default": grid_sampler_2d,
    "grid_sampler_3d.default": grid_sampler_3d,
    "_upsample_bilinear2d_aa.default": upsample_bilinear2d_aa,
    "upsample_bilinear2d.vec": upsample_bilinear2d,
    **{f"{op}{rank}d.vec": upsample_nearest for op in ("upsample_nearest", "_upsample_nearest_exact")
       for rank in (1, 2, 3)},
    "upsample_linear1d.vec": upsample_linear,
    "upsample_trilinear3d.vec": upsample_linear,
    "im2col.default": im2col,
    "_linear_cross_entropy_batch_chunked.default": linear_cross_entropy_chunked,
    "_linear_cross_entropy_batch_chunked_no_reduction.default": linear_cross_entropy_chunked,
    "native_layer_norm.default": native_layer_norm,
    "native_group_norm.default": native_group_norm,
    "_native_batch_norm_legit_no_training.default": batch_norm_eval,
}

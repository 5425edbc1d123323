"""torch's advanced indexing, `x[idx]` and `x[idx] = v`, with index tensors and boolean masks.

The stock `index.Tensor` converter indexed one dim after another: `x[:, i, j]` became the
outer product of `i` and `j` ([2, 3, 3, 5] where torch gives [2, 3, 5]), `x[:, k, i]` the same
shape with other values; it refused boolean masks, and tvmgraph's `index_put` read a mask
as the indices 0 and 1 (`y[y < 0] = 0` zeroed the first two rows). Here, as torch does:

- `index.Tensor`: the index tensors broadcast together and pick elements jointly. The indexed
  dims are moved to the front and flattened, each index wrapped (negative counts from the end)
  and clamped into its dim, combined into one linear index, and one `take` reads the result;
  when the indexed dims are adjacent the result's indexed part goes back where they were. A
  boolean mask stands for the coordinates of its true elements (`nonzero`), a count known only
  when the program runs.
- `index_put` with one boolean mask (`x[mask] = v`, `x[:, mask] += v`): a `where` over x, the
  value of each true element read by its rank among the true ones (a cumulative sum of the
  mask), so the result keeps x's shape and the gradient flows to x and v.
- `nonzero`: the coordinates of the nonzero elements, one row each; `masked_select` the true
  elements of x and the mask broadcast together, in order.

Integer index tensors from the graph's inputs are range-checked before the call
(index_guard.py); indices computed inside the graph are wrapped and clamped here so that no
kernel reads outside x.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from relay_passes.tensor_sizes import static_shape

from .converters_nn import _arg


def is_mask(index: torch.fx.Node) -> bool:
    """Whether an index operand is a boolean mask (uint8: torch's deprecated mask dtype)."""
    val = index.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in (torch.bool, torch.uint8)


def coordinates(bb: relax.BlockBuilder, mask: relax.Expr, name: str) -> relax.Expr:
    """[k, n] int64: the coordinates of `mask`'s n true (nonzero) elements, row-major; n is a
    symbolic size known when the program runs."""
    count = tirx.Var(name, "int64")
    coords = bb.emit(relax.op.nonzero(mask))
    return bb.match_cast(coords, relax.TensorType([mask.ty.ndim, count], "int64"))


def _expanded_indices(node: torch.fx.Node, importer: ExportedProgramImporter) -> list[relax.Expr | None]:
    """One entry per dim of x that `node`'s indices consume: an integer index tensor, or None
    for a whole dim; a k-dim boolean mask becomes k index tensors, its coordinates."""
    bb = importer.block_builder
    out: list[relax.Expr | None] = []
    for index in node.args[1]:
        if index is None:
            out.append(None)
        elif is_mask(index):
            mask = importer.env[index]
            if mask.ty.ndim == 0:
                raise NotImplementedError("a 0-d boolean mask as an index: use torch.where instead")
            coords = coordinates(bb, mask, f"{node.name}_count")
            out += [bb.emit(relax.op.take(coords, relax.const(j, "int64"), axis=0)) for j in range(mask.ty.ndim)]
        else:
            out.append(importer.env[index])
    return out


def _in_range(bb: relax.BlockBuilder, index: relax.Expr, size: int | relax.Expr) -> relax.Expr:
    """`index` as int64 in [0, size): negative counts from the end, the rest clamped. `size` is
    a number, or a 0-d int64 tensor for a symbolic dim."""
    index = bb.emit(relax.op.astype(index, "int64"))
    zero = relax.const(0, "int64")
    if isinstance(size, int):
        size = relax.const(size, "int64")
    wrapped = bb.emit(relax.op.where(relax.op.less(index, zero), relax.op.add(index, size), index))
    last = relax.op.maximum(relax.op.subtract(size, relax.const(1, "int64")), zero)
    return bb.emit(relax.op.maximum(relax.op.minimum(wrapped, last), zero))


def _dim_size(bb: relax.BlockBuilder, x: relax.Expr, dim: int) -> int | relax.Expr:
    """x's size along `dim`: a number, or a 0-d int64 tensor when it is symbolic."""
    size = x.ty.shape.values[dim]
    if isinstance(size, tvm.tirx.IntImm):
        return int(size)
    sizes = bb.emit(relax.op.shape_to_tensor(relax.op.shape_of(x)))
    return bb.emit(relax.op.take(sizes, relax.const(dim, "int64"), axis=0))


def index_tensor(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x[indices]: see the module docstring."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    indices = _expanded_indices(node, importer)
    given = [d for d, index in enumerate(indices) if index is not None]
    if len(given) == 1:  # one index tensor: a take along its dim (wrap: negatives count from the end)
        return bb.emit(relax.op.take(x, indices[given[0]], axis=given[0], mode="wrap"))
    shape = static_shape(x)
    if shape is None:  # a symbolic size (a dynamic batch): leading dims indexed, paired by index_tensor
        if given != list(range(len(given))):
            raise NotImplementedError("index tensors after a whole dim of a tensor of symbolic size: "
                                      "index one dim at a time")
        pairs = [_in_range(bb, indices[d], _dim_size(bb, x, d)) for d in given]
        return bb.emit(relax.op.index_tensor(x, pairs))
    sizes = [shape[d] for d in given]
    rest = [d for d in range(len(shape)) if d not in given]
    linear = None
    for d, stride in zip(given, np.cumprod([1] + sizes[:0:-1])[::-1].tolist()):
        term = _in_range(bb, indices[d], shape[d])
        term = relax.op.multiply(term, relax.const(int(stride), "int64")) if stride != 1 else term
        linear = term if linear is None else bb.emit(relax.op.add(linear, term))
    front = x if given + rest == list(range(len(shape))) else bb.emit(relax.op.permute_dims(x, given + rest))
    flat = bb.emit(relax.op.reshape(front, [math.prod(sizes)] + [shape[d] for d in rest]))
    picked = bb.emit(relax.op.take(flat, linear, axis=0, mode="clip"))
    first = given[0]
    if given != list(range(first, first + len(given))) or first == 0:
        return picked  # torch puts the indexed part first when the indexed dims are apart
    batch = picked.ty.ndim - len(rest)
    order = list(range(batch, batch + first)) + list(range(batch)) + list(range(batch + first, picked.ty.ndim))
    return bb.emit(relax.op.permute_dims(picked, order))


def masked_put(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.index_put(indices, values, accumulate) where `indices` is one boolean mask and whole
    dims (None): see the module docstring."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    masks = [(p, index) for p, index in enumerate(node.args[1]) if index is not None]
    if len(masks) != 1:
        raise NotImplementedError("a boolean mask with other index tensors in one assignment: "
                                  "assign with the mask alone, or turn it into indices first")
    at, mask_node = masks[0]
    mask = importer.env[mask_node]
    if mask.ty.dtype.dtype != "bool":
        mask = bb.emit(relax.op.not_equal(mask, relax.const(0, mask.ty.dtype.dtype)))
    k, rank = mask.ty.ndim, x.ty.ndim
    trailing = rank - at - k
    values = importer.env[node.args[2]]
    if values.ty.dtype.dtype != x.ty.dtype.dtype:
        values = bb.emit(relax.op.astype(values, x.ty.dtype.dtype))
    full = at + 1 + trailing  # the rank of x[mask]: x's leading dims, the count, its trailing dims
    if values.ty.ndim > full:
        raise NotImplementedError(f"values of {values.ty.ndim} dims assigned to x[mask] of {full}")
    for _ in range(full - values.ty.ndim):  # broadcasting aligns from the right
        values = bb.emit(relax.op.expand_dims(values, 0))
    count = values.ty.shape.values[at] if isinstance(values.ty.shape, relax.ShapeExpr) else None
    if isinstance(count, tvm.tirx.IntImm) and int(count) == 1:  # one value for every true element
        per_element = bb.emit(relax.op.reshape(values, list(values.ty.shape.values[:at]) + [1] * k
                                               + list(values.ty.shape.values[at + 1:])))
    else:  # the values of the true elements, in order: each reads its rank among them
        flat = bb.emit(relax.op.reshape(mask, [-1]))
        ranks = bb.emit(relax.op.subtract(relax.op.cumsum(flat, axis=0, dtype="int64"), relax.const(1, "int64")))
        ranks = bb.emit(relax.op.reshape(relax.op.maximum(ranks, relax.const(0, "int64")), mask.ty.shape))
        # One spare value after the last, so that an all-false mask (no values) reads inside:
        # zeros shaped like one value (a sum along the count keeps that dim, even when empty).
        spare = bb.emit(relax.op.zeros_like(relax.op.sum(values, axis=[at], keepdims=True)))
        padded = bb.emit(relax.op.concat([values, spare], axis=at))
        per_element = bb.emit(relax.op.take(padded, ranks, axis=at, mode="clip"))
    where_mask = bb.emit(relax.op.reshape(mask, [1] * at + list(mask.ty.shape.values) + [1] * trailing))
    if bool(_arg(node, 3, "accumulate", False)):
        zero = relax.const(False if x.ty.dtype.dtype == "bool" else 0, x.ty.dtype.dtype)
        added = bb.emit(relax.op.where(where_mask, per_element, zero))
        if x.ty.dtype.dtype == "bool":
            return bb.emit(relax.op.logical_or(x, added))
        return bb.emit(relax.op.add(x, added))
    return bb.emit(relax.op.where(where_mask, per_element, x))


def uses_mask(node: torch.fx.Node) -> bool:
    """Whether `node` (an index or index_put) indexes with a boolean mask."""
    return any(index is not None and is_mask(index) for index in node.args[1])


def masked_select(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """torch.masked_select(x, mask): x and mask broadcast together (the stock converter broadcast
    only the mask to x, and failed on a mask of more dims), flattened, the true elements in order."""
    bb = importer.block_builder
    x, mask = importer.env[node.args[0]], importer.env[node.args[1]]
    shape = tuple(torch.broadcast_shapes(node.args[0].meta["val"].shape, node.args[1].meta["val"].shape))
    if not all(isinstance(d, int) for d in shape):
        shape = None
        if not tvm_ffi.structural_equal(mask.ty.shape, x.ty.shape):
            raise NotImplementedError("masked_select broadcasting a tensor of symbolic size: expand it first")
    flat = []
    for value in (x, mask):
        if shape is not None and static_shape(value) != shape:
            value = bb.emit(relax.op.broadcast_to(value, shape))
        flat.append(bb.emit(relax.op.reshape(value, [-1])))
    coords = coordinates(bb, flat[1], f"{node.name}_count")
    return bb.emit(relax.op.take(flat[0], relax.op.reshape(coords, [-1]), axis=0))


def nonzero(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """torch.nonzero(x): [n, x.dim()] int64, one row of coordinates per nonzero element."""
    x = importer.env[node.args[0]]
    if x.ty.ndim == 0:
        raise NotImplementedError("nonzero of a 0-d tensor: compare it instead (x != 0)")
    bb = importer.block_builder
    return bb.emit(relax.op.permute_dims(coordinates(bb, x, f"{node.name}_count"), [1, 0]))

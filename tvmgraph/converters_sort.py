"""Sorting converters: `sort`, `argsort`, `topk`, `kthvalue`, all through one ordering that
follows torch's.

TVM 0.27's argsort (the `tvm.contrib.sort` kernel on CPU) is stable, but:
- NaN compares false both ways, so a NaN stayed where it was: `sort([1, NaN, 3, 2])` came out
  `[1, NaN, 2, 3]`, and `kthvalue`, `topk`, `median` and `quantile` read the wrong element;
- bfloat16 keys were sorted wrongly, and int8/bool keys were refused.
torch puts NaN above +inf: last when ascending, first when descending. `order` sorts twice
(stable): by "is NaN", then by the value with NaN read as +inf, so NaN lands past every +inf.
Values are gathered at the order, so the gradient flows back through `gather_elements`.
"""

from __future__ import annotations

import math

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import _arg, _dtype, isnan

op = relax.op

# Key dtypes TVM's sort kernel orders correctly; others are widened first (exactly).
_KEY_DTYPE = {"bfloat16": "float32", "bool": "int32", "int8": "int32", "uint8": "int32", "int16": "int32"}


def order(bb: relax.BlockBuilder, x: relax.Expr, dim: int, descending: bool) -> relax.Expr:
    """The int64 permutation that sorts `x` along `dim` as torch's stable sort does: ties keep
    their order, NaN sorts above +inf."""
    key = x
    if _dtype(key) in _KEY_DTYPE:
        key = bb.emit(op.astype(key, _KEY_DTYPE[_dtype(key)]))
    if "float" not in _dtype(key):
        return bb.emit(op.argsort(key, axis=dim, descending=descending, dtype="int64"))
    nan = bb.emit(isnan(key))
    by_nan = bb.emit(op.argsort(op.astype(nan, "int32"), axis=dim, descending=descending, dtype="int64"))
    key = bb.emit(op.where(nan, relax.const(math.inf, _dtype(key)), key))
    by_value = bb.emit(op.argsort(op.gather_elements(key, by_nan, axis=dim), axis=dim, descending=descending,
                                  dtype="int64"))
    return bb.emit(op.gather_elements(by_nan, by_value, axis=dim))


def sorted_index(bb: relax.BlockBuilder, x: relax.Expr, dim: int, position: relax.Expr | int) -> relax.Expr:
    """The int64 index (size 1 along `dim`) of the element at `position` of `x` sorted along
    `dim` (ascending, NaN last)."""
    ordered = order(bb, x, dim, descending=False)
    if isinstance(position, int):
        return bb.emit(op.strided_slice(ordered, axes=[dim], begin=[position], end=[position + 1]))
    return bb.emit(op.gather_elements(ordered, position, axis=dim))


def _dim(node: torch.fx.Node, x: relax.Expr, index: int, default: int = -1) -> int:
    return int(_arg(node, index, "dim", default)) % max(x.ty.ndim, 1)


def _sort_args(node: torch.fx.Node, x: relax.Expr) -> tuple[int, bool]:
    """(dim, descending); `sort.stable` has them as keywords, which `_arg` reads too."""
    return _dim(node, x, 1), bool(_arg(node, 2, "descending", False))


def sort(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(values, int64 indices)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    if x.ty.ndim == 0:
        return bb.emit(relax.Tuple([x, relax.const(0, "int64")]))
    dim, descending = _sort_args(node, x)
    index = order(bb, x, dim, descending)
    return bb.emit(relax.Tuple([bb.emit(op.gather_elements(x, index, axis=dim)), index]))


def argsort(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    x = importer.env[node.args[0]]
    if x.ty.ndim == 0:
        return relax.const(0, "int64")
    dim, descending = _sort_args(node, x)
    return order(importer.block_builder, x, dim, descending)


def topk(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(k largest, or smallest, values along dim, their indices), sorted; NaN counts as the
    largest value, as in torch."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    k = int(_arg(node, 1, "k", 1))
    if x.ty.ndim == 0:
        return bb.emit(relax.Tuple([x, relax.const(0, "int64")]))
    dim = _dim(node, x, 2)
    largest = bool(_arg(node, 3, "largest", True))
    index = bb.emit(op.strided_slice(order(bb, x, dim, descending=largest), axes=[dim], begin=[0], end=[k]))
    return bb.emit(relax.Tuple([bb.emit(op.gather_elements(x, index, axis=dim)), index]))


def pick(bb: relax.BlockBuilder, x: relax.Expr, index: relax.Expr, dim: int, keepdim: bool) -> relax.Expr:
    """(x gathered at `index` along `dim`, index), both squeezed unless keepdim; `index` has
    size 1 along `dim`."""
    values = bb.emit(op.gather_elements(x, index, axis=dim))
    if not keepdim:
        values, index = (bb.emit(op.squeeze(v, axis=[dim])) for v in (values, index))
    return bb.emit(relax.Tuple([values, index]))


def kthvalue(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(k-th smallest along dim, its index); NaN sorts last."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    k = int(node.args[1])
    keepdim = bool(_arg(node, 3, "keepdim", False))
    if x.ty.ndim == 0:
        return bb.emit(relax.Tuple([x, relax.const(0, "int64")]))
    dim = _dim(node, x, 2)
    return pick(bb, x, sorted_index(bb, x, dim, k - 1), dim, keepdim)


CONVERTERS = {
    "sort.default": sort,
    "sort.stable": sort,
    "argsort.default": argsort,
    "argsort.stable": argsort,
    "topk.default": topk,
    "kthvalue.default": kthvalue,
}

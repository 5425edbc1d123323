"""Arithmetic on a dynamic batch's size: `loss / x.shape[0]`, `x * (x.shape[0] / 8)`.

Under `enable_dynamic_batch()` torch.export records `x.shape[0]` as a symbolic int
(`aten.sym_size.int`), which the importer keeps as the batch variable itself (a PrimExpr).
An op of a tensor and that value (`aten.div.Tensor(sum, sym_size)`) reached `R.divide` with an
int64 scalar beside a float tensor, and Python arithmetic on it (`torch.sym_float`,
`operator.truediv`, `torch.tensor(x.size(0))`) had no converter: such graphs failed to compile. Here a symbolic scalar
becomes a 0-d tensor where it meets tensors (its value read from a shape at run time,
`shape_to_tensor`), cast to the op's computation dtype by type_promotion.py; `sym_float` and
`/` give float64 0-d tensors, as Python's float arithmetic.
"""

from __future__ import annotations

import torch
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter


def is_symbolic_scalar(expr: object) -> bool:
    """Whether `expr` is an integer scalar expression the importer keeps as it is (a symbolic
    size, `sym_size` of a dynamic batch: a PrimExpr, typed PrimType)."""
    return isinstance(getattr(expr, "ty", None), tvm.ir.PrimType) and "int" in str(expr.ty)


def scalar_tensor(bb: relax.BlockBuilder, expr: object, dtype: str) -> relax.Expr:
    """A 0-d `dtype` tensor of `expr`: a symbolic int (PrimValue), a 0-d tensor or a number."""
    if isinstance(expr, relax.Expr) and isinstance(expr.ty, relax.TensorType):
        return expr if expr.ty.dtype.dtype == dtype else bb.emit(relax.op.astype(expr, dtype))
    if is_symbolic_scalar(expr):
        value = expr if str(expr.ty) == "int64" else tirx.Cast("int64", expr)
        shape = bb.emit(relax.op.shape_to_tensor(relax.ShapeExpr([value])))  # int64 [1]
        return bb.emit(relax.op.astype(relax.op.reshape(shape, []), dtype))
    return relax.const(expr, dtype)


def counted(bb: relax.BlockBuilder, count: tirx.PrimExpr, dtype: str) -> relax.Expr:
    """A 0-d `dtype` tensor of the symbolic size `count` as the sum of `count` ones, for a value
    autodiff must pass (it fails on `shape_to_tensor`): batch norm's and var's corrections."""
    return bb.emit(relax.op.sum(relax.op.ones(relax.ShapeExpr([count]), dtype)))


def _operand(importer: ExportedProgramImporter, arg: object) -> object:
    return importer.env[arg] if isinstance(arg, torch.fx.Node) else arg


def sym_float(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """float(n) of a symbolic int: a float64 0-d tensor."""
    return scalar_tensor(importer.block_builder, _operand(importer, node.args[0]), "float64")


def truediv(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """a / b of symbolic scalars and numbers (Python's true division): a float64 0-d tensor."""
    bb = importer.block_builder
    a, b = (scalar_tensor(bb, _operand(importer, arg), "float64") for arg in node.args[:2])
    return bb.emit(relax.op.divide(a, b))


def tensor_of_scalar(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`torch.tensor(x.size(0), dtype=...)` (`aten.scalar_tensor`) of a number or a symbolic
    size: a 0-d tensor of the traced dtype (the stock converter took only numbers)."""
    dtype = str(node.meta["val"].dtype).removeprefix("torch.")
    return scalar_tensor(importer.block_builder, _operand(importer, node.args[0]), dtype)


CONVERTERS = {"sym_float": sym_float, "truediv": truediv, "scalar_tensor.default": tensor_of_scalar}

"""Bit shifts, `x << s` and `x >> s` (`__lshift__`, `bitwise_left_shift`, ...), which TVM 0.27's
importer does not lower.

LLVM leaves a shift by the type's width or more (or by a negative amount) undefined; torch
defines it: a left shift gives 0, a right shift the sign (0, or -1 for a negative signed x: a
shift by width - 1). Both operands take torch's promoted dtype first.
"""

from __future__ import annotations

import numpy as np
import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import operand, result_dtype


def shift(left: bool):
    """The converter of a left (or right) shift, in torch's definition for every amount."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        dtype = result_dtype(node)
        x, amount = (operand(importer, v, dtype) for v in node.args[:2])
        for value in (x, amount):
            if value.ty.dtype.dtype != dtype:
                raise NotImplementedError(f"a shift of {value.ty.dtype.dtype} into {dtype}")
        bits = np.dtype(dtype).itemsize * 8
        zero = relax.const(0, dtype)
        outside = bb.emit(relax.op.logical_or(relax.op.less(amount, zero),
                                              relax.op.greater_equal(amount, relax.const(bits, dtype))))
        if left:
            shifted = bb.emit(relax.op.left_shift(x, relax.op.clip(amount, 0, bits - 1)))
            return bb.emit(relax.op.where(outside, zero, shifted))
        safe = bb.emit(relax.op.where(outside, relax.const(bits - 1, dtype), amount))
        shifted = bb.emit(relax.op.right_shift(x, safe))  # out of range, signed: the sign bits
        if dtype.startswith("uint"):
            return bb.emit(relax.op.where(outside, zero, shifted))
        return shifted

    return convert


CONVERTERS = {
    **{f"{name}.{overload}": shift(True) for name in ("__lshift__", "bitwise_left_shift")
       for overload in ("Scalar", "Tensor", "Tensor_Scalar", "Scalar_Tensor")},
    **{f"{name}.{overload}": shift(False) for name in ("__rshift__", "bitwise_right_shift")
       for overload in ("Scalar", "Tensor", "Tensor_Scalar", "Scalar_Tensor")},
}

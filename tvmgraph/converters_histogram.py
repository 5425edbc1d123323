"""`torch.histc(x, bins, min, max)`, which TVM 0.27's importer does not lower.

torch counts each element in `[min, max]` into bin `int((x - min) * bins / (max - min))`,
computed in x's dtype in that order, an element equal to `max` into the last bin; elements
outside (and NaN) are not counted. With `min == max` the range is x's own minimum and maximum,
widened by 1 on each side when those are equal too. The edges are taken in x's dtype. The bins
are one `scatter_elements` sum of ones (out-of-range elements add 0 to bin 0).
"""

from __future__ import annotations

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import _arg, _dtype


def histc(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """histc(x, bins=100, min=0, max=0) (see the module docstring)."""
    bb, op = importer.block_builder, relax.op
    x = importer.env[node.args[0]]
    dtype = _dtype(x)
    bins = int(_arg(node, 1, "bins", 100))
    low, high = float(_arg(node, 2, "min", 0)), float(_arg(node, 3, "max", 0))
    flat = bb.emit(op.reshape(x, [-1]))

    def const(value: float) -> relax.Expr:
        return relax.const(value, dtype)

    if low != high:
        lo, hi = const(low), const(high)
    else:  # x's own range; widened when x has one value
        lo, hi = bb.emit(op.min(flat)), bb.emit(op.max(flat))
        same = bb.emit(op.equal(lo, hi))
        lo = bb.emit(op.where(same, op.subtract(lo, const(1)), lo))
        hi = bb.emit(op.where(same, op.add(hi, const(1)), hi))
    inside = bb.emit(op.logical_and(op.greater_equal(flat, lo), op.less_equal(flat, hi)))
    scaled = bb.emit(op.divide(op.multiply(op.subtract(flat, lo), const(bins)), op.subtract(hi, lo)))
    index = bb.emit(op.astype(op.where(inside, scaled, const(0)), "int64"))
    index = bb.emit(op.minimum(index, relax.const(bins - 1, "int64")))  # x == max: the last bin
    ones = bb.emit(op.where(inside, const(1), const(0)))
    return bb.emit(op.scatter_elements(op.zeros([bins], dtype), index, ones, axis=0, reduction="add"))


CONVERTERS = {"histc.default": histc}

"""Converters for `xlogy(x, y) = x * log(y)` and `xlog1py(x, y) = x * log1p(y)`, 0 where x == 0
(NaN where y is NaN), with torch's gradients.

torch's decompositions spell them `where(x == 0, 0, x * log(y))`, and autodiff then gives x a
zero gradient at x = 0, where eager's is `dy * log(y)` (masked to 0 only where y <= 0, or
y <= -1 for log1p): an entropy or KL term's gradient at a zero probability was 0. And the
branch the `where` drops was differentiated as well: at x = y = 0 x's gradient was `0 * log(0)`,
NaN. Here the product is `x * log(y')`, with y' = y except where x == 0 and the logarithm has
no finite value (y <= 0 or y = inf; y <= -1 for log1p), where it is 1 (0 for log1p): the value
is 0 there, and the gradients are torch's. One difference stays: at x = 0, y <= 0 eager's
gradient for y is `x / y` (NaN at y = 0), here 0. lower.py keeps the ops whole.
"""

from __future__ import annotations

import math

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import operand, result_dtype
from .log1p_expm1 import log1p

op = relax.op


def _x_log(log, pole: float, neutral: float):  # noqa: ANN001, ANN202  (relax.op.log or _log1p)
    """x * log(y'): `pole` is where the logarithm is -inf, log(`neutral`) is 0."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        dtype = result_dtype(node)
        x, y = (operand(importer, arg, dtype) for arg in node.args[:2])
        x, y = (bb.emit(op.astype(v, dtype)) if v.ty.dtype.dtype != dtype else v for v in (x, y))
        infinite = op.logical_or(op.less_equal(y, relax.const(pole, dtype)), op.equal(y, relax.const(math.inf, dtype)))
        undefined = bb.emit(op.logical_and(op.equal(x, relax.const(0.0, dtype)), infinite))
        read = bb.emit(op.where(undefined, relax.const(neutral, dtype), y))
        return bb.emit(op.multiply(x, log(read)))

    return convert


xlogy = _x_log(op.log, 0.0, 1.0)
xlog1py = _x_log(log1p, -1.0, 0.0)

CONVERTERS = {
    "xlogy.Tensor": xlogy,
    "xlogy.Scalar_Self": xlogy,
    "xlogy.Scalar_Other": xlogy,
    "special_xlog1py.default": xlog1py,
    "special_xlog1py.self_scalar": xlog1py,
    "special_xlog1py.other_scalar": xlog1py,
}

"""Converters for activations whose stock TVM 0.27 conversion, or torch's decomposition, gives
other numbers than eager.

- `elu(x, alpha, scale, input_scale)`: SELU decomposes into it with scale 1.0507...; the stock
  converter read alpha only, so it came out silently wrong. CELU is the same with input_scale
  1/alpha (kept whole: its decomposition's `where` had the NaN gradient below). The branch for
  x <= 0 is computed on min(x, 0): its exp overflowed for x above 88, a NaN gradient.
- `softplus(x, beta, threshold)`, `mish(x)`: torch's decompositions spell softplus as
  `where(b x > threshold, x, log1p(exp(b x)) / b)`, and autodiff differentiates the branch the
  `where` drops as well: above x = 88, `exp(x)` is inf and `dlog1p * exp(x)` is `0 * inf`, so
  the gradient of a large input was NaN (eager: 1). Here both are `relax.nn.softplus`, one op
  whose gradient (gradients/activation.py) is torch's: `sigmoid(b x)`, or 1 above the threshold.
  lower.py keeps both ops whole.
"""

from __future__ import annotations

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import _arg, _dtype
from .log1p_expm1 import expm1


def elu(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """scale * (x if x > 0 else alpha * expm1(x * input_scale)) (log1p_expm1.py: exp(x) - 1
    gave 0 for x = -1e-20)."""
    alpha, scale, input_scale = (float(_arg(node, i, k, 1.0)) for i, k in ((1, "alpha"), (2, "scale"),
                                                                           (3, "input_scale")))
    return _elu(importer.block_builder, importer.env[node.args[0]], alpha, scale, input_scale)


def celu(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1)): an ELU with input_scale 1 / alpha."""
    alpha = float(_arg(node, 1, "alpha", 1.0))
    return _elu(importer.block_builder, importer.env[node.args[0]], alpha, 1.0, 1.0 / alpha)


def _elu(bb: relax.BlockBuilder, x: relax.Expr, alpha: float, scale: float, input_scale: float) -> relax.Expr:
    dtype = _dtype(x)

    def const(v: float) -> relax.Expr:
        return relax.const(v, dtype)

    positive_side = relax.op.greater(x, const(0.0))
    # The unused branch on min(x, 0): exp(x) overflowed for large x, and its zero share of the
    # gradient was 0 * inf = NaN (ELU/SELU/CELU trained to NaN on inputs near 90).
    below = relax.op.where(positive_side, const(0.0), x)  # (minimum's gradient splits the tie at 0)
    scaled = below if input_scale == 1.0 else relax.op.multiply(below, const(input_scale))
    negative = relax.op.multiply(const(alpha * scale), expm1(scaled, dtype))
    positive = x if scale == 1.0 else relax.op.multiply(x, const(scale))
    return bb.emit(relax.op.where(positive_side, positive, negative))


def softplus(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """log1p(exp(beta x)) / beta, or x where beta x > threshold."""
    x = importer.env[node.args[0]]
    beta, threshold = float(_arg(node, 1, "beta", 1.0)), float(_arg(node, 2, "threshold", 20.0))
    return importer.block_builder.emit(relax.op.nn.softplus(x, beta, threshold))


def mish(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x * tanh(softplus(x)); torch's kernel has no threshold, where softplus(x) = x to float
    precision (above 20, exp(-x) is below half an ulp of x)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    return bb.emit(relax.op.multiply(x, relax.op.tanh(bb.emit(relax.op.nn.softplus(x, 1.0, 20.0)))))


CONVERTERS = {
    "elu.default": elu,
    "celu.default": celu,
    "softplus.default": softplus,
    "mish.default": mish,
}

"""`log1p`, `expm1` and `atanh` accurate near zero, from Relax ops (so autodiff differentiates them).

Relax has no log1p or expm1: the stock converters computed `log(1 + x)` and `exp(x) - 1`, which lose
every digit of a small x to the rounding of 1 + x or of exp(x): `log1p(1e-8)` was 0,
`log1p(3e-6)` 2.98e-6, `expm1(-1e-6)` -1.0133e-6, ELU, SELU and CELU of -1e-20 0, and the
log-sigmoid of 25 (torch's decomposition: `min(x, 0) - log1p(exp(-|x|))`) 0. Near zero they
are series here (float32: 2 ulps of torch, float64: within 1e-15):

    log1p(x) = 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...),  s = x / (2 + x),  for 1 + x in (1/sqrt2, sqrt2)
    expm1(x) = x + x^2/2! + x^3/3! + ...,                                  for |x| < ln(2) / 2

and `log(1 + x)`, `exp(x) - 1` elsewhere, where 1 + x and exp(x) round by less than an ulp of
the result. Each series reads its input through a `where` that gives it 0 outside its range,
so that its unused branch has a finite gradient (a `where`'s gradient multiplies the branch it
drops by 0, and 0 * inf is NaN). 16-bit floats are computed in float32, as torch does.

`atanh` is `log1p(2x / (1 - x)) / 2` (TVM's `log((1 + x) / (1 - x)) / 2` gave atanh(1e-30) = 0).
Softplus and mish (`relax.nn.softplus`) take `log1p` in their legalization, and a float64 `tanh`
libm's (TVM's `(1 - e^-2x) / (1 + e^-2x)` gave tanh(1e-35) = 0): legalize_fixes.py.
"""

from __future__ import annotations

import math

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

# Terms of each series by dtype: enough that the first one left out is below half an ulp.
_LOG1P_TERMS = {"float32": 7, "float64": 12}
_EXPM1_TERMS = {"float32": 9, "float64": 16}
_LOG1P_LOW, _LOG1P_HIGH = math.sqrt(0.5) - 1.0, math.sqrt(2.0) - 1.0
_EXPM1_RANGE = math.log(2.0) / 2.0
_HALF = ("float16", "bfloat16")


def _dtype(x: relax.Expr) -> str:
    return x.ty.dtype.dtype


def _horner(t: relax.Expr, coefficients: list[float], dtype: str) -> relax.Expr:
    """coefficients[0] + t * (coefficients[1] + t * (...))."""
    acc = relax.const(coefficients[-1], dtype)
    for coefficient in reversed(coefficients[:-1]):
        acc = relax.op.add(relax.const(coefficient, dtype), relax.op.multiply(t, acc))
    return acc


def _in_float32(fn, x: relax.Expr, dtype: str) -> relax.Expr:  # noqa: ANN001  (log1p or expm1)
    """`fn` of a 16-bit float `x` in float32, rounded once to `dtype` (torch's opmath)."""
    return relax.op.astype(fn(relax.op.astype(x, "float32"), "float32"), dtype)


def log1p(x: relax.Expr, dtype: str | None = None) -> relax.Expr:
    """log(1 + x), accurate near 0 (see the module docstring); `dtype`: x's, when x is an
    expression not emitted yet."""
    dtype = dtype or _dtype(x)
    if dtype in _HALF:
        return _in_float32(log1p, x, dtype)
    if dtype not in _LOG1P_TERMS:
        return relax.op.log(relax.op.add(x, relax.const(1.0, dtype)))
    near = relax.op.logical_and(relax.op.greater(x, relax.const(_LOG1P_LOW, dtype)),
                                relax.op.less(x, relax.const(_LOG1P_HIGH, dtype)))
    zero, one, two = (relax.const(v, dtype) for v in (0.0, 1.0, 2.0))
    t = relax.op.where(near, x, zero)
    s = relax.op.divide(t, relax.op.add(two, t))
    series = relax.op.multiply(relax.op.multiply(two, s),
                               _horner(relax.op.multiply(s, s), [1.0 / (2 * k + 1) for k in range(_LOG1P_TERMS[dtype])], dtype))
    return relax.op.where(near, series, relax.op.log(relax.op.add(x, one)))


def expm1(x: relax.Expr, dtype: str | None = None) -> relax.Expr:
    """exp(x) - 1, accurate near 0 (see the module docstring); `dtype`: x's, when x is an
    expression not emitted yet."""
    dtype = dtype or _dtype(x)
    if dtype in _HALF:
        return _in_float32(expm1, x, dtype)
    one = relax.const(1.0, dtype)
    if dtype not in _EXPM1_TERMS:
        return relax.op.subtract(relax.op.exp(x), one)
    near = relax.op.less(relax.op.abs(x), relax.const(_EXPM1_RANGE, dtype))
    t = relax.op.where(near, x, relax.const(0.0, dtype))
    series = relax.op.multiply(t, _horner(t, [1.0 / math.factorial(k + 1) for k in range(_EXPM1_TERMS[dtype])], dtype))
    return relax.op.where(near, series, relax.op.subtract(relax.op.exp(x), one))


def atanh(x: relax.Expr, dtype: str | None = None) -> relax.Expr:
    """log((1 + x) / (1 - x)) / 2 as log1p(2x / (1 - x)) / 2: TVM's form lost a small x the same
    way (float32 atanh(1e-30) was 0)."""
    dtype = dtype or _dtype(x)
    if dtype not in _LOG1P_TERMS and dtype not in _HALF:
        return relax.op.atanh(x)
    one, two, half = (relax.const(v, dtype) for v in (1.0, 2.0, 0.5))
    return relax.op.multiply(half, log1p(relax.op.divide(relax.op.multiply(two, x), relax.op.subtract(one, x)), dtype))


def _converter(fn):  # noqa: ANN001, ANN202  (log1p, expm1 or atanh)
    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        return importer.block_builder.emit(fn(importer.env[node.args[0]]))

    return convert


CONVERTERS = {
    "log1p.default": _converter(log1p),
    "expm1.default": _converter(expm1),
    "atanh.default": _converter(atanh),
}

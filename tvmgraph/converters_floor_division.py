"""Converters for division with rounding: `a // b`, `torch.div(a, b, rounding_mode=...)` and
`torch.remainder(a, b)`, float results computed as torch computes them.

On floats, TVM's `floor_divide` is `floor(a / b)` and its `floor_mod` `a - floor(a / b) * b`:
both round the quotient before flooring it, and differ from torch, which starts from the exact
remainder `fmod(a, b)` (c10's `div_floor_floating`, ATen's remainder kernel):

    1.0 // 0.1         torch 9 (the exact quotient is 9.99999985), floor(a / b) 10
    1.0 % 0.1          torch 0.1, a - floor(a / b) * b -1.5e-08 (negative for a positive divisor)
    inf // 2           torch NaN, here inf          -1 // inf   torch -1, here -0
    1 % inf            torch 1, here NaN            -1 % inf    torch inf, here NaN

Here, for floats: `mod = fmod(a, b)` (`relax.mod`, LLVM's frem), then torch's corrections of
it. float16/bfloat16 compute in float32 and round once, as torch's CPU kernels do (TVM has no
16-bit frem). Integer division keeps TVM's ops, which are exact. Rounded quotients have no gradient (as in
torch); the remainder's is autodiff's of its formula: `dy` for a, `-dy * floor(a / b)` for b.
"""

from __future__ import annotations

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import as_dtype, operand, result_dtype

op = relax.op
_OPMATH = {"float16": "float32", "bfloat16": "float32"}


def divide_rounded(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """div(a, b, rounding_mode=None/'trunc'/'floor') with a scalar in the tensor's dtype (the
    stock converter made an int64 tensor and an int32 constant, and failed to compile)."""
    bb = importer.block_builder
    dtype = result_dtype(node)
    mode = node.kwargs.get("rounding_mode")
    if "float" in dtype:
        # torch divides in float32, a Python number as it is (x_bf16 / 0.3: by 0.3, not 0.30078)
        a, b = (as_dtype(bb, as_dtype(bb, importer.env[v], dtype), _OPMATH.get(dtype, dtype))
                if isinstance(v, torch.fx.Node) else relax.const(v, _OPMATH.get(dtype, dtype)) for v in node.args[:2])
        if mode is None:
            return as_dtype(bb, bb.emit(op.divide(a, b)), dtype)
        if mode == "trunc":
            return as_dtype(bb, bb.emit(op.trunc(op.divide(a, b))), dtype)
        quotient = floor_quotient(bb, op.grad.no_grad(a), op.grad.no_grad(b), _OPMATH.get(dtype, dtype))
        return as_dtype(bb, bb.emit(quotient), dtype)
    a, b = (as_dtype(bb, operand(importer, v, dtype), dtype) for v in node.args[:2])
    if mode is None:
        return bb.emit(op.divide(a, b))
    floored = bb.emit(op.floor_divide(a, b))
    if mode == "floor":
        return floored
    # trunc: one more than floor where the exact quotient is negative and not whole
    zero = relax.const(0, dtype)
    inexact = op.not_equal(op.subtract(a, op.multiply(floored, b)), zero)
    negative = op.logical_xor(op.less(a, zero), op.less(b, zero))
    return bb.emit(op.where(op.logical_and(inexact, negative), op.add(floored, relax.const(1, dtype)), floored))


def remainder(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """remainder(a, b) (Tensor, Scalar, Scalar_Tensor): Python's modulo, with b's sign (a Python
    number in the result's dtype first, as torch's: x_bf16 % 0.1 is modulo 0.10009766)."""
    bb = importer.block_builder
    dtype = result_dtype(node)
    a, b = (as_dtype(bb, operand(importer, v, dtype), dtype) for v in node.args[:2])
    if "float" not in dtype:
        return bb.emit(op.floor_mod(a, b))
    opmath = _OPMATH.get(dtype, dtype)
    a, b = (as_dtype(bb, v, opmath) for v in (a, b))
    mod = bb.emit(op.mod(a, b))
    return as_dtype(bb, bb.emit(op.where(_sign_differs(mod, b, opmath), op.add(mod, b), mod)), dtype)


def floor_quotient(bb: relax.BlockBuilder, a: relax.Expr, b: relax.Expr, dtype: str) -> relax.Expr:
    """floor of the exact quotient a / b, as c10's div_floor_floating: `(a - fmod(a, b)) / b`
    (whole up to rounding), one less where the remainder's sign is not b's, rounded to the
    nearest whole; a zero quotient keeps the sign of a / b, and a zero divisor gives a / b."""
    zero, one, half = (relax.const(v, dtype) for v in (0.0, 1.0, 0.5))
    quotient = bb.emit(op.divide(a, b))
    mod = bb.emit(op.mod(a, b))
    whole = op.divide(op.subtract(a, mod), b)
    whole = bb.emit(op.where(_sign_differs(mod, b, dtype), op.subtract(whole, one), whole))
    floored = op.floor(whole)
    nearest = op.where(op.greater(op.subtract(whole, floored), half), op.add(floored, one), floored)
    # copysign(0, a / b): 1 / q is -inf for q = -0 and negative for every negative q
    signed_zero = op.where(op.less(op.divide(one, quotient), zero), relax.const(-0.0, dtype), zero)
    rounded = op.where(op.not_equal(whole, zero), nearest, signed_zero)
    return op.where(op.equal(b, zero), quotient, rounded)


def _sign_differs(mod: relax.Expr, b: relax.Expr, dtype: str) -> relax.Expr:
    """mod != 0 and (b < 0) != (mod < 0): where a remainder from fmod takes b's sign."""
    zero = relax.const(0.0, dtype)
    return op.logical_and(op.not_equal(mod, zero), op.not_equal(op.less(b, zero), op.less(mod, zero)))


CONVERTERS = {
    "div.Tensor_mode": divide_rounded,
    "div.Scalar_mode": divide_rounded,
    "remainder.Tensor": remainder,
    "remainder.Scalar": remainder,
    "remainder.Scalar_Tensor": remainder,
}

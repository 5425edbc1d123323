"""`pow` of integer tensors (`torch.pow(a, b)`, `2 ** b`, `a ** 3` on int64/int32/int8/uint8),
exact, as torch's integer kernel computes it.

TVM's `relax.power` takes floats only: an integer `pow` stopped the compile ("power only applies
to float"), and a float64 detour would round every result above 2 ** 53 (5 ** 27). Here it is
square-and-multiply over the exponent's bits in the result dtype, which wraps on overflow as
torch's does; a negative exponent gives torch's values: 1 for a base of 1, +-1 for -1 (by the
exponent's parity), 0 for any other base. A float power of an integer tensor (`2.0 ** b`)
casts the exponent first (the importer's kept int64); a scalar exponent keeps converters.py's.
"""

from __future__ import annotations

import numpy as np
import torch
import tvm_ffi
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from relay_passes import OPAQUE

from .converters_nn import as_dtype, operand, result_dtype


def integer_power(key: str, float_converter=None):  # noqa: ANN001, ANN201  (a converter or None)
    """The converter of `key`: integer results by `_kernel`'s loop, the rest by `float_converter`, or
    (None) as `relax.power` of both operands in the result's dtype."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        dtype = result_dtype(node)
        if "int" not in dtype and float_converter is not None:
            return float_converter(node, importer)
        bb = importer.block_builder
        base, exponent = (as_dtype(bb, operand(importer, v, dtype), dtype) for v in node.args[:2])
        if "int" not in dtype:  # `2.0 ** int_tensor`: the importer's power kept int64
            return bb.emit(relax.op.power(base, exponent))
        return call_elementwise(bb, _kernel(dtype), "integer_power", "integer pow", base, exponent)

    return convert


def call_elementwise(bb: relax.BlockBuilder, kernel: tirx.PrimFunc, name: str, what: str, a: relax.Expr,
                     b: relax.Expr) -> relax.Expr:
    """`kernel` (a PrimFunc of three flat buffers of one length and dtype: a, b, out), added to the
    module as `name`, on `a` and `b` broadcast to one shape, as Relax infers it for an
    elementwise op of the two (`what` names the op in the error when that shape is unknown)."""
    shape = bb.normalize(relax.op.multiply(a, b)).ty.shape
    if shape is None:  # (a symbolic size against a slice of unknown length)
        raise NotImplementedError(f"{what} of two tensors whose broadcast shape is only known when the "
                                  "program runs: expand them to one shape first")
    flat = []
    for v in (a, b):
        if not tvm_ffi.structural_equal(v.ty.shape, shape):
            v = bb.emit(relax.op.broadcast_to(v, shape))
        flat.append(bb.emit(relax.op.reshape(v, [-1])))
    result = bb.emit(relax.call_tir(bb.add_func(kernel, name), flat, flat[0].ty))
    return bb.emit(relax.op.reshape(result, shape))


def _kernel(dtype: str) -> tirx.PrimFunc:
    """(x[n], e[n]) -> x ** e[n]: square-and-multiply over e's bits, a serial loop per element
    (as one expression, each square is a tree twice the last one's size: TVM's simplifier
    inlines let-bound steps, and its recursion overflowed the stack at 32 bits). Marked
    scheduled: elementwise on integers, no schedule rule has anything to add."""
    bits = np.dtype(dtype).itemsize * 8

    signed = not dtype.startswith("uint")

    @T.prim_func(private=True, s_tir=True)
    def integer_power(a: T.handle, b: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        n = T.int64()
        x = T.match_buffer(a, (n,), dtype)
        e = T.match_buffer(b, (n,), dtype)
        out = T.match_buffer(c, (n,), dtype)
        with T.sblock("root"):
            for i in range(n):
                with T.sblock("integer_power"):
                    v = T.axis.spatial(n, i)
                    T.reads(x[v], e[v])
                    T.writes(out[v])
                    step = T.sblock_alloc_buffer((2,), dtype, scope="local")  # result, square
                    step[0] = T.Cast(dtype, 1)
                    step[1] = x[v]
                    for bit in range(bits):
                        if T.bitwise_and(T.shift_right(e[v], T.Cast(dtype, bit)), T.Cast(dtype, 1)) == T.Cast(dtype, 1):
                            step[0] = step[0] * step[1]
                        step[1] = step[1] * step[1]
                    # NOTE: one store per element: a store of step[0] then an overwrite under
                    # `if e < 0` gave 0 for (-3) ** 3 (TVM 0.27).
                    if signed and e[v] < T.Cast(dtype, 0):  # torch: 1 ** -k = 1, (-1) ** -k = +-1, else 0
                        out[v] = T.Select(x[v] == T.Cast(dtype, 1), T.Cast(dtype, 1),
                                          T.Select(x[v] == T.Cast(dtype, -1), T.Select(
                                              T.bitwise_and(e[v], T.Cast(dtype, 1)) == T.Cast(dtype, 1),
                                              T.Cast(dtype, -1), T.Cast(dtype, 1)), T.Cast(dtype, 0)))
                    else:
                        out[v] = step[0]

    return integer_power

"""`torch.gcd` and `torch.lcm` of integer tensors, as torch's kernels compute them.

TVM has no gcd. torch's (aten/src/ATen/native/Math.h, `calc_gcd`) takes absolute values, then
runs Euclid's loop `while a != 0: a, b = b % a, a` with C's truncating `%`; lcm is
`g == 0 ? 0 : abs(a / g * b)` in the result dtype. Here the loop runs a fixed number of rounds,
each a no-op once `a` is 0: Euclid's steps on two w-bit numbers are fewer than 1.5 w + 2 (the
worst case, consecutive Fibonacci numbers, takes log_phi(2 ** w) ~ 1.44 w). Where C's
arithmetic is undefined, results may differ: abs of the dtype's minimum (torch's
gcd(INT64_MIN, 6) is -2, its compiler's choice; 2 here) and an lcm that overflows.
"""

from __future__ import annotations

import numpy as np
import torch
from tvm import relax, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter
from tvm.script import tirx as T

from relay_passes import OPAQUE

from .converters_integer_power import call_elementwise
from .converters_nn import as_dtype, operand, result_dtype


def _kernel(dtype: str, lcm: bool) -> tirx.PrimFunc:
    """(x[n], y[n]) -> gcd (or lcm) elementwise, Euclid's loop per element, in C's promoted type
    (int32 for narrower types: torch's int8 lcm(-127, 6) is abs(-762) cast to int8, -6). Marked
    scheduled: elementwise on integers, no schedule rule has anything to add."""
    wide = dtype if np.dtype(dtype).itemsize >= 4 else "int32"
    rounds = np.dtype(wide).itemsize * 12 + 2
    zero = T.Cast(wide, 0)

    @T.prim_func(private=True, s_tir=True)
    def gcd(a: T.handle, b: T.handle, c: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        n = T.int64()
        x = T.match_buffer(a, (n,), dtype)
        y = T.match_buffer(b, (n,), dtype)
        out = T.match_buffer(c, (n,), dtype)
        with T.sblock("root"):
            for i in range(n):
                with T.sblock("gcd"):
                    v = T.axis.spatial(n, i)
                    T.reads(x[v], y[v])
                    T.writes(out[v])
                    xv: T.let = T.Cast(wide, x[v])
                    yv: T.let = T.Cast(wide, y[v])
                    ab = T.sblock_alloc_buffer((2,), wide, scope="local")
                    ab[0] = T.Select(xv < zero, zero - xv, xv)
                    ab[1] = T.Select(yv < zero, zero - yv, yv)
                    for _ in range(rounds):
                        if ab[0] != zero:
                            remainder: T.let = T.truncmod(ab[1], ab[0])
                            ab[1] = ab[0]
                            ab[0] = remainder
                    if lcm:
                        if ab[1] == zero:
                            out[v] = T.Cast(dtype, 0)
                        else:
                            product: T.let = T.truncdiv(xv, ab[1]) * yv
                            out[v] = T.Cast(dtype, T.Select(product < zero, zero - product, product))
                    else:
                        out[v] = T.Cast(dtype, ab[1])

    return gcd


def gcd_or_lcm(lcm: bool):
    """The converter of torch.gcd (or torch.lcm)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        dtype = result_dtype(node)
        if "int" not in dtype:
            raise NotImplementedError(f"{'lcm' if lcm else 'gcd'} of {dtype} (torch's takes integers only)")
        bb = importer.block_builder
        a, b = (as_dtype(bb, operand(importer, value, dtype), dtype) for value in node.args[:2])
        name = "lcm" if lcm else "gcd"
        return call_elementwise(bb, _kernel(dtype, lcm), name, name, a, b)

    return convert


CONVERTERS = {"gcd.default": gcd_or_lcm(False), "lcm.default": gcd_or_lcm(True)}

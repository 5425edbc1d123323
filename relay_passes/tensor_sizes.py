"""Sizes of Relax tensor types, and how the memory passes print them."""

from __future__ import annotations

import math

import tvm
from tvm import relax


def static_bytes(ty: object) -> int | None:
    """Bytes of a tensor type, or of all fields of a tuple type, with a static shape; else None."""
    if isinstance(ty, relax.TupleType):
        fields = [static_bytes(field) for field in ty.fields]
        return None if None in fields else sum(fields)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    dtype = ty.dtype.dtype
    return math.prod(int(d) for d in dims) * ((dtype.bits * dtype.lanes + 7) // 8)


def format_bytes(nbytes: int) -> str:
    """MiB with one decimal; KiB below a tenth of a MiB."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes / 2**10:.1f} KiB"

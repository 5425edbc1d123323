"""Sizes of Relax tensor types, and how the memory passes print them."""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.sym import Analyzer


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
    return math.prod(int(d) for d in dims) * _element_bytes(ty)


def static_shape(expr: relax.Expr, dtype: str | None = None) -> tuple[int, ...] | None:
    """The shape of a tensor expression (of `dtype`, if given) when every dimension is a
    constant; else None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    if dtype is not None and str(ty.dtype) != dtype:
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def bytes_per_unit(ty: object) -> tuple[int, tvm.tirx.Var | None] | None:
    """(bytes, None) for a tensor type of static shape; (bytes per unit of `var`, var) for one
    whose size is a constant times a single symbolic variable (a dynamic batch: (n, 3, 32, 32),
    or (n * 128, 256) after a reshape); else None."""
    nbytes = static_bytes(ty)
    if nbytes is not None:
        return nbytes, None
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    free = {v for d in dims for v in tvm.tirx.analysis.undefined_vars(d)}
    if len(free) != 1:
        return None
    (var,) = free
    elements = math.prod(dims)
    at_one = Analyzer()
    at_one.bind(var, tvm.tirx.IntImm("int64", 1))
    per_unit = at_one.simplify(elements)
    if not isinstance(per_unit, tvm.tirx.IntImm) or int(per_unit) <= 0 \
            or not Analyzer().can_prove_equal(elements, per_unit * var):
        return None
    return int(per_unit) * _element_bytes(ty), var


def _element_bytes(ty: relax.TensorType) -> int:
    dtype = ty.dtype.dtype
    return (dtype.bits * dtype.lanes + 7) // 8


def format_bytes(nbytes: int) -> str:
    """MiB with one decimal; KiB below a tenth of a MiB; bytes below a KiB (an arena's bytes per
    row of a dynamic batch)."""
    if nbytes < 2**10:
        return f"{nbytes} B"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes / 2**10:.1f} KiB"

"""Legalizations of TVM 0.27 replaced where they fail on programs torch produces.

- `relax.full`, `relax.full_like` with an infinite or NaN fill (`torch.full((T, T),
  float("-inf")).triu(1)`, the causal mask of `nn.Transformer.generate_square_subsequent_mask`):
  TOPI's `full` checks `"float" in dtype` and gets a dtype object, so LegalizeOps raised
  "argument of type 'PrimType' is not iterable". Here the dtype goes as a string.

- `relax.split` at indices that leave a part empty (`x.split([0, 5], 1)` of a dim of 5, OpInfo's
  `split` samples, training): TOPI's `split` requires strictly increasing indices inside the
  axis ("split_indices must be sorted"). Here each part is a strided slice, an empty one an
  empty `full`.

Importing this module registers them (at a level above TVM's own).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx, topi
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const
from tvm.relax.transform.legalize_ops.manipulate import _split as tvm_split

_LEVEL = 11  # TVM registers its legalizations at level 10


def _full(is_like: bool):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        fill = _try_convert_to_scalar_const(call.args[1], python_native=True)
        shape = call.args[0].ty.shape if is_like else call.args[0]
        if isinstance(shape, relax.ShapeExpr):
            dims = shape.values
        else:  # a shape computed at run time
            shape = bb.emit(shape)
            dims = [tirx.Var(f"s{i}", "int64") for i in range(shape.ty.ndim)]
            bb.match_cast(shape, relax.ShapeType(dims))
        return bb.call_te(topi.full, dims, str(call.ty.dtype.dtype), fill, primfunc_name_hint="full")

    return legalize


tvm.ir.register_op_attr("relax.full", "FLegalize", _full(is_like=False), level=_LEVEL)
tvm.ir.register_op_attr("relax.full_like", "FLegalize", _full(is_like=True), level=_LEVEL)


def split_bounds(call: relax.Call) -> list[tuple[int, tirx.PrimExpr]] | None:
    """[begin, end) of each part of `relax.split` call along its axis, in order, each end at
    least its begin and at most the axis's extent (a symbolic extent: the last end); None
    when the parts are not known here (sections of a symbolic or indivisible extent)."""
    shape = call.args[0].ty.shape
    if shape is None:
        return None
    extent = shape[int(call.attrs.axis) % len(shape)]
    static = int(extent) if isinstance(extent, tirx.IntImm) else None
    sections = call.attrs.indices_or_sections
    if isinstance(sections, tirx.IntImm):
        if static is None or static % int(sections):
            return None
        cuts = [static // int(sections) * k for k in range(1, int(sections))]
    else:
        cuts = [int(c) for c in sections]
    bounds, start = [], 0
    for cut in cuts:
        end = max(cut, start) if static is None else min(max(cut, start), static)
        bounds.append((start, end))
        start = end
    return [*bounds, (start, extent)]


def _split(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    shape = list(x.ty.shape)
    axis = int(call.attrs.axis) % len(shape)
    bounds = split_bounds(call)
    if bounds is None or not isinstance(shape[axis], tirx.IntImm) or all(lo < int(hi) for lo, hi in bounds):
        return tvm_split(bb, call)
    parts = []
    for lo, hi in bounds:
        if int(hi) > lo:
            parts.append(bb.emit(bb.call_te(topi.strided_slice, x, [lo], [int(hi)], [1], axes=[axis],
                                            primfunc_name_hint="split_part")))
        else:
            empty = [*shape[:axis], 0, *shape[axis + 1:]]
            parts.append(bb.emit(bb.call_te(topi.full, empty, str(x.ty.dtype), 0.0, primfunc_name_hint="empty_part")))
    return relax.Tuple(parts)


tvm.ir.register_op_attr("relax.split", "FLegalize", _split, level=_LEVEL)

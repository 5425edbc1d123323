"""Legalizations of TVM 0.27 replaced where they fail on programs torch produces.

- `relax.full`, `relax.full_like` with an infinite or NaN fill (`torch.full((T, T),
  float("-inf")).triu(1)`, the causal mask of `nn.Transformer.generate_square_subsequent_mask`):
  TOPI's `full` checks `"float" in dtype` and gets a dtype object, so LegalizeOps raised
  "argument of type 'PrimType' is not iterable". Here the dtype goes as a string.

- `relax.split` at indices that leave a part empty (`x.split([0, 5], 1)` of a dim of 5, OpInfo's
  `split` samples, training): TOPI's `split` requires strictly increasing indices inside the
  axis ("split_indices must be sorted"). Here each part is a strided slice, an empty one an
  empty `full`.

- `relax.index_put` with `accumulate=True` (`x.index_add_(0, idx, v)`, `x.index_put_(...,
  accumulate=True)`, `x[idx] += v` as torch.export writes it): TOPI's kernel adds each value in a
  parallel loop over the values, `out[index[k]] += values[k]`, so two threads adding at one
  repeated index raced and one sum was lost (a graph neural net's `index_add_` over an edge
  list: 1 call in 8 wrong by up to 2.5, a different call each time). Here the adds run as
  TOPI's `scatter_elements` does them, serially along the indexed axis, on x flattened.

Importing this module registers them (at a level above TVM's own).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx, topi
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const
from tvm.relax.transform.legalize_ops.manipulate import _index_put as tvm_index_put
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


def _accumulate_into(data: te.Tensor, *rest: te.Tensor) -> te.Tensor:
    """`data` with `values` added at `indices` (one index tensor per dim of data, broadcast
    together; negative indices count from the end), repeated indices summed."""
    *indices, values = rest
    shape = [int(d) for d in topi.utils.get_const_tuple(data.shape)]
    broadcast = list(np.broadcast_shapes(*[tuple(int(d) for d in topi.utils.get_const_tuple(i.shape)) for i in indices]))
    count = int(np.prod(broadcast, dtype=np.int64))
    indices = [topi.reshape(topi.broadcast_to(i, broadcast), (count,)) for i in indices]
    if int(np.prod(topi.utils.get_const_tuple(values.shape), dtype=np.int64)) != count:
        values = topi.broadcast_to(values, broadcast)
    values = topi.reshape(values, (count,))

    def flat_index(k: tirx.PrimExpr) -> tirx.PrimExpr:
        flat = tirx.const(0, "int64")
        for index, size in zip(indices, shape):
            i = index[k].astype("int64")
            flat = flat * size + tirx.Select(i < 0, i + size, i)
        return flat

    flat = te.compute((count,), flat_index, name="flat_index")
    total = int(np.prod(shape, dtype=np.int64))
    summed = topi.scatter_elements(topi.reshape(data, (total,)), flat, values, axis=0, reduction="add")
    return topi.reshape(summed, shape)


def _index_put(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    indices = call.args[1]
    fields = list(indices.fields) if isinstance(indices, relax.Tuple) else [indices]
    static = all(isinstance(d, tirx.IntImm) for e in (call.args[0], *fields, call.args[2])
                 for d in (e.ty.shape or [None]))
    if not call.attrs.accumulate or not static:
        return tvm_index_put(bb, call)
    return bb.call_te(_accumulate_into, call.args[0], *fields, call.args[2], primfunc_name_hint="index_put_add")


tvm.ir.register_op_attr("relax.index_put", "FLegalize", _index_put, level=_LEVEL)

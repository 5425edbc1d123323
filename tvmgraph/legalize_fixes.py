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
  list: 1 call in 8 wrong by up to 2.5, a different call each time); its plain writes too, so
  that of values written at one index the first could win (eager's CPU kernel: the last). Here
  the adds and writes run as TOPI's `scatter_elements` does them, serially along the indexed
  axis, on x flattened. Every
  `index_put` (accumulating or not) also counts negative indices from the end and clamps them
  into x here, where sizes may be symbolic (a dynamic batch: the converter's relax ops could
  not, and such a graph failed to compile).

- `relax.scatter_elements` whose index is smaller than x in a dimension other than the
  scattered one (`x.scatter_add(2, idx, src)` with x (3, 4, 5) and idx (3, 3, 5), allowed by
  torch; the gradient of such a `gather`): TOPI's kernel numbers the index's rows as if they were
  x's, and wrote to the wrong elements (3.6 off eager, silently). Here the index and the updates
  are widened to x's shape, the extra entries pointing at one more slot along the axis, which
  is cut off after the scatter.

- `relax.nn.instance_norm` of float64 (an `InstanceNorm`, and a `BatchNorm` with `momentum=None`
  or without running statistics in training, which the importer writes as an instance norm, in a
  `model.double()`): TOPI's kernel takes float32 and float16 only ("instance_norm: only support
  float32 and float16"). Other dtypes are computed here in TE, in their own precision; float32
  too, in two passes (TOPI's E[x^2] - E[x]^2 cancelled on data with a large mean).

- `relax.astype` from float32 to bfloat16: TVM's BF16 legalization computes bfloat16 in float32
  inside a kernel and rounds only where it stores a bfloat16 buffer, so a cast fused with its
  readers rounded nothing (`x.to(torch.bfloat16).float() - x` was 0: fake quantization and
  precision emulation learned nothing). Here the value is rounded to the nearest bfloat16 (ties
  to even, as torch) in float32 bits before the cast.

- `relax.nn.softplus` (softplus, mish): TOPI's `log(1 + exp(beta x)) / beta` lost the digits
  of a small exp(beta x) to 1 + exp: softplus(-16) came out 1.19e-7 (eager 1.125e-7), and 0 from
  -17 down. Here `log1p` (tvmgraph/log1p_expm1.py has the Relax-level one).

- `relax.tanh` of float64: TVM's LLVM lowering `(1 - e^-2x) / (1 + e^-2x)` lost a small x
  (tanh(1e-35) was 0, tanh(1e-12) 1e-12 * (1 - 2e-5)). Here libm's `tanh`; float32 keeps
  TVM's (schedules/fast_math.py makes it a rational function, exact near zero).

Importing this module registers them (at a level above TVM's own).
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import tvm
from tvm import relax, te, tirx, topi
from tvm.sym import Analyzer
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const
from tvm.relax.transform.legalize_ops.datatype import _astype as tvm_astype
from tvm.relax.transform.legalize_ops.manipulate import _index_put as tvm_index_put
from tvm.relax.transform.legalize_ops.manipulate import _is_gpu_target
from tvm.relax.transform.legalize_ops.manipulate import _scatter_elements as tvm_scatter_elements
from tvm.relax.transform.legalize_ops.nn import _nn_instance_norm as tvm_instance_norm
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


def broadcast_shape(shapes: list[list[tirx.PrimExpr]]) -> list[tirx.PrimExpr] | None:
    """The shape `shapes` broadcast to (index tensors'): numpy's rules where every size is
    known (as int64 constants), their common shape where some are symbolic (a dynamic batch)
    and all are equal; else None."""
    if all(isinstance(d, tirx.IntImm) for dims in shapes for d in dims):
        known = np.broadcast_shapes(*[tuple(int(d) for d in dims) for dims in shapes])
        return [tirx.IntImm("int64", int(d)) for d in known]
    analyzer = tvm.sym.Analyzer()
    if all(len(dims) == len(shapes[0]) and all(analyzer.can_prove_equal(a, b) for a, b in zip(dims, shapes[0]))
           for dims in shapes):
        return list(shapes[0])
    return None


def _put(data: te.Tensor, *rest: te.Tensor, accumulate: bool) -> te.Tensor:
    """`data` with `values` written (or added) at `indices`, one index tensor per dim of data,
    broadcast together, flattened to one position per value; negative indices count from the
    end and every index is clamped into data (as `take`'s). Added values at a repeated index
    are summed one after the other; without `accumulate`, written one after the other: the
    last wins, as in eager on the CPU (TOPI's index_put wrote them in parallel, and `h[idx] =
    v` with a repeated index kept the first of them in a graph where eager keeps the last)."""
    *indices, values = rest
    shape = list(data.shape)
    common = broadcast_shape([list(i.shape) for i in indices])
    static = all(isinstance(d, tirx.IntImm) for d in common)
    if static:
        common = [int(d) for d in common]
    count = functools.reduce(operator.mul, common, 1)
    indices = [topi.reshape(topi.broadcast_to(i, common), (count,)) for i in indices]
    values = topi.reshape(topi.broadcast_to(values, common), (count,))

    def inside(index: te.Tensor, size: tirx.PrimExpr) -> te.Tensor:
        def at(k):
            i = index[k].astype("int64")
            size64 = tirx.Cast("int64", size)
            return tirx.max(tirx.min(tirx.Select(i < 0, i + size64, i), size64 - 1), tirx.const(0, "int64"))
        return te.compute((count,), at, name="index_inside")

    indices = [inside(i, size) for i, size in zip(indices, shape)]
    flat = te.compute((count,), lambda k: functools.reduce(
        lambda f, pair: f * tirx.Cast("int64", pair[1]) + pair[0][k], zip(indices, shape), tirx.const(0, "int64")),
        name="flat_index")
    total = functools.reduce(operator.mul, shape, 1)
    put = topi.scatter_elements(topi.reshape(data, (total,)), flat, values, axis=0,
                                reduction="add" if accumulate else "update")
    return topi.reshape(put, shape)


def _index_put(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    indices = call.args[1]
    fields = list(indices.fields) if isinstance(indices, relax.Tuple) else [indices]
    shapes = [f.ty.shape for f in fields]
    if any(s is None for s in shapes) or broadcast_shape([list(s.values) for s in shapes]) is None:
        return tvm_index_put(bb, call)
    return bb.call_te(_put, call.args[0], *fields, call.args[2], accumulate=bool(call.attrs.accumulate),
                      primfunc_name_hint="index_put_add" if call.attrs.accumulate else "index_put")


tvm.ir.register_op_attr("relax.index_put", "FLegalize", _index_put, level=_LEVEL)


def _widened_scatter(data: te.Tensor, indices: te.Tensor, updates: te.Tensor, axis: int, reduction: str,
                     scatter) -> te.Tensor:
    """`scatter(data, indices, updates, axis, reduction)` with the index and updates widened to
    data's shape in every dimension but `axis`: the entries added point at a slot after the
    last along `axis`, appended to data here and cut off after the scatter."""
    ndim, size = len(data.shape), data.shape[axis]
    small = indices.shape

    def inside(i: tuple) -> tirx.PrimExpr:
        return functools.reduce(tirx.And, [i[d] < small[d] for d in range(ndim) if d != axis], tirx.const(True))

    def at(tensor: te.Tensor, i: tuple) -> tirx.PrimExpr:  # clamped, read only where inside
        return tensor(*[tirx.min(i[d], small[d] - 1) if d != axis else i[d] for d in range(ndim)])

    def index(*i) -> tirx.PrimExpr:
        k, n = at(indices, i), tirx.Cast(indices.dtype, size)
        return tirx.Select(inside(i), tirx.Select(k < 0, k + n, k), n)

    wide = [small[axis] if d == axis else data.shape[d] for d in range(ndim)]
    longer = [size + 1 if d == axis else data.shape[d] for d in range(ndim)]
    slot = te.compute(longer, lambda *i: tirx.Select(
        i[axis] < size, data(*[tirx.min(i[d], size - 1) if d == axis else i[d] for d in range(ndim)]),
        tirx.const(0, data.dtype)), name="with_slot")
    out = scatter(slot, te.compute(wide, index, name="wide_index"),
                  te.compute(wide, lambda *i: tirx.Select(inside(i), at(updates, i), tirx.const(0, updates.dtype)),
                             name="wide_updates"),
                  axis, reduction)
    return te.compute(data.shape, lambda *i: out(*i), name="scattered")


def _scatter_elements(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    data, indices = call.args[0], call.args[1]
    ndim = data.ty.ndim
    axis = int(call.attrs.axis) % ndim
    analyzer = Analyzer()
    if data.ty.shape is None or indices.ty.shape is None or all(
            analyzer.can_prove_equal(a, b) for d, (a, b) in enumerate(zip(data.ty.shape.values, indices.ty.shape.values))
            if d != axis):
        return tvm_scatter_elements(bb, call)
    scatter = topi.gpu.scatter_elements if _is_gpu_target() else topi.scatter_elements
    widened = functools.partial(_widened_scatter, axis=axis, reduction=str(call.attrs.reduction), scatter=scatter)
    return bb.call_te(widened, data, indices, call.args[2], primfunc_name_hint="scatter_elements")


tvm.ir.register_op_attr("relax.scatter_elements", "FLegalize", _scatter_elements, level=_LEVEL)


def _rounded_to_bfloat16(x: te.Tensor) -> te.Tensor:
    """Cast(bfloat16, x) of x rounded to bfloat16's 8 bits of mantissa in its float32 bits: add
    0x7FFF plus the lowest kept bit (ties to even), clear the low 16 bits; a NaN is torch's
    0x7FC0. All in integers: under fast math LLVM folded a float select on isnan(x) (NaN - NaN
    came out 0)."""
    u32 = functools.partial(tirx.const, dtype="uint32")

    def value(*index: tirx.PrimExpr) -> tirx.PrimExpr:
        bits = tirx.reinterpret("uint32", x(*index))
        rounded = (bits + u32(0x7FFF) + ((bits >> 16) & u32(1))) & u32(0xFFFF0000)
        nan = (bits & u32(0x7FFFFFFF)) > u32(0x7F800000)
        return tirx.Cast("bfloat16", tirx.reinterpret("float32", tirx.Select(nan, u32(0x7FC00000), rounded)))

    return te.compute(x.shape, value, name="to_bfloat16")


def _astype(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    arg = call.args[0]
    if (str(call.attrs.dtype) == "bfloat16" and isinstance(arg.ty, relax.TensorType)
            and str(arg.ty.dtype.dtype) == "float32"):
        return bb.call_te(_rounded_to_bfloat16, arg, primfunc_name_hint="cast")
    return tvm_astype(bb, call)


tvm.ir.register_op_attr("relax.astype", "FLegalize", _astype, level=_LEVEL)


def _instance_norm(data: te.Tensor, gamma: te.Tensor, beta: te.Tensor, channel_axis: int,
                   axes: list[int], epsilon: float) -> te.Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + beta over `axes`, gamma and beta along the
    channel axis, in x's own dtype."""
    dtype = data.dtype
    # A symbolic count under a dynamic batch (F.batch_norm without running statistics reaches
    # here, its batch among the axes).
    count = tirx.Cast(dtype, functools.reduce(operator.mul, [data.shape[a] for a in axes]))
    mean = topi.divide(topi.sum(data, axis=axes, keepdims=True), count)
    centered = topi.subtract(data, mean)
    var = topi.divide(topi.sum(topi.multiply(centered, centered), axis=axes, keepdims=True), count)
    inverse = topi.divide(tirx.const(1.0, dtype), topi.sqrt(topi.add(var, tirx.const(epsilon, dtype))))
    along = [d if i == channel_axis else 1 for i, d in enumerate(data.shape)]
    scaled = topi.multiply(topi.multiply(centered, inverse), topi.reshape(gamma, along))
    return topi.add(scaled, topi.reshape(beta, along))


def _nn_instance_norm(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Two passes (the mean, then the squares of x - mean) for float32 and float64: TOPI's
    E[x^2] - E[x]^2 cancelled on data with a large mean (float32 InstanceNorm of x + 300 with
    std 0.1: half of eager's values, and NaN)."""
    data = call.args[0]
    if str(data.ty.dtype.dtype) == "float16" or data.ty.shape is None:
        return tvm_instance_norm(bb, call)
    channel_axis = int(call.attrs.channel_axis) % data.ty.ndim
    axes = [int(a) % data.ty.ndim for a in call.attrs.axes]
    return bb.call_te(_instance_norm, data, call.args[1], call.args[2], channel_axis, axes,
                      float(call.attrs.epsilon), primfunc_name_hint="instance_norm")


tvm.ir.register_op_attr("relax.nn.instance_norm", "FLegalize", _nn_instance_norm, level=_LEVEL)


def _softplus(x: te.Tensor, beta: float, threshold: float) -> te.Tensor:
    """x where beta x > threshold, else log1p(exp(beta x)) / beta (torch's kernel)."""
    dtype = x.dtype

    def value(*index: tirx.PrimExpr) -> tirx.PrimExpr:
        scaled = x(*index) * tirx.const(beta, dtype)
        smooth = tirx.log1p(tirx.exp(scaled)) / tirx.const(beta, dtype)
        return tirx.Select(scaled > tirx.const(threshold, dtype), x(*index), smooth)

    return te.compute(x.shape, value, name="softplus")


def _nn_softplus(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    return bb.call_te(_softplus, call.args[0], float(call.attrs.beta), float(call.attrs.threshold),
                      primfunc_name_hint="softplus")


tvm.ir.register_op_attr("relax.nn.softplus", "FLegalize", _nn_softplus, level=_LEVEL)


def _tanh(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x = call.args[0]
    if not isinstance(x.ty, relax.TensorType) or str(x.ty.dtype.dtype) != "float64":
        return bb.call_te(topi.tanh, x, primfunc_name_hint="tir_tanh")  # TVM's own, as before
    return bb.call_te(lambda t: te.compute(t.shape, lambda *i: tirx.call_pure_extern("float64", "tanh", t(*i)),
                                           name="tanh"), x, primfunc_name_hint="tanh")


tvm.ir.register_op_attr("relax.tanh", "FLegalize", _tanh, level=_LEVEL)

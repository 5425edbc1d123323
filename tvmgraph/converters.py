"""tvmgraph's own fx -> Relax converters, for ops whose stock TVM 0.27 conversion is wrong.

Each converter takes `(node, importer)` like a `custom_convert_map` entry of
`from_exported_program` and returns the Relax expression for the node.

- `_native_batch_norm_legit_functional` (batch norm in train mode): the stock converter returns
  zeros for the updated running variance. Here the running statistics follow torch exactly:
  `running = (1 - momentum) * running + momentum * batch_stat`, with the unbiased variance.
  float16/bfloat16 inputs are normalized in float32 and cast back (the stock result is float32).
- `native_dropout`: the stock converter drops dropout even in train mode; here it draws a mask
  (see dropout.py).
- `select` (`x[i]`, `x.select(dim, i)`): the stock converter emits `take(mode="fast")`, whose
  legalization warns on every compile that "fast mode segfaults when there are out-of-bounds
  indices", and whose gradient (`take_backward`) reads `x` for its shape: in attention, the
  whole packed q/k/v projection then stayed alive until the end of the backward pass. Here it
  is a one-wide `strided_slice` (its gradient builds zeros from the static shape), squeezed;
  negative indices count from the end as in torch.
- `embedding`, `index_select`, `take`, `index.Tensor`, `gather`, `scatter`: the stock
  converters emit `take(mode="fast")` or unchecked gather/scatter kernels, which read or write
  outside the tensor for an index out of range (a segfault, or silent garbage) and, for
  `x[idx]` and `take`, for a negative index too. Here take clamps (`clip`) where torch
  refuses negative indices and wraps (`wrap`) where torch counts them from the end, and
  gather/scatter indices are clamped before the kernel. Index *inputs* out of range never get
  this far (index_guard.py raises first); this keeps indices computed in the graph inside the
  tensor. The stock `embedding` also ignored `padding_idx` and `scale_grad_by_freq`. Several
  index tensors and boolean masks (`x[:, i, j]`, `x[mask]`, `x[mask] = v`): advanced_indexing.py.
- `mm`, `bmm`, `matmul`, `addmm`, `convolution`: the stock converters hard-code a float32
  result, which breaks float64 (and half-precision) programs. Here the result has the dtype of
  the inputs, as in torch; `convolution` covers every rank (the stock one had no 3-D transposed
  convolution).
- `_batch_norm_with_update_functional`: no stock converter; the train-mode batch norm above.
- `_native_batch_norm_legit.no_stats` (a batch norm without running statistics): the stock
  converter returns the normalized output alone, so the saved mean and invstd (outputs 1 and
  2) were that output again; here they are the batch's, one per channel.
- `repeat` with a count that depends on a dynamic batch: the stock `tile` takes constant
  counts only (it failed to compile); here a broadcast between two views.
- `cat` with a 1-D empty tensor among tensors of more dimensions: torch skips such a tensor
  (its legacy rule), Relax's concat requires equal ranks ("Concat expects all input tensors to
  have same ndim", OpInfo's `cat` samples). Here those tensors are left out, the others cast to
  the result's dtype (which the skipped ones still took part in).
- `arange`, `linspace`, `logspace` with constant bounds: TVM (and torch's decompositions)
  compute them in the result dtype, torch truncates the bounds of an integer arange (and counts
  an int64 one in integers) and computes a float one in double (float for 16 bits), linspace
  from both ends: `arange(3.1, dtype=int64)` had 4 elements, `arange(2.1, -2.9, -1,
  dtype=bfloat16)` a 0.109 where eager has 0.1001, a bfloat16 `logspace(0, 1.2, 2)` 15.875 for
  15.9375. Here it is eager's tensor, as a constant.
- activations (elu, softplus, mish): see converters_activation.py.
- xlogy, xlog1py: see converters_xlogy.py.
- log1p, expm1, atanh (accurate near 0): see log1p_expm1.py.
- pooling, interpolation, normalization and grid sampling: see converters_nn.py.
- reductions, scans, scatters, strided views, distances: see converters_reduce.py.
- elementwise math functions (special functions, hypot, fmax, copysign, cosh, ...): see
  converters_special.py.
"""

from __future__ import annotations

import math
import operator
import types
from collections.abc import Callable

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import (advanced_indexing, converters_activation, converters_cholesky, converters_floor_division,
               converters_gcd, converters_histogram, converters_integer_power, converters_linalg, converters_nn,
               converters_polynomials, converters_reduce, converters_shift, converters_sort, converters_special,
               converters_xlogy, log1p_expm1, stop_gradient, symbolic_scalars)
from .legalize_fixes import broadcast_shape
from .converters_nn import (_arg, _dtype, _mean_rstd, _output_used, _static_shape, as_dtype, isnan, operand,
                            per_channel_affine, result_dtype, stock_converter)

Converter = Callable[[torch.fx.Node, ExportedProgramImporter], relax.Expr]


def batch_norm_train(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(out, save_mean, save_invstd, new_running_mean, new_running_var), as aten defines them."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    shape = [int(d) if isinstance(d, tvm.tirx.IntImm) else d for d in x.ty.shape]  # a dynamic batch stays symbolic
    x_dtype = x.ty.dtype.dtype
    channels = shape[1]
    weight, bias, running_mean, running_var = (
        importer.env.get(a) if a is not None else None for a in node.args[1:5]
    )
    stats_dtype = running_mean.ty.dtype.dtype if running_mean is not None else x_dtype
    if x_dtype in ("float16", "bfloat16"):  # computed in float32, as torch does
        x, weight, bias, running_mean, running_var = (
            bb.emit(relax.op.astype(v, "float32")) if v is not None else None
            for v in (x, weight, bias, running_mean, running_var))
    dtype = x.ty.dtype.dtype
    training = _arg(node, 5, "training", True)
    momentum = float(_arg(node, 6, "momentum", 0.1))
    eps = float(_arg(node, 7, "eps", 1e-5))
    if not training:
        raise NotImplementedError("the functional batch norm was exported with training=False")

    def ones_or(v: relax.Expr | None, fill: float) -> relax.Expr:
        return v if v is not None else relax.const(np.full(channels, fill, dtype=dtype), dtype)

    axes = [0, *range(2, len(shape))]
    if isinstance(channels, int):
        normalized = bb.emit(
            relax.op.nn.batch_norm(
                x, ones_or(weight, 1.0), ones_or(bias, 0.0), running_mean, running_var,
                axis=1, epsilon=eps, center=bias is not None, scale=weight is not None,
                momentum=momentum, training=True,
            )
        )
        out = bb.emit(relax.TupleGetItem(normalized, 0))
    else:  # n * C channels: an instance norm with running statistics under a dynamic batch
        out = _normalized(bb, x, weight, bias, axes, eps)
    if x_dtype != dtype:
        out = bb.emit(relax.op.astype(out, x_dtype))
    count = math.prod(shape[a] for a in axes)
    mean = bb.emit(relax.op.mean(x, axis=axes))
    var = bb.emit(relax.op.variance(x, axis=axes))
    invstd = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(eps, dtype))))

    def blend(running: relax.Expr, batch: relax.Expr, scale: float) -> relax.Expr:
        keep = relax.op.multiply(running, relax.const(1.0 - momentum, dtype))
        return bb.emit(relax.op.add(keep, relax.op.multiply(batch, relax.const(momentum * scale, dtype))))

    new_mean = blend(running_mean, mean, 1.0)
    if isinstance(count, int):
        new_var = blend(running_var, var, count / (count - 1) if count > 1 else 1.0)
    else:  # a dynamic batch: the unbiased correction is computed at run time
        new_var = blend(running_var, bb.emit(relax.op.multiply(var, _unbiased_scale(bb, count, dtype))), 1.0)
    if stats_dtype != dtype:
        new_mean, new_var = (bb.emit(relax.op.astype(v, stats_dtype)) for v in (new_mean, new_var))
    return bb.emit(relax.Tuple([out, mean, invstd, new_mean, new_var]))


def batch_norm_no_stats(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`_native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)`, a batch
    norm without running statistics (`native_batch_norm(x, w, b, None, None, True, ...)`):
    (out, save_mean, save_invstd) as aten defines them. The stock converter returns `out`
    alone, so outputs 1 and 2 were `out` again (x's shape where torch has one per channel).
    They are computed only when read (an instance norm reads output 0 alone)."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    axes, eps = [0, *range(2, len(x.ty.shape))], float(_arg(node, 5, "eps", 1e-5))
    if isinstance(x.ty.shape[1], tvm.tirx.IntImm):
        out = stock_converter(importer, "_native_batch_norm_legit.no_stats")(node)
    else:  # n * C channels: an instance norm under a dynamic batch
        weight, bias = (importer.env[a] if a is not None else None for a in node.args[1:3])
        out = _normalized(bb, x, weight, bias, axes, eps)
    if not (_output_used(node, 1) or _output_used(node, 2)):
        return bb.emit(relax.Tuple([out, out, out]))
    mean, invstd = _mean_rstd(bb, x, axes, eps, keepdims=False)
    return bb.emit(relax.Tuple([out, mean, invstd]))


def _normalized(bb: relax.BlockBuilder, x: relax.Expr, weight: relax.Expr | None, bias: relax.Expr | None,
                axes: list[int], eps: float) -> relax.Expr:
    """A batch norm's output written out: an instance norm normalizes (1, n * C, ...), whose
    channel count is symbolic under a dynamic batch, and TVM's batch_norm needs it static."""
    mean, invstd = _mean_rstd(bb, x, axes, eps)
    return per_channel_affine(bb, bb.emit(relax.op.multiply(relax.op.subtract(x, mean), invstd)), weight, bias)


def _unbiased_scale(bb: relax.BlockBuilder, count: tvm.tirx.PrimExpr, dtype: str) -> relax.Expr:
    """count / max(count - 1, 1) as a 0-d tensor for a symbolic `count` (symbolic_scalars.counted:
    the ones cost far less than the batch norm itself)."""
    n = symbolic_scalars.counted(bb, count, dtype)
    return bb.emit(relax.op.divide(n, relax.op.maximum(n - relax.const(1.0, dtype), relax.const(1.0, dtype))))


def batch_norm_with_update(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`_batch_norm_with_update_functional(x, w, b, running_mean, running_var, momentum, eps)`:
    the train-mode batch norm above, with an empty reserve tensor as its fourth output."""
    legit = types.SimpleNamespace(args=(*node.args[:5], True, *node.args[5:7]), kwargs={})
    bb = importer.block_builder
    out, mean, invstd, new_mean, new_var = (
        bb.emit(relax.TupleGetItem(batch_norm_train(legit, importer), i)) for i in range(5))
    reserve = relax.const(np.zeros(0, dtype="uint8"), "uint8")
    return bb.emit(relax.Tuple([out, mean, invstd, reserve, new_mean, new_var]))


def matmul(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """mm / bmm / matmul with the inputs' dtype."""
    a, b = importer.env[node.args[0]], importer.env[node.args[1]]
    return importer.block_builder.emit(relax.op.matmul(a, b, out_dtype=_dtype(a)))


def select(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.select(dim, index) with a constant index: a one-wide strided_slice, squeezed. An index
    read from a tensor (`x[i]` with a 0-d int tensor, which export writes as `select(x, 0,
    i.item())`) is a `take` of that tensor, negative values counting from the end, clamped into
    x (an input's range is checked before the call, index_guard.py)."""
    bb = importer.block_builder
    x, dim = importer.env[node.args[0]], int(node.args[1])
    if isinstance(node.args[2], torch.fx.Node):
        item = node.args[2]
        taken = item.args[0] if item.target in _ITEMS else None
        index = importer.env[taken] if taken is not None else symbolic_scalars.scalar_tensor(
            bb, importer.env[item], "int64")
        dim %= len(x.ty.shape)
        index = bb.emit(relax.op.astype(index, "int64"))
        size = x.ty.shape[dim]
        if not isinstance(size, tvm.tirx.IntImm):  # symbolic size: take counts from the end
            return bb.emit(relax.op.take(x, index, axis=dim, mode="wrap"))
        index = bb.emit(relax.op.where(relax.op.less(index, relax.const(0, "int64")),
                                       relax.op.add(index, relax.const(int(size), "int64")), index))
        return bb.emit(relax.op.take(x, index, axis=dim, mode="clip"))
    index = int(node.args[2])
    rank = len(x.ty.shape)
    dim %= rank
    size = x.ty.shape[dim]
    if index < 0:
        if not isinstance(size, tvm.tirx.IntImm):  # symbolic size: let take count from the end
            return bb.emit(relax.op.take(x, relax.const(index, "int64"), axis=dim, mode="wrap"))
        index += int(size)
    part = bb.emit(relax.op.strided_slice(x, axes=[dim], begin=[index], end=[index + 1]))
    return bb.emit(relax.op.squeeze(part, axis=[dim]))


def squeeze(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.squeeze(dims) (every dim by default): the listed dims of size 1. Listing a symbolic
    size (a dynamic batch) is refused: eager removes it at batch 1 and keeps it otherwise, a
    rank no one program has (TVM's squeeze removed it always: `model(x).squeeze()` lost its
    batch)."""
    x = importer.env[node.args[0]]
    shape = list(x.ty.shape)
    if not shape:
        return x
    dims = node.args[1] if len(node.args) > 1 else range(len(shape))
    dims = {d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)}
    if any(not isinstance(shape[d], tvm.tirx.IntImm) for d in dims):
        raise NotImplementedError(
            "squeeze() of the batch dim with a dynamic batch: eager drops that dim at batch 1 only. Name the "
            "dims to squeeze (`y.squeeze(-1)`, `y.squeeze((1, 2))`), or turn the dynamic batch off")
    axes = sorted(d for d in dims if int(shape[d]) == 1)
    return importer.block_builder.emit(relax.op.squeeze(x, axis=axes)) if axes else x


def neg(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """-x; of an unsigned integer, `0 - x`, which wraps as torch's does (TVM's negative of a
    uint8 multiplies by a uint8 -1, which its legalization refuses)."""
    x = importer.env[node.args[0]]
    if x.ty.dtype.dtype.startswith("uint"):
        return importer.block_builder.emit(relax.op.subtract(relax.const(0, x.ty.dtype.dtype), x))
    return stock_converter(importer, "neg.default")(node)


def sign(key: str) -> Converter:
    """sign / sgn; of an unsigned integer, `x > 0` (TVM's legalization makes a -1 of the
    unsigned dtype, which it refuses: a PassError)."""
    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        x = importer.env[node.args[0]]
        dtype = x.ty.dtype.dtype
        if dtype.startswith("uint"):
            bb = importer.block_builder
            return bb.emit(relax.op.astype(relax.op.greater(x, relax.const(0, dtype)), dtype))
        return stock_converter(importer, key)(node)
    return convert


_ITEMS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


def item(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """`t.item()`: read only by `select` as its index (`x[i]`), nothing: `select` takes `t`
    itself. The importer's item makes the value a symbolic size (a shape read from the tensor),
    which autodiff refuses in a training graph even where nothing reads it."""
    if node.users and all(user.target == torch.ops.aten.select.int and user.args[2] is node
                          and node not in user.args[:2] for user in node.users):
        return importer.env[node.args[0]]
    return stock_converter(importer, node.target.__name__)(node)


def repeat(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.repeat(*reps). With a count that depends on a dynamic batch (`w.repeat(x.shape[0])`),
    the stock `tile` takes constant counts only: x viewed as [1, d0, 1, d1, ...], broadcast to
    [r0, d0, r1, d1, ...] and viewed as [r0 * d0, r1 * d1, ...] instead."""
    bb = importer.block_builder
    args = importer.retrieve_args(node)
    x = args[0]
    reps = list(args[1] if isinstance(args[1], torch.Size | tuple | list) else args[1:])
    if all(isinstance(r, int) for r in reps):
        return bb.emit(relax.op.tile(x, reps))
    dims = [1] * (len(reps) - len(x.ty.shape)) + list(x.ty.shape.values)
    spread = bb.emit(relax.op.reshape(x, [d for dim in dims for d in (1, dim)]))
    copies = bb.emit(relax.op.broadcast_to(spread, [d for r, dim in zip(reps, dims) for d in (r, dim)]))
    return bb.emit(relax.op.reshape(copies, [r * dim for r, dim in zip(reps, dims)]))


def empty(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """torch.empty as zeros (nothing may read it before writing). The stock converter passed the
    size's fx nodes to Relax, so a size from a dynamic batch (`nn.Dropout2d`'s [n, C, 1, 1]
    mask, drawn into an empty tensor) failed to compile."""
    size = importer.retrieve_args(node)[0]
    dtype = str(node.meta["val"].dtype).removeprefix("torch.")
    return importer.block_builder.emit(relax.op.zeros(relax.ShapeExpr(list(size)), dtype))


def addmm(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """beta * input + alpha * (mat1 @ mat2)."""
    bb = importer.block_builder
    bias, a, b = (importer.env[x] for x in node.args[:3])
    alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
    dtype = _dtype(a)
    product = bb.emit(relax.op.matmul(a, b, out_dtype=dtype))
    if alpha != 1:
        product = bb.emit(relax.op.multiply(product, relax.const(alpha, dtype)))
    if beta == 0:
        return product
    if beta != 1:
        bias = bb.emit(relax.op.multiply(bias, relax.const(beta, dtype)))
    return bb.emit(relax.op.add(bias, product))


_CONV_LAYOUTS = {1: ("NCW", "OIW", "IOW"), 2: ("NCHW", "OIHW", "IOHW"), 3: ("NCDHW", "OIDHW", "IODHW")}


def convolution(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """1-D to 3-D convolution, plain or transposed, with the inputs' dtype.

    The stock converter had no 3-D transposed convolution. Relax refuses an ``output_padding``
    of a stride or more (torch allows it below the dilation): those rows come instead from less
    end padding, then zeros once that padding is used up.
    """
    bb = importer.block_builder
    x, weight = importer.env[node.args[0]], importer.env[node.args[1]]
    bias = importer.env.get(node.args[2]) if node.args[2] is not None else None
    rank = len(x.ty.shape) - 2
    stride, padding, dilation, transposed, output_padding, groups = node.args[3:9]
    stride, padding, dilation, output_padding = (
        [int(v) for v in values] * (rank if len(values) == 1 else 1)
        for values in (stride, padding, dilation, output_padding))
    dtype = _dtype(x)
    data_layout, kernel_layout, transposed_layout = _CONV_LAYOUTS[rank]
    if transposed:
        kept = [min(o, s - 1) for o, s in zip(output_padding, stride)]
        end = [p - (o - k) for p, o, k in zip(padding, output_padding, kept)]
        conv_transpose = (relax.op.nn.conv1d_transpose, relax.op.nn.conv2d_transpose,
                          relax.op.nn.conv3d_transpose)[rank - 1]
        out = bb.emit(conv_transpose(
            x, weight, strides=stride, padding=padding + [max(e, 0) for e in end],
            output_padding=kept, dilation=dilation, groups=groups, data_layout=data_layout,
            kernel_layout=transposed_layout, out_dtype=dtype))
        for axis, e in enumerate(end):
            if e < 0:
                shape = [int(d) for d in out.ty.shape]
                shape[2 + axis] = -e
                out = bb.emit(relax.op.concat([out, relax.op.zeros(shape, dtype)], axis=2 + axis))
    else:
        conv = (relax.op.nn.conv1d, relax.op.nn.conv2d, relax.op.nn.conv3d)[rank - 1]
        out = bb.emit(conv(x, weight, strides=stride, padding=padding, dilation=dilation,
                           groups=groups, data_layout=data_layout, kernel_layout=kernel_layout,
                           out_dtype=dtype))
    if bias is None:
        return out
    return bb.emit(relax.op.add(out, relax.op.reshape(bias, (1, -1) + (1,) * rank)))


def _static_size(x: relax.Expr, axis: int) -> int | None:
    size = x.ty.shape[axis]
    return int(size) if isinstance(size, tvm.tirx.IntImm) else None


def _is_empty(x: relax.Expr) -> bool:
    """Whether `x` has a static zero among its dimensions."""
    return any(isinstance(d, tvm.tirx.IntImm) and int(d) == 0 for d in x.ty.shape)


def _clamped(bb: relax.BlockBuilder, index: relax.Expr, size: int | None) -> relax.Expr:
    """`index` clamped into `0..size - 1` (left as it is for a symbolic size)."""
    return index if size is None else bb.emit(relax.op.clip(index, 0, size - 1))


# take's mode covers the forward kernel and, through tvmgraph's take gradient
# (gradients/fixes.py), take_backward: `clip` where torch refuses negative indices, `wrap`
# where it counts them from the end.

def embedding(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """weight[ids], the ids clamped into the table (see the module docstring).

    `padding_idx` and `scale_grad_by_freq` change only the gradient, as in torch: the rows read
    at `padding_idx` get none, the others are divided by how often their id occurs in the batch.
    The value is `fixed + (rows - fixed) * scale` with `fixed` = no_grad(rows): exactly `rows`,
    with the gradient times `scale`. Before this, both were ignored and the padding row trained.
    """
    bb = importer.block_builder
    weight, ids = importer.env[node.args[0]], importer.env[node.args[1]]
    padding_idx = int(node.args[2]) if len(node.args) > 2 else -1
    by_frequency = bool(node.args[3]) if len(node.args) > 3 else False
    flat = bb.emit(relax.op.reshape(bb.emit(relax.op.astype(ids, "int32")), [-1]))
    rows = bb.emit(relax.op.take(weight, flat, axis=0, mode="clip"))
    if padding_idx >= 0 or by_frequency:
        dtype = weight.ty.dtype.dtype
        scale = relax.op.ones(flat.ty.shape, dtype)
        if by_frequency:
            table = _static_shape(weight, "embedding")[0]
            counts = relax.op.scatter_elements(relax.op.zeros([table], dtype), flat, scale, axis=0, reduction="add")
            scale = relax.op.divide(scale, relax.op.take(counts, flat, axis=0, mode="clip"))
        if padding_idx >= 0:
            padded = relax.op.equal(flat, relax.const(padding_idx, "int32"))
            scale = relax.op.where(padded, relax.const(0.0, dtype), scale)
        fixed = bb.emit(relax.op.grad.no_grad(rows))
        rows = bb.emit(relax.op.add(fixed, relax.op.multiply(relax.op.subtract(rows, fixed),
                                                              relax.op.expand_dims(scale, -1))))
    if len(ids.ty.shape) == 1:
        return rows
    return bb.emit(relax.op.reshape(rows, [*ids.ty.shape, weight.ty.shape[-1]]))


def cat(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """torch.cat; 1-D empty tensors beside tensors of more dimensions are skipped, as in torch
    (see the module docstring)."""
    tensors = [importer.env[t] for t in node.args[0]]
    legacy = [len(t.ty.shape) == 1 and _is_empty(t) for t in tensors]
    if not any(legacy) or all(legacy):
        return stock_converter(importer, "cat.default")(node)
    bb, dtype = importer.block_builder, result_dtype(node)
    kept = [t if _dtype(t) == dtype else bb.emit(relax.op.astype(t, dtype))
            for t, skip in zip(tensors, legacy) if not skip]
    dim = _arg(node, 1, "dim", 0)
    return kept[0] if len(kept) == 1 else bb.emit(relax.op.concat(kept, axis=dim))


def bound(key: str) -> Converter:
    """The stock converter for `key`, its result bound to a variable: TVM's adaptive average
    pools return an unbound `squeeze` for an unbatched input, and the next converter that read
    its shape failed (`F.adaptive_avg_pool1d` of a [C, L] tensor)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        out = stock_converter(importer, key)(node)
        return out if isinstance(out, relax.Var) else importer.block_builder.emit(out)

    return convert


def constant_factory(make: Callable[..., torch.Tensor]) -> Converter:
    """A converter for `arange`/`linspace`/`logspace`/`triu_indices`/`tril_indices`: with constant arguments, the tensor eager
    makes, as a constant (see the module docstring); arguments from shapes (a dynamic batch) go
    to the stock converter, where there is one."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        args = list(node.args)
        if not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
            key = node.target.__name__
            try:
                stock = stock_converter(importer, key)
            except KeyError:
                raise NotImplementedError(f"{key} with arguments computed in the graph (a shape): "
                                          f"give it constant bounds") from None
            return stock(node)
        dtype = node.meta["val"].dtype
        value = make(*args, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        if dtype in (torch.bfloat16, torch.float16):  # NumPy has no bfloat16: exact in float32
            return importer.block_builder.emit(relax.op.astype(relax.const(value.float().numpy(), "float32"), name))
        return relax.const(value.numpy(), name)

    return convert


def index_select(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.index_select(dim, index), the index clamped into x; a 0-d x gives a 0-d result (TVM's
    take refuses a 0-d input)."""
    bb = importer.block_builder
    x, dim, index = importer.env[node.args[0]], int(node.args[1]), importer.env[node.args[2]]
    if x.ty.ndim == 0:
        flat = bb.emit(relax.op.reshape(x, [1]))
        picked = bb.emit(relax.op.take(flat, relax.op.reshape(index, [-1]), axis=0, mode="clip"))
        return bb.emit(relax.op.reshape(picked, []))
    return bb.emit(relax.op.take(x, index, axis=dim, mode="clip"))


def take(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """torch.take(x, index) on the flattened x; negative indices count from the end."""
    bb = importer.block_builder
    x, index = importer.env[node.args[0]], importer.env[node.args[1]]
    flat = bb.emit(relax.op.reshape(x, [-1]))
    return bb.emit(relax.op.take(flat, index, axis=0, mode="wrap"))


def index_put(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.index_put(indices, values, accumulate) where `indices` (adjacent tensors, None for
    a whole dim) name fewer dims than x has, as `x[idx] += v` on a matrix: every dim gets an
    index, the whole ones an `arange`, all broadcast to the indexing result's shape. TVM's
    index_put needs one index a dim; the stock converter padded only leading dims and failed on
    the others. Sizes may be symbolic (a dynamic batch) where the index tensors' shapes are
    equal. Negative indices count from the end and all are clamped into x, as `take`'s (by the
    legalization, tvmgraph/legalize_fixes.py). A boolean mask goes to `advanced_indexing.masked_put`."""
    if advanced_indexing.uses_mask(node):
        return advanced_indexing.masked_put(node, importer)
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    indices = list(node.args[1])
    values = importer.env[node.args[2]]
    accumulate = bool(_arg(node, 3, "accumulate", False))
    shape = list(x.ty.shape.values)
    given = [d for d, i in enumerate(indices) if i is not None]
    batch = broadcast_shape([list(importer.env[indices[d]].ty.shape.values) for d in given]) if given else None
    if batch is None or given != list(range(given[0], given[-1] + 1)):
        return importer._index_put(node)  # TVM's layout rules for the other cases
    indices += [None] * (len(shape) - len(indices))
    first = given[0]
    out_shape = shape[:first] + batch + shape[given[-1] + 1:]
    full = []
    for d, size in enumerate(shape):
        if d in given:
            index = bb.emit(relax.op.broadcast_to(relax.op.astype(importer.env[indices[d]], "int64"), batch))
            index = bb.emit(relax.op.reshape(index, [1] * first + batch + [1] * (len(out_shape) - first - len(batch))))
        else:
            at = d if d < first else d - len(given) + len(batch)
            index = bb.emit(relax.op.reshape(relax.op.arange(0, size, 1, "int64"),
                                             [size if i == at else 1 for i in range(len(out_shape))]))
        # 1-D: TVM logs a line for every index tensor of more dims
        full.append(bb.emit(relax.op.reshape(bb.emit(relax.op.broadcast_to(index, out_shape)), [-1])))
    values = bb.emit(relax.op.reshape(bb.emit(relax.op.broadcast_to(values, out_shape)), [-1]))
    if accumulate and x.ty.dtype.dtype == "bool":  # TVM accumulates no bool; a sum of them != 0 is their or
        x, values = (bb.emit(relax.op.astype(v, "int32")) for v in (x, values))
        summed = bb.emit(relax.op.index_put(x, relax.Tuple(full), values, True))
        return bb.emit(relax.op.not_equal(summed, relax.const(0, "int32")))
    return bb.emit(relax.op.index_put(x, relax.Tuple(full), values, accumulate))


def add_or_sub(kind: str) -> Converter:
    """add / sub / rsub (`a - alpha * b`, `b - alpha * a`) with `alpha`, which the stock
    converters ignored: `ema.add_(x, alpha=0.1)` added x whole. alpha == 1 goes to them."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        alpha = _arg(node, 2, "alpha", 1)
        if alpha == 1:
            return stock_converter(importer, node.target.__name__)(node)
        bb = importer.block_builder
        dtype = result_dtype(node)
        first, second = (operand(importer, v, dtype) for v in node.args[:2])
        if kind == "rsub":
            first, second = second, first
        second = bb.emit(relax.op.multiply(second, relax.const(alpha, dtype)))
        return bb.emit((relax.op.add if kind == "add" else relax.op.subtract)(first, second))

    return convert


def clamp(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """clamp(x, min, max) with scalar or tensor bounds as two `where`s, so that the gradient is
    torch's: x's passes where min <= x <= max (the edges included), a tensor bound's where it
    was chosen. The stock converter used `clip` (whose gradient stops at the edges, as
    hardtanh's does), `maximum`/`minimum` (which split it in two at the edges) and an infinite
    bound that integer tensors cannot hold. Everything is computed in torch's result dtype."""
    bb = importer.block_builder
    dtype = result_dtype(node)
    x = importer.env[node.args[0]]
    bounds = [_arg(node, 1, "min", None), _arg(node, 2, "max", None)]
    if node.target.__name__.startswith("clamp_max"):
        bounds = [None, _arg(node, 1, "max", None)]
    low, high = (None if b is None else
                 as_dtype(bb, importer.env[b], dtype) if isinstance(b, torch.fx.Node) else relax.const(b, dtype)
                 for b in bounds)
    out = as_dtype(bb, x, dtype)
    if _decomposed_from(node).startswith(_STRICT_EDGES) and not any(isinstance(b, torch.fx.Node) for b in bounds):
        # from a loss whose eager backward stops at the edges: clip's gradient does too
        return bb.emit(relax.op.clip(out, -math.inf if bounds[0] is None else bounds[0],
                                     math.inf if bounds[1] is None else bounds[1]))
    if low is not None:
        out = bb.emit(relax.op.where(_beyond(relax.op.less, out, low, dtype), low, out))
    if high is not None:
        out = bb.emit(relax.op.where(_beyond(relax.op.greater, out, high, dtype), high, out))
    return out


def _beyond(compare: Callable[[relax.Expr, relax.Expr], relax.Expr], x: relax.Expr, bound: relax.Expr,
            dtype: str) -> relax.Expr:
    """Where clamp takes `bound`: past it, or where a float bound is NaN (torch's clamp is then
    NaN; a comparison with NaN is false, and the bound was ignored)."""
    past = compare(x, bound)
    return relax.op.logical_or(past, isnan(bound)) if "float" in dtype else past


# Ops with their own eager backward that stops where the clamp of their decomposition is at its
# edge (z == 0 in a margin loss): with the clamp's own gradient the graph differed there.
_STRICT_EDGES = ("aten.multi_margin_loss.",)


def _decomposed_from(node: torch.fx.Node) -> str:
    """The op `node` came from by decomposition (`aten.multi_margin_loss.default`), else ''."""
    sources = node.meta.get("from_node") or []
    return str(sources[0].target) if sources else ""


def clamped_index(stock: str) -> Converter:
    """The stock converter of `op(x, dim, index, ...)` (gather, scatter), its index clamped
    into `x` first: TOPI's gather and scatter kernels do not check their indices. A scatter
    with an empty index writes nothing: it gives `x` (a gather's result is then empty, and
    empty_results.py makes it zeros before this runs)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        stock_convert = getattr(importer, stock)
        if len(node.args) < 3 or not isinstance(node.args[2], torch.fx.Node):
            return stock_convert(node)
        bb = importer.block_builder
        x, index = importer.env[node.args[0]], importer.env[node.args[2]]
        if _is_empty(index):  # torch allows any integer type and rank here; TOPI neither
            return x
        size = _static_size(x, int(node.args[1]) % max(len(x.ty.shape), 1))
        importer.env[node.args[2]] = _clamped(bb, index, size)
        try:
            return stock_convert(node)
        finally:
            importer.env[node.args[2]] = index

    return convert


def dropout(seed_node: torch.fx.Node | None, salts: dict[torch.fx.Node, int]) -> Converter:
    """`native_dropout(x, p, train)` -> (x * mask, mask != 0), the mask drawn in the graph
    (dropout.py); forward and backward are each one kernel."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        from . import dropout as dropout_kernels

        bb = importer.block_builder
        x = importer.env[node.args[0]]
        p, train = float(node.args[1]), bool(node.args[2])
        if not train or p == 0.0:
            keep = bb.emit(relax.op.astype(relax.op.ones_like(x), "bool"))
            return bb.emit(relax.Tuple([x, keep]))
        if p >= 1.0:
            zeros = bb.emit(relax.op.zeros_like(x))
            return bb.emit(relax.Tuple([zeros, bb.emit(relax.op.astype(zeros, "bool"))]))
        dropout_kernels.register()
        seed, salt = importer.env[seed_node], salts[node]
        out = bb.emit(bb.call_te_with_grad(dropout_kernels.dropout_apply, x, seed, p=p, salt=salt,
                                           te_grad_name=dropout_kernels.GRAD_NAME,
                                           te_grad_kwargs={"p": p, "salt": salt}))
        # aten's second output (the keep mask) is rarely used; only build it when it is, so that
        # autodiff never meets its (non-differentiable) kernel.
        keep_used = any(u.target is operator.getitem and u.args[1] == 1 for u in node.users)
        keep = stop_gradient.emit_te(bb, dropout_kernels.dropout_keep, x, seed, p, salt) if keep_used else out
        return bb.emit(relax.Tuple([out, keep]))

    return convert


def power_of_scalar(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """pow(x, exponent) of a scalar exponent; `x ** 0` is ones, as torch's (1 also for NaN, and a
    zero gradient: autodiff's `dy * 0 * x ** -1` was NaN at x = 0 once ZeroOperands kept IEEE's
    `inf * 0`)."""
    exponent = node.args[1]
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool) and exponent == 0:
        dtype = result_dtype(node)
        return importer.block_builder.emit(relax.op.full_like(importer.env[node.args[0]], relax.const(1, dtype), dtype))
    return stock_converter(importer, "pow.Tensor_Scalar")(node)


def reshape(key: str) -> Converter:
    """view / _unsafe_view / reshape. The stock converter first tests for an identity reshape
    with `==` between the shapes, which raises on a symbolic size it cannot decide (an instance
    norm's n * C under a dynamic batch): then the reshape is emitted as it is."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        try:
            return stock_converter(importer, key)(node)
        except ValueError as error:
            if "Cannot use and / or / not operator to Expr" not in str(error):
                raise
        x, *dims = importer.retrieve_args(node)
        if len(dims) == 1 and isinstance(dims[0], (torch.Size, tuple, list)):
            dims = dims[0]
        return importer._emit_torch_reshape(x, dims)

    return convert


CONVERTERS: dict[str, Converter] = {
    **{key: reshape(key) for key in ("view.default", "_unsafe_view.default", "reshape.default")},
    "pow.Tensor_Scalar": converters_integer_power.integer_power("pow.Tensor_Scalar", power_of_scalar),
    "pow.Tensor_Tensor": converters_integer_power.integer_power("pow.Tensor_Tensor"),
    "pow.Scalar": converters_integer_power.integer_power("pow.Scalar"),
    "_native_batch_norm_legit_functional.default": batch_norm_train,
    "_native_batch_norm_legit.no_stats": batch_norm_no_stats,
    "_batch_norm_with_update_functional.default": batch_norm_with_update,
    "mm.default": matmul,
    "bmm.default": matmul,
    "matmul.default": matmul,
    "addmm.default": addmm,
    "select.int": select,
    "squeeze.default": squeeze,
    "squeeze.dim": squeeze,
    "squeeze.dims": squeeze,
    "repeat.default": repeat,
    "empty.memory_format": empty,
    "convolution.default": convolution,
    "native_dropout.default": dropout(None, {}),  # placeholder entry; lower.py binds the seed
    "embedding.default": embedding,
    "index_select.default": index_select,
    "cat.default": cat,
    "take.default": take,
    "arange.default": constant_factory(torch.arange),
    "arange.start": constant_factory(torch.arange),
    "arange.start_step": constant_factory(torch.arange),
    "linspace.default": constant_factory(torch.linspace),
    "logspace.default": constant_factory(torch.logspace),
    "triu_indices.default": constant_factory(torch.triu_indices),
    "tril_indices.default": constant_factory(torch.tril_indices),
    "_adaptive_avg_pool2d.default": bound("_adaptive_avg_pool2d.default"),
    "_adaptive_avg_pool3d.default": bound("_adaptive_avg_pool3d.default"),
    "index.Tensor": advanced_indexing.index_tensor,
    "nonzero.default": advanced_indexing.nonzero,
    "masked_select.default": advanced_indexing.masked_select,
    "gather.default": clamped_index("_gather"),
    "scatter.src": clamped_index("_scatter"),
    "scatter.value": clamped_index("_scatter_value"),
    "index_put.default": index_put,
    "item.default": item,
    "neg.default": neg,
    "sign.default": sign("sign.default"),
    "sgn.default": sign("sgn.default"),
    "_local_scalar_dense.default": item,
    "add.Tensor": add_or_sub("add"),
    "add.Scalar": add_or_sub("add"),
    "sub.Tensor": add_or_sub("sub"),
    "sub.Scalar": add_or_sub("sub"),
    "rsub.Tensor": add_or_sub("rsub"),
    "rsub.Scalar": add_or_sub("rsub"),
    "clamp.default": clamp,
    "clamp.Tensor": clamp,
    "clamp_min.default": clamp,
    "clamp_max.default": clamp,
    "clamp_min.Tensor": clamp,
    "clamp_max.Tensor": clamp,
}
CONVERTERS.update(converters_activation.CONVERTERS)
CONVERTERS.update(converters_nn.CONVERTERS)
CONVERTERS.update(converters_reduce.CONVERTERS)
CONVERTERS.update(converters_special.CONVERTERS)
CONVERTERS.update(converters_xlogy.CONVERTERS)
CONVERTERS.update(log1p_expm1.CONVERTERS)
CONVERTERS.update(converters_floor_division.CONVERTERS)
CONVERTERS.update(converters_shift.CONVERTERS)
CONVERTERS.update(converters_gcd.CONVERTERS)
CONVERTERS.update(converters_polynomials.CONVERTERS)
CONVERTERS.update(converters_histogram.CONVERTERS)
CONVERTERS.update(converters_linalg.CONVERTERS)
CONVERTERS.update(converters_cholesky.CONVERTERS)
CONVERTERS.update(converters_sort.CONVERTERS)
CONVERTERS.update(stop_gradient.CONVERTERS)
CONVERTERS.update(symbolic_scalars.CONVERTERS)

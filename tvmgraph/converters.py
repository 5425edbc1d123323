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
- `mm`, `bmm`, `matmul`, `addmm`, `convolution`: the stock converters hard-code a float32
  result, which breaks float64 (and half-precision) programs. Here the result has the dtype of
  the inputs, as in torch.
- pooling, interpolation, normalization and grid sampling: see converters_nn.py.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import converters_nn

Converter = Callable[[torch.fx.Node, ExportedProgramImporter], relax.Expr]


def _arg(node: torch.fx.Node, index: int, name: str, default: object) -> object:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def batch_norm_train(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(out, save_mean, save_invstd, new_running_mean, new_running_var), as aten defines them."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    shape = [int(d) for d in x.ty.shape]
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

    normalized = bb.emit(
        relax.op.nn.batch_norm(
            x, ones_or(weight, 1.0), ones_or(bias, 0.0), running_mean, running_var,
            axis=1, epsilon=eps, center=bias is not None, scale=weight is not None,
            momentum=momentum, training=True,
        )
    )
    out = bb.emit(relax.TupleGetItem(normalized, 0))
    if x_dtype != dtype:
        out = bb.emit(relax.op.astype(out, x_dtype))
    axes = [0, *range(2, len(shape))]
    count = math.prod(shape[a] for a in axes)
    mean = bb.emit(relax.op.mean(x, axis=axes))
    var = bb.emit(relax.op.variance(x, axis=axes))
    invstd = bb.emit(relax.op.rsqrt(relax.op.add(var, relax.const(eps, dtype))))

    def blend(running: relax.Expr, batch: relax.Expr, scale: float) -> relax.Expr:
        keep = relax.op.multiply(running, relax.const(1.0 - momentum, dtype))
        return bb.emit(relax.op.add(keep, relax.op.multiply(batch, relax.const(momentum * scale, dtype))))

    unbiased = count / (count - 1) if count > 1 else 1.0
    new_mean = blend(running_mean, mean, 1.0)
    new_var = blend(running_var, var, unbiased)
    if stats_dtype != dtype:
        new_mean, new_var = (bb.emit(relax.op.astype(v, stats_dtype)) for v in (new_mean, new_var))
    return bb.emit(relax.Tuple([out, mean, invstd, new_mean, new_var]))


def _dtype(expr: relax.Expr) -> str:
    return expr.ty.dtype.dtype


def matmul(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """mm / bmm / matmul with the inputs' dtype."""
    a, b = importer.env[node.args[0]], importer.env[node.args[1]]
    return importer.block_builder.emit(relax.op.matmul(a, b, out_dtype=_dtype(a)))


def select(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """x.select(dim, index) with a constant index: a one-wide strided_slice, squeezed."""
    bb = importer.block_builder
    x, dim, index = importer.env[node.args[0]], int(node.args[1]), int(node.args[2])
    rank = len(x.ty.shape)
    dim %= rank
    size = x.ty.shape[dim]
    if index < 0:
        if not isinstance(size, tvm.tirx.IntImm):  # symbolic size: let take count from the end
            return bb.emit(relax.op.take(x, relax.const(index, "int64"), axis=dim, mode="wrap"))
        index += int(size)
    part = bb.emit(relax.op.strided_slice(x, axes=[dim], begin=[index], end=[index + 1]))
    return bb.emit(relax.op.squeeze(part, axis=[dim]))


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


def convolution(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """2-D convolution (plain or transposed) with the inputs' dtype; other ranks go to the stock
    converter, which is right for float32 only."""
    bb = importer.block_builder
    x, weight = importer.env[node.args[0]], importer.env[node.args[1]]
    bias = importer.env.get(node.args[2]) if node.args[2] is not None else None
    stride, padding, dilation, transposed, output_padding, groups = node.args[3:9]
    dtype = _dtype(x)
    if len(x.ty.shape) != 4:
        if dtype != "float32":
            raise NotImplementedError(f"{len(x.ty.shape) - 2}-D convolution in {dtype}")
        return importer._convolution(node)
    if transposed:
        out = relax.op.nn.conv2d_transpose(
            x, weight, strides=stride, padding=padding, output_padding=output_padding,
            dilation=dilation, groups=groups, data_layout="NCHW", kernel_layout="IOHW", out_dtype=dtype)
    else:
        out = relax.op.nn.conv2d(x, weight, strides=stride, padding=padding, dilation=dilation,
                                 groups=groups, data_layout="NCHW", kernel_layout="OIHW", out_dtype=dtype)
    out = bb.emit(out)
    if bias is None:
        return out
    return bb.emit(relax.op.add(out, relax.op.reshape(bias, (1, -1, 1, 1))))


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
        keep = bb.emit_te(dropout_kernels.dropout_keep, x, seed, p, salt) if keep_used else out
        return bb.emit(relax.Tuple([out, keep]))

    return convert


CONVERTERS: dict[str, Converter] = {
    "_native_batch_norm_legit_functional.default": batch_norm_train,
    "mm.default": matmul,
    "bmm.default": matmul,
    "matmul.default": matmul,
    "addmm.default": addmm,
    "select.int": select,
    "convolution.default": convolution,
    "native_dropout.default": dropout(None, {}),  # placeholder entry; lower.py binds the seed
}
CONVERTERS.update(converters_nn.CONVERTERS)

"""Relax gradients (TVM's and ``tvmgraph.gradients``') against torch.autograd and central
differences, op by op, then for whole networks.

Each op case builds ``sum(f(x) * w)`` in Relax and checks, for every differentiable input
(``grad_check.check_op``):

* float32: the Relax gradient matches torch.autograd on the equivalent torch op;
* float64: it matches torch.autograd, and central differences of the compiled forward
  (skipped, ``fd=False``, where the input sits on a kink on purpose; in float32 for ops whose
  TVM kernel lacks float64).

Tolerances: ``grad_check.TOLERANCES`` (per dtype), ``FD_SETTINGS``, ``NETWORK_TOLERANCE``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import logging
import pkgutil
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm import relax

import tvmgraph.gradients
from tests.models import EncoderBlock, SmallCNN, SoftmaxAttention, mlp
from tests.numeric.grad_check import (
    NETWORK_TOLERANCE,
    CompiledLossGrad,
    Inputs,
    OpCase,
    WithLoss,
    check_op,
    const_like,
    emit,
    normal,
    positive,
    spaced,
    torch_parameter_grads,
    with_indices,
)

op = relax.op


def batch_norm_inputs(shape: tuple[int, ...]) -> Inputs:
    """x, gamma, beta, running mean, running var (positive) for a batch norm over axis 1."""
    channels = (shape[1],)
    return lambda rng: [
        rng.standard_normal(shape),
        rng.uniform(0.5, 1.5, channels),
        rng.standard_normal(channels),
        rng.standard_normal(channels),
        rng.uniform(0.5, 1.5, channels),
    ]


def torch_batch_norm_tuple(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, mean: torch.Tensor,
    var: torch.Tensor, momentum: float = 0.1, eps: float = 1e-5,
) -> torch.Tensor:
    """Relax ``batch_norm(training=True)``'s three outputs, flattened and concatenated.

    Relax updates the running variance with the *biased* batch variance (torch uses the
    unbiased one), so this is written out rather than taken from ``F.batch_norm``.
    """
    axes = [0, 2, 3]
    mu = x.mean(axes)
    var_b = x.var(axes, unbiased=False)
    shape = [1, -1, 1, 1]
    y = (x - mu.view(shape)) / torch.sqrt(var_b.view(shape) + eps) * gamma.view(shape)
    y = y + beta.view(shape)
    new_mean = (1 - momentum) * mean + momentum * mu
    new_var = (1 - momentum) * var + momentum * var_b
    return torch.cat([y.reshape(-1), new_mean, new_var])


def relax_batch_norm_tuple(
    x: relax.Expr, gamma: relax.Expr, beta: relax.Expr, mean: relax.Expr, var: relax.Expr
) -> relax.Expr:
    """All three outputs of one ``batch_norm(training=True)`` call, flattened and concatenated."""
    bn = emit(op.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=True))
    fields = [op.reshape(relax.TupleGetItem(bn, 0), [-1])]
    fields += [relax.TupleGetItem(bn, i) for i in (1, 2)]
    return op.concat(fields, axis=0)


def resize_case(
    id: str, x_shape: tuple[int, ...], size: tuple[int, int], torch_mode: str, method: str,
    coordinates: str, rounding: str = "round",
) -> OpCase:
    """A resize2d case equal to ``F.interpolate`` (TVM computes resize2d in float32)."""
    align = coordinates == "align_corners" if torch_mode != "nearest" else None
    return OpCase(
        f"resize2d-{id}",
        lambda x: op.image.resize2d(
            x, size, method=method, coordinate_transformation_mode=coordinates,
            rounding_method=rounding,
        ),
        lambda x: F.interpolate(x, size=size, mode=torch_mode, align_corners=align),
        normal(x_shape),
        float64=False,
    )


# fmt: off
NEW_GRADIENTS = [
    # shape.py
    OpCase("squeeze-axis", lambda x: op.squeeze(x, [1]), lambda x: x.squeeze(1), normal((3, 1, 4))),
    OpCase("squeeze-all", lambda x: op.squeeze(x), lambda x: x.squeeze(), normal((3, 1, 4, 1))),
    OpCase("flatten", lambda x: op.flatten(x), lambda x: x.reshape(-1), normal((2, 3, 4))),
    OpCase("flip", lambda x: op.flip(x, 1), lambda x: torch.flip(x, [1]), normal((2, 3, 4))),
    OpCase("strided_slice-unit",
           lambda x: op.strided_slice(x, [1], [1], [4]), lambda x: x[:, 1:4], normal((3, 6, 4))),
    OpCase("strided_slice-steps",
           lambda x: op.strided_slice(x, [1, 2], [0, 1], [6, 4], [2, 2]),
           lambda x: x[:, 0:6:2, 1:4:2], normal((3, 6, 4))),
    OpCase("strided_slice-negative-begin-clamped-end",
           lambda x: op.strided_slice(x, [2], [-3], [100]), lambda x: x[:, :, -3:],
           normal((2, 3, 5))),
    OpCase("stack", lambda x, y: op.stack([x, y], 1), lambda x, y: torch.stack([x, y], 1),
           normal((2, 3), (2, 3))),
    OpCase("tile", lambda x: op.tile(x, [2, 1, 3]), lambda x: x.tile((2, 1, 3)), normal((2, 3))),
    OpCase("repeat-axis", lambda x: op.repeat(x, 2, 1),
           lambda x: x.repeat_interleave(2, 1), normal((2, 3, 2))),
    OpCase("repeat-flat", lambda x: op.repeat(x, 3), lambda x: x.repeat_interleave(3),
           normal((2, 3))),
    OpCase("pad-constant", lambda x: op.nn.pad(x, [0, 0, 1, 2, 2, 0]),
           lambda x: F.pad(x, (2, 0, 1, 2)), normal((2, 3, 4))),
    OpCase("pad-negative-widths-crop", lambda x: op.nn.pad(x, [0, 0, 1, -1, -2, 3]),
           lambda x: F.pad(x, (-2, 3, 1, -1)), normal((2, 3, 4))),
    # elementwise.py
    OpCase("erf", lambda x: op.erf(x), torch.erf, normal((3, 4))),
    OpCase("rsqrt", lambda x: op.rsqrt(x), torch.rsqrt, positive((3, 4))),
    OpCase("square", lambda x: op.square(x), torch.square, normal((3, 4))),
    OpCase("clip-relu6", lambda x: op.clip(x, 0.0, 6.0), F.relu6, spaced((4, 6), -3.0, 9.0)),
    OpCase("clip-relu6-on-bounds", lambda x: op.clip(x, 0.0, 6.0), F.relu6,
           lambda rng: [np.array([-1.0, 0.0, 3.0, 6.0, 7.0])], fd=False),
    OpCase("floor", lambda x: op.floor(x), torch.floor, spaced((3, 4))),
    # reduce.py
    OpCase("max-axis", lambda x: op.max(x, [1]), lambda x: x.amax(1), spaced((3, 4, 2))),
    OpCase("min-all-keepdims", lambda x: op.min(x, None, keepdims=True),
           lambda x: x.amin((0, 1), keepdim=True), spaced((3, 4))),
    OpCase("max-ties-shared", lambda x: op.max(x, [-1]), lambda x: x.amax(-1),
           lambda rng: [np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]])], fd=False),
    # activation.py
    OpCase("gelu-none", lambda x: op.nn.gelu(x), F.gelu, normal((3, 5))),
    OpCase("gelu-tanh", lambda x: op.nn.gelu_tanh(x),
           lambda x: F.gelu(x, approximate="tanh"), normal((3, 5))),
    OpCase("leakyrelu", lambda x: op.nn.leakyrelu(x, 0.1),
           lambda x: F.leaky_relu(x, 0.1), spaced((3, 4))),
    OpCase("prelu-per-channel", lambda x, a: op.nn.prelu(x, a, axis=1), F.prelu,
           lambda rng: [*spaced((2, 3, 4))(rng), rng.uniform(0.1, 0.5, (3,))]),
    OpCase("softplus-beta-threshold", lambda x: op.nn.softplus(x, 2.0, 3.0),
           lambda x: F.softplus(x, 2.0, 3.0), spaced((3, 4))),
    OpCase("selu", lambda x: op.nn.selu(x), F.selu, spaced((3, 4))),
    # norm.py
    OpCase("batch_norm-training",
           lambda x, g, b, m, v: relax.TupleGetItem(
               op.nn.batch_norm(x, g, b, m, v, axis=1, training=True), 0),
           lambda x, g, b, m, v: F.batch_norm(x, m.clone(), v.clone(), g, b, training=True),
           batch_norm_inputs((4, 3, 3, 3)), nondiff=(3, 4)),
    OpCase("batch_norm-training-2d-input",
           lambda x, g, b, m, v: relax.TupleGetItem(
               op.nn.batch_norm(x, g, b, m, v, axis=1, training=True), 0),
           lambda x, g, b, m, v: F.batch_norm(x, m.clone(), v.clone(), g, b, training=True),
           batch_norm_inputs((6, 4)), nondiff=(3, 4)),
    OpCase("batch_norm-training-no-affine",
           lambda x, g, b, m, v: relax.TupleGetItem(op.nn.batch_norm(
               x, g, b, m, v, axis=1, training=True, center=False, scale=False), 0),
           lambda x, g, b, m, v: F.batch_norm(x, m.clone(), v.clone(), training=True),
           batch_norm_inputs((4, 3, 2, 2)), nondiff=(1, 2, 3, 4)),
    OpCase("batch_norm-training-running-outputs", relax_batch_norm_tuple, torch_batch_norm_tuple,
           batch_norm_inputs((3, 2, 2, 2))),
    OpCase("batch_norm-inference",
           lambda x, g, b, m, v: relax.TupleGetItem(
               op.nn.batch_norm(x, g, b, m, v, axis=1, training=False), 0),
           lambda x, g, b, m, v: (x - m.view(1, -1, 1, 1)) / torch.sqrt(v.view(1, -1, 1, 1) + 1e-5)
           * g.view(1, -1, 1, 1) + b.view(1, -1, 1, 1),
           batch_norm_inputs((2, 3, 2, 2))),
    OpCase("layer_norm-last-axis",
           lambda x, g, b: op.nn.layer_norm(x, g, b, [-1]),
           lambda x, g, b: F.layer_norm(x, (5,), g, b), normal((2, 3, 5), (5,), (5,)),
           float64=False),
    OpCase("layer_norm-two-axes",
           lambda x, g, b: op.nn.layer_norm(x, g, b, [-2, -1]),
           lambda x, g, b: F.layer_norm(x, (3, 4), g, b), normal((2, 3, 4), (3, 4), (3, 4)),
           float64=False),
    OpCase("instance_norm",
           lambda x, g, b: op.nn.instance_norm(x, g, b, 1, [2, 3]),
           lambda x, g, b: F.instance_norm(x, weight=g, bias=b), normal((2, 3, 2, 3), (3,), (3,)),
           float64=False),
    OpCase("group_norm",
           lambda x, g, b: op.nn.group_norm(x, g, b, 3, 1, [2, 3]),
           lambda x, g, b: F.group_norm(x, 3, g, b), normal((2, 6, 2, 3), (6,), (6,)),
           float64=False),
    OpCase("rms_norm",
           lambda x, w: op.nn.rms_norm(x, w, [-1]),
           lambda x, w: F.rms_norm(x, (4,), w, 1e-5), normal((3, 4), (4,)), float64=False),
    # nn.py
    OpCase("dropout-op-is-identity", lambda x: relax.TupleGetItem(op.nn.dropout(x, 0.3), 0),
           lambda x: x * 1.0, normal((3, 4))),
    OpCase("dropout-as-mask-multiply",
           lambda x, m: op.multiply(op.multiply(x, m), const_like(1 / 0.7, x)),
           lambda x, m: x * m / 0.7,
           lambda rng: [rng.standard_normal((3, 4)), (rng.uniform(size=(3, 4)) > 0.3) * 1.0],
           nondiff=(1,)),
    OpCase("adaptive_avg_pool2d-global", lambda x: op.nn.adaptive_avg_pool2d(x, (1, 1)),
           lambda x: F.adaptive_avg_pool2d(x, 1), normal((2, 3, 4, 5))),
    OpCase("adaptive_avg_pool2d-divisible", lambda x: op.nn.adaptive_avg_pool2d(x, (2, 3)),
           lambda x: F.adaptive_avg_pool2d(x, (2, 3)), normal((1, 2, 4, 6))),
    OpCase("adaptive_avg_pool2d-overlapping", lambda x: op.nn.adaptive_avg_pool2d(x, (3, 2)),
           lambda x: F.adaptive_avg_pool2d(x, (3, 2)), normal((1, 2, 7, 5))),
    resize_case("nearest-x2", (1, 2, 3, 4), (6, 8), "nearest", "nearest_neighbor", "half_pixel"),
    resize_case("nearest-asymmetric-floor", (1, 2, 3, 4), (5, 7), "nearest", "nearest_neighbor",
                "asymmetric", "floor"),
    resize_case("bilinear-up", (1, 2, 3, 4), (5, 7), "bilinear", "linear", "half_pixel"),
    resize_case("bilinear-align-corners", (2, 1, 3, 4), (5, 7), "bilinear", "linear",
                "align_corners"),
    resize_case("bicubic-down", (1, 2, 6, 5), (3, 2), "bicubic", "cubic", "half_pixel"),
    # conv.py
    OpCase("conv1d-stride2-pad1", lambda x, w: op.nn.conv1d(x, w, 2, 1),
           lambda x, w: F.conv1d(x, w, None, 2, 1), normal((2, 3, 9), (4, 3, 3))),
    OpCase("conv1d-depthwise-dilated-asymmetric-pad",
           lambda x, w: op.nn.conv1d(x, w, 1, (2, 1), 2, 4),
           lambda x, w: F.conv1d(F.pad(x, (2, 1)), w, None, 1, 0, 2, 4),
           normal((2, 4, 9), (4, 1, 3))),
    # index.py
    OpCase("gather_elements-repeats", lambda x, i: op.gather_elements(x, i, 1),
           lambda x, i: torch.gather(x, 1, i), with_indices((4, 5), (4, 7), 5)),
    # one index per row (cross-entropy's pick): a select instead of a scatter
    OpCase("gather_elements-one-per-row", lambda x, i: op.gather_elements(x, i, 1),
           lambda x, i: torch.gather(x, 1, i), with_indices((6, 5), (6, 1), 5)),
    OpCase("gather_elements-one-per-column-3d", lambda x, i: op.gather_elements(x, i, 1),
           lambda x, i: torch.gather(x, 1, i), with_indices((2, 4, 3), (2, 1, 3), 4)),
    OpCase("gather_elements-one-per-row-fewer-rows", lambda x, i: op.gather_elements(x, i, 1),
           lambda x, i: torch.gather(x, 1, i), with_indices((6, 5), (4, 1), 5)),
    OpCase("index_tensor-repeats", lambda x, i: op.index_tensor(x, [i]),
           lambda x, i: x[i], with_indices((5, 3), (7,), 5)),
    OpCase("index_tensor-two-indices", lambda x, i, j: op.index_tensor(x, [i, j]),
           lambda x, i, j: x[i, j],
           lambda rng: [rng.standard_normal((4, 5, 2)),
                        rng.integers(0, 4, (6,)), rng.integers(0, 5, (6,))]),
]
# fmt: on


def conv_case(
    id: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], *, stride: int = 1,
    padding: int = 0, dilation: int = 1, groups: int = 1,
) -> OpCase:
    """A conv2d case (NCHW / OIHW), symmetric padding."""
    return OpCase(
        f"conv2d-{id}",
        lambda x, w: op.nn.conv2d(x, w, stride, padding, dilation, groups),
        lambda x, w: F.conv2d(x, w, None, stride, padding, dilation, groups),
        normal(x_shape, w_shape),
    )


def pool_case(
    kind: str, id: str, x_shape: tuple[int, ...], kernel: int, stride: int, padding: int = 0,
    ceil_mode: bool = False, count_include_pad: bool = True,
) -> OpCase:
    """A max_pool2d or avg_pool2d case; max pools get distinct inputs (no ties)."""
    relax_pool = op.nn.max_pool2d if kind == "max" else op.nn.avg_pool2d

    def torch_pool(x: torch.Tensor) -> torch.Tensor:
        if kind == "max":
            return F.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode)
        return F.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad)

    return OpCase(
        f"{kind}_pool2d-{id}",
        lambda x: relax_pool(
            x, kernel, stride, padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad
        ),
        torch_pool,
        spaced(x_shape) if kind == "max" else normal(x_shape),
    )


def split_then_subtract(x: relax.Expr) -> relax.Expr:
    """``a - c`` for ``a, b, c = split(x, 3, axis=1)`` (b unused: its adjoint is zeros)."""
    parts = emit(op.split(x, 3, axis=1))
    return op.subtract(relax.TupleGetItem(parts, 0), relax.TupleGetItem(parts, 2))


def cast_roundtrip(x: relax.Expr) -> relax.Expr:
    """``astype(2 * astype(x, float64), x.dtype)``."""
    dtype = str(x.ty.dtype.dtype)
    return op.astype(op.astype(x, "float64") * relax.const(2.0, "float64"), dtype)


# fmt: off
TVM_GRADIENTS = [
    conv_case("3x3-pad1", (2, 3, 5, 5), (4, 3, 3, 3), padding=1),
    conv_case("stride2-even-input", (1, 3, 8, 8), (4, 3, 3, 3), stride=2, padding=1),
    conv_case("stride2-odd-input", (1, 3, 7, 7), (4, 3, 3, 3), stride=2, padding=1),
    conv_case("stride2-unused-border", (1, 2, 8, 8), (3, 2, 3, 3), stride=2),
    conv_case("groups2", (1, 4, 5, 5), (6, 2, 3, 3), padding=1, groups=2),
    conv_case("depthwise", (2, 4, 5, 5), (4, 1, 3, 3), padding=1, groups=4),
    conv_case("depthwise-stride2", (2, 4, 6, 6), (4, 1, 3, 3), stride=2, padding=1, groups=4),
    conv_case("depthwise-multiplier2", (1, 3, 5, 5), (6, 1, 3, 3), padding=1, groups=3),
    pool_case("max", "2x2", (2, 2, 4, 4), 2, 2),
    pool_case("max", "3x3-stride2-pad1", (1, 2, 7, 7), 3, 2, 1),
    pool_case("max", "ceil-mode", (1, 1, 5, 5), 2, 2, ceil_mode=True),
    OpCase("max_pool2d-ties-go-to-the-first", lambda x: op.nn.max_pool2d(x, 3, 2, 1),
           lambda x: F.max_pool2d(x, 3, 2, 1),
           lambda rng: [np.round(rng.uniform(0, 1, (1, 1, 5, 5)))], fd=False),
    pool_case("avg", "2x2", (2, 2, 4, 4), 2, 2),
    pool_case("avg", "3x3-stride2-pad1-count-pad", (1, 2, 7, 7), 3, 2, 1),
    pool_case("avg", "3x3-stride1-pad1-exclude-pad", (1, 2, 5, 5), 3, 1, 1,
              count_include_pad=False),
    pool_case("avg", "ceil-mode", (1, 1, 5, 5), 2, 2, ceil_mode=True, count_include_pad=False),
    OpCase("matmul-2d", lambda a, b: op.matmul(a, b), torch.matmul, normal((3, 4), (4, 5))),
    OpCase("matmul-batched-weight", lambda a, b: op.matmul(a, b), torch.matmul,
           normal((2, 3, 4), (4, 5))),
    OpCase("matmul-broadcast-both", lambda a, b: op.matmul(a, b), torch.matmul,
           normal((2, 1, 3, 4), (3, 4, 5))),
    OpCase("matmul-vector-matrix", lambda a, b: op.matmul(a, b), torch.matmul,
           normal((4,), (2, 4, 5))),
    OpCase("matmul-matrix-vector", lambda a, b: op.matmul(a, b), torch.matmul,
           normal((2, 3, 4), (4,))),
    OpCase("permute_dims", lambda x: op.permute_dims(x, [2, 0, 1]),
           lambda x: x.permute(2, 0, 1), normal((2, 3, 4))),
    OpCase("reshape", lambda x: op.reshape(x, [6, 4]), lambda x: x.reshape(6, 4),
           normal((2, 3, 4))),
    OpCase("expand_dims", lambda x: op.expand_dims(x, [0, 2]),
           lambda x: x.unsqueeze(0).unsqueeze(2), normal((2, 3))),
    OpCase("broadcast_to", lambda x: op.broadcast_to(x, [2, 3, 4]),
           lambda x: x.expand(2, 3, 4), normal((3, 1))),
    OpCase("concat-negative-axis", lambda x, y: op.concat([x, y], -1),
           lambda x, y: torch.cat([x, y], -1), normal((2, 3), (2, 2))),
    OpCase("split-unused-part", split_then_subtract,
           lambda x: x[:, 0:2] - x[:, 4:6], normal((2, 6))),
    OpCase("astype-roundtrip", cast_roundtrip, lambda x: (x.double() * 2).to(x.dtype),
           normal((3, 4))),
    OpCase("softmax", lambda x: op.nn.softmax(x, -1), lambda x: torch.softmax(x, -1),
           normal((3, 5))),
    OpCase("log_softmax-axis1", lambda x: op.nn.log_softmax(x, 1),
           lambda x: torch.log_softmax(x, 1), normal((2, 4, 3))),
    OpCase("nll_loss", lambda x, t: op.nn.nll_loss(x, t), F.nll_loss,
           with_indices((5, 4), (5,), 4)),
    OpCase("where-same-shape", lambda c, x, y: op.where(c, x, y), torch.where,
           lambda rng: [rng.uniform(size=(3, 4)) > 0.5, *normal((3, 4), (3, 4))(rng)]),
    OpCase("sum-axes", lambda x: op.sum(x, [0, 2]), lambda x: x.sum((0, 2)), normal((2, 3, 4))),
    OpCase("sum-all", lambda x: op.sum(x), torch.sum, normal((2, 3))),
    OpCase("mean-axes-keepdims", lambda x: op.mean(x, [1, 2], keepdims=True),
           lambda x: x.mean((1, 2), keepdim=True), normal((2, 3, 4))),
    OpCase("mean-negative-axis", lambda x: op.mean(x, [-1]), lambda x: x.mean(-1),
           normal((2, 3, 4))),
    OpCase("variance-axis", lambda x: op.variance(x, [1]),
           lambda x: x.var(1, unbiased=False), normal((3, 4))),
    OpCase("variance-negative-axes-keepdims", lambda x: op.variance(x, [-2, -1], keepdims=True),
           lambda x: x.var((-2, -1), unbiased=False, keepdim=True), normal((2, 3, 4))),
    OpCase("cumsum", lambda x: op.cumsum(x, 1), lambda x: torch.cumsum(x, 1), normal((2, 4))),
    OpCase("add-broadcast", lambda x, y: op.add(x, y), torch.add, normal((2, 3, 4), (3, 1))),
    OpCase("subtract-broadcast", lambda x, y: op.subtract(x, y), torch.sub,
           normal((3, 1), (2, 3, 4))),
    OpCase("multiply-broadcast", lambda x, y: op.multiply(x, y), torch.mul,
           normal((2, 3, 4), (4,))),
    OpCase("divide-broadcast", lambda x, y: op.divide(x, y), torch.div,
           lambda rng: [rng.standard_normal((3, 4)), rng.uniform(0.5, 2.0, (4,))]),
    OpCase("power-constant-exponent", lambda x: op.power(x, const_like(3.0, x)), lambda x: x**3,
           normal((3, 4))),
    OpCase("power-tensor-exponent", lambda x, y: op.power(x, y), torch.pow,
           positive((3, 4), (3, 4))),
    OpCase("sqrt", lambda x: op.sqrt(x), torch.sqrt, positive((3, 4))),
    OpCase("exp", lambda x: op.exp(x), torch.exp, normal((3, 4))),
    OpCase("log", lambda x: op.log(x), torch.log, positive((3, 4))),
    OpCase("tanh", lambda x: op.tanh(x), torch.tanh, normal((3, 4))),
    OpCase("sigmoid", lambda x: op.sigmoid(x), torch.sigmoid, normal((3, 4))),
    OpCase("silu", lambda x: op.nn.silu(x), F.silu, normal((3, 4))),
    OpCase("negative", lambda x: op.negative(x), torch.neg, normal((3, 4))),
]
# fmt: on


# fmt: off
FIXED_GRADIENTS = [
    conv_case("dilation2", (1, 2, 7, 7), (3, 2, 3, 3), padding=2, dilation=2),
    # dw's conv keeps only the kernel's window: end padding dropped, then data cropped
    conv_case("1x1-stride2-crops-data", (1, 3, 8, 8), (4, 3, 1, 1), stride=2),
    # a strided 1x1 kernel: dw reads every s-th pixel (copied first), odd sizes and unequal strides
    conv_case("1x1-stride2-odd-input", (2, 3, 9, 7), (4, 3, 1, 1), stride=2),
    conv_case("1x1-stride3x2", (2, 3, 8, 7), (4, 3, 1, 1), stride=(3, 2)),
    conv_case("1x1-stride2-pad1", (1, 3, 6, 6), (4, 3, 1, 1), stride=2, padding=1),
    conv_case("stride3-dilation2", (1, 2, 11, 10), (3, 2, 3, 3), stride=3, padding=2, dilation=2),
    conv_case("dilation2-stride2-depthwise", (1, 2, 8, 8), (2, 1, 3, 3), stride=2, padding=1,
              dilation=2, groups=2),
    OpCase("take-embedding-2d-indices", lambda x, i: op.take(x, i, axis=0),
           lambda x, i: F.embedding(i, x), with_indices((6, 3), (2, 4), 6)),
    OpCase("take-select-0d-index", lambda x, i: op.take(x, i, axis=1),
           lambda x, i: x[:, i], lambda rng: [rng.standard_normal((3, 4)), np.array(2)]),
    # x.split(n) with n at least the axis's size: one part, a tensor in Relax (no tuple)
    OpCase("split-one-part", lambda x: op.split(x, 1, axis=1),
           lambda x: x.split(4, 1)[0], normal((3, 4))),
    OpCase("relu-on-zero", lambda x: op.nn.relu(x), F.relu,
           lambda rng: [np.array([-1.0, 0.0, 0.0, 2.0])], fd=False),
    OpCase("where-broadcast", lambda c, x, y: op.where(c, x, y), torch.where,
           lambda rng: [rng.uniform(size=(3, 1)) > 0.5, *normal((3, 4), (4,))(rng)]),
    OpCase("where-scalar-branch", lambda c, x, y: op.where(c, x, y), torch.where,
           lambda rng: [rng.uniform(size=(3, 4)) > 0.5, *normal((3, 4), ())(rng)]),
    OpCase("relu", lambda x: op.nn.relu(x), F.relu, spaced((3, 4))),
    OpCase("abs", lambda x: op.abs(x), torch.abs, spaced((3, 4))),
    OpCase("abs-on-zero", lambda x: op.abs(x), torch.abs,
           lambda rng: [np.array([-1.0, 0.0, 2.0])], fd=False),
    OpCase("maximum-broadcast", lambda x, y: op.maximum(x, y), torch.maximum,
           lambda rng: [spaced((3, 4))(rng)[0], rng.standard_normal((4,))]),
    OpCase("minimum", lambda x, y: op.minimum(x, y), torch.minimum,
           lambda rng: list(spaced((2, 3, 2))(rng)[0])),
    OpCase("maximum-ties-split", lambda x, y: op.maximum(x, y), torch.maximum,
           lambda rng: [np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 3.0])], fd=False),
    OpCase("minimum-ties-split", lambda x, y: op.minimum(x, y), torch.minimum,
           lambda rng: [np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.0, 3.0])], fd=False),
]
# fmt: on


@pytest.mark.parametrize("case", NEW_GRADIENTS, ids=lambda case: case.id)
def test_registered_gradient(case: OpCase) -> None:
    """Each gradient this package registers equals torch's and central differences."""
    check_op(case)


@pytest.mark.parametrize("case", FIXED_GRADIENTS, ids=lambda case: case.id)
def test_fixed_gradient(case: OpCase) -> None:
    """The TVM gradients ``fixes.py`` overrides now equal torch's and central differences."""
    check_op(case)


@pytest.mark.parametrize("case", TVM_GRADIENTS, ids=lambda case: case.id)
def test_tvm_gradient(case: OpCase) -> None:
    """TVM's own gradients of the ops the networks use equal torch's and central differences."""
    check_op(case)


##################### Registration #####################

SUBMODULES = sorted(m.name for m in pkgutil.iter_modules(tvmgraph.gradients.__path__) if not m.name.startswith("_"))


def _one_op_module(
    expr_fn: Callable[[relax.Var], relax.Expr], shape: tuple[int, ...]
) -> tvm.IRModule:
    """``main(x) = sum(expr_fn(x))`` in float32."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x]):
        with builder.dataflow():
            loss = builder.emit(op.sum(expr_fn(x)))
            gv = builder.emit_output(loss)
        builder.emit_func_output(gv)
    return builder.get()


def test_registered_levels() -> None:
    """Missing gradients sit at TVM's level 10, overrides of TVM's at 11, and all are live."""
    levels = tvmgraph.gradients.REGISTERED
    assert levels["relax.squeeze"] == levels["relax.nn.batch_norm"] == 10
    assert levels["relax.nn.relu"] == levels["relax.take"] == levels["relax.nn.conv2d"] == 11
    for name in levels:
        assert tvm.ir.Op.get(name).get_attr("FPrimalGradient") is not None, name


def test_each_gradient_is_registered_in_one_place() -> None:
    """Two modules registering one op: the second is silently dropped (same level), so one of
    them is dead code and the docs may describe the wrong one."""
    seen: dict[str, str] = {}
    for name in SUBMODULES:
        source = inspect.getsource(importlib.import_module(f"tvmgraph.gradients.{name}"))
        for op_name in re.findall(r'@register\("([\w.]+)"', source):
            assert op_name not in seen, f"{op_name} is registered in {seen[op_name]}.py and {name}.py"
            seen[op_name] = name


def test_importing_again_is_a_no_op(caplog: pytest.LogCaptureFixture) -> None:
    """Re-running the registrations (a reload) neither raises nor changes what is registered."""
    before = dict(tvmgraph.gradients.REGISTERED)
    with caplog.at_level(logging.DEBUG, logger="tvmgraph.gradients._common"):
        for name in SUBMODULES:
            importlib.reload(importlib.import_module(f"tvmgraph.gradients.{name}"))
    assert tvmgraph.gradients.REGISTERED == before
    assert "relax.squeeze already has a gradient" in caplog.text
    check_op(NEW_GRADIENTS[0])


def test_existing_gradient_is_kept() -> None:
    """Registering (without ``fixes_tvm``) for an op that has a gradient keeps the old one, as
    when a later TVM ships a gradient we also define."""

    def broken(*args: object) -> list[relax.Expr]:
        raise AssertionError("must not be called")

    tvmgraph.gradients._common.register("relax.add")(broken)
    mod = _one_op_module(lambda x: op.add(x, x), (2, 3))
    relax.transform.Gradient("main")(mod)


def test_unsupported_configuration_names_the_limit() -> None:
    """A configuration a gradient does not cover fails at ``Gradient`` time, saying what is
    supported."""
    mod = _one_op_module(lambda x: op.strided_slice(x, [1], [5], [0], [-2]), (3, 6))
    with pytest.raises(RuntimeError, match="only positive strides are supported"):
        relax.transform.Gradient("main")(mod)
    mod = _one_op_module(lambda x: op.nn.pad(x, [1, 1, 1, 1], "reflect"), (3, 6))
    with pytest.raises(RuntimeError, match="only constant padding"):
        relax.transform.Gradient("main")(mod)


##################### Whole networks #####################


class HandAttentionClassifier(nn.Module):
    """LayerNorm, hand-written softmax attention with a residual, GELU (exact erf form) head on
    the mean token."""

    def __init__(self, d: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = SoftmaxAttention(d)
        self.head = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return self.head(x.mean(1))


def kill_units(model: nn.Module) -> None:
    """Make the first MLP layer's first four units dead: their ReLU sees exactly 0."""
    with torch.no_grad():
        model[0].weight[:4] = 0.0
        model[0].bias[:4] = 0.0


def kill_channels(model: nn.Module) -> None:
    """Zero two stem channels of SmallCNN: their batch norm has zero variance and hands exactly
    ``beta = 0`` to the ReLU6, whose kink convention then decides the gradients."""
    with torch.no_grad():
        model.features[0].weight[:2] = 0.0


def classes(batch: int, count: int) -> Callable[[], torch.Tensor]:
    """Random class targets."""
    return lambda: torch.randint(0, count, (batch,))


@dataclasses.dataclass(frozen=True)
class NetCase:
    """A network, its loss, one batch, and variants of its weights checked with the same build."""

    id: str
    model: Callable[[], nn.Module]
    loss_fn: Callable[[], nn.Module]
    x_shape: tuple[int, ...]
    target: Callable[[], torch.Tensor]
    variants: tuple[Callable[[nn.Module], None], ...] = ()


NETWORKS = [
    NetCase("mlp", lambda: mlp((16, 32, 32, 10)), nn.CrossEntropyLoss, (8, 16), classes(8, 10),
            variants=(kill_units,)),
    pytest.param(
        NetCase("mobilenet-style-cnn", SmallCNN, nn.CrossEntropyLoss, (4, 3, 32, 32),
                classes(4, 10), variants=(kill_channels,)),
        marks=pytest.mark.slow,
    ),
    NetCase("transformer-mha-gelu-tanh", lambda: EncoderBlock(16, 2, 32, approximate="tanh"),
            nn.MSELoss, (2, 8, 16), lambda: torch.randn(2, 8, 16)),
    NetCase("transformer-hand-attention-gelu", HandAttentionClassifier, nn.CrossEntropyLoss,
            (4, 6, 16), classes(4, 5)),
]


def check_network(compiled: CompiledLossGrad, module: WithLoss, args: tuple, what: str) -> None:
    """Relax float32 loss and parameter gradients vs torch.autograd in float64, within
    ``NETWORK_TOLERANCE`` (its atol scaled by the network's largest gradient)."""
    loss, grads = compiled(module, args)
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    expected_loss, expected = torch_parameter_grads(copy.deepcopy(module).double(), args64)
    assert sorted(grads) == sorted(expected)
    scale = max(float(np.abs(g).max()) for g in expected.values())
    atol, rtol = NETWORK_TOLERANCE.atol * scale, NETWORK_TOLERANCE.rtol
    assert abs(loss - expected_loss) <= 1e-5 * max(1.0, abs(expected_loss)), what
    for name, want in expected.items():
        np.testing.assert_allclose(grads[name], want, rtol, atol, err_msg=f"{what}: {name}")


@pytest.mark.parametrize(
    "case", NETWORKS, ids=lambda case: case.id if isinstance(case, NetCase) else None
)
def test_network_parameter_gradients(case: NetCase) -> None:
    """Every parameter gradient of a train-mode network lowered through torch.export and Relax
    (float32) matches torch.autograd in float64: ``|relax - torch| <= 1e-4 * S + 1e-3 |torch|``
    with S the largest gradient of the network. The variants (dead units / channels) put exact
    zeros into ReLU / ReLU6, where the kink conventions of ``fixes.py`` and ``clip`` matter."""
    module = WithLoss(case.model(), case.loss_fn())
    args = (torch.randn(case.x_shape), case.target())
    compiled = CompiledLossGrad(copy.deepcopy(module), args)
    check_network(compiled, module, args, case.id)
    for variant in case.variants:
        variant(module.model)
        check_network(compiled, module, args, f"{case.id} with {variant.__name__}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bfloat16_gelu_gradient_computes_in_float32(approximate: str) -> None:
    """As torch's bfloat16 GELU backward: erf/tanh and the products in float32, rounded once
    (in bfloat16 each step rounded, and erf ran one element at a time). Within one bfloat16
    step of torch's gradient."""
    gelu = relax.op.nn.gelu if approximate == "none" else relax.op.nn.gelu_tanh
    x, w = (torch.randn(4, 64) * 2).bfloat16().float(), torch.randn(4, 64).bfloat16()
    bb = relax.BlockBuilder()
    # A float32 parameter cast to bfloat16, as under autocast (Gradient takes no bfloat16 input).
    xv, wv = relax.Var("x", relax.TensorType((4, 64), "float32")), relax.Var("w", relax.TensorType((4, 64), "bfloat16"))
    with bb.function("main", [xv, wv]):
        with bb.dataflow():
            low = bb.emit(relax.op.astype(xv, "bfloat16"))
            loss = bb.emit_output(bb.emit(relax.op.sum(relax.op.astype(relax.op.multiply(gelu(low), wv), "float32"))))
        bb.emit_func_output(loss)
    mod = relax.transform.Gradient("main", require_grads=[bb.get()["main"].params[0]])(bb.get())
    unary = "relax.erf" if approximate == "none" else "relax.tanh"
    calls = [b.value for blk in mod["main_adjoint"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == unary]
    assert calls and all(c.ty.dtype.dtype == "float32" for c in calls)
    vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"main_adjoint": mod["main_adjoint"]}), target="llvm"),
                              tvm.cpu())
    _, (dx,) = vm["main_adjoint"](x, w)
    xt = x.clone().requires_grad_()
    (F.gelu(xt.bfloat16(), approximate=approximate) * w).float().sum().backward()
    torch.testing.assert_close(torch.from_dlpack(dx), xt.grad, rtol=2**-8, atol=1e-4)


def test_cross_entropy_gradient_selects_instead_of_scattering() -> None:
    """Cross-entropy picks one logit per row (gather_elements with one index per row); its
    gradient is an element-wise select, with no zero tensor of the logits' size and no scatter
    (the GPT's training step peaked at its loss with both: 122 MiB planned, 106 without)."""
    from tests.conftest import TrainGraph

    model = nn.Linear(6, 5)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph(torch.randn(4, 6), torch.tensor([0, 3, 1, 4]))
    text = graph.lowered.as_text()
    assert "gather_elements" in text
    assert "scatter_elements" not in text and "R.zeros(R.shape([4, 5])" not in text

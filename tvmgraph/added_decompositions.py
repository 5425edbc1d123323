"""Decompositions of ops that torch.export keeps whole and that neither torch's decomposition
table nor the Relax importer lowers: without these, a graph using them failed to compile.

- Fake quantization (quantization-aware training's op): `torch.fake_quantize_per_tensor_affine`
  (scale and zero point as numbers or 0-d tensors), `fake_quantize_per_channel_affine`, and
  the `_cachemask_tensor_qparams` form `torch.ao.quantization.FakeQuantize` calls. Eager's
  kernel, element by element:

      q = int(nearbyint(x * (1 / scale)) + zero_point)        # 1 / scale in float32
      out = (clamp(q, quant_min, quant_max) - zero_point) * scale
      d out / d x = 1 where quant_min <= q <= quant_max, else 0  (straight-through)

  (a NaN, infinite or beyond-int64 q: see `_fake_quantize`).

  Rounding has no gradient in autodiff, so the result carries the straight-through gradient
  with stop_gradient: `stop(out) + where(in range, x - stop(x), 0)`, exactly `out` in value.
- `Tensor.scatter(dim, index, src or value, reduce="add" | "multiply")`: `scatter_reduce`
  with "sum" / "prod", including the destination's own values (what eager's reduce does).
"""

from __future__ import annotations

import numpy as np
import torch

from . import stop_gradient as _stop_gradient  # noqa: F401  (registers tvmgraph::stop_gradient)

aten = torch.ops.aten
_stop = torch.ops.tvmgraph.stop_gradient.default


def _fake_quantize(x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int,
                   quant_min: int, quant_max: int, saturate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(eager's fake-quantized x, the mask of elements in range); `scale` and `zero_point`
    broadcast against x. A float zero point is added before rounding (eager's per-channel
    kernel for float zero points, which subtracts it again in double precision), an integer
    one after. Beyond int64 (NaN included) eager's per-tensor kernels `saturate` (NaN and -inf
    give quant_min, +inf quant_max), its per-channel kernel converts q to int64 the x86 way
    (INT64_MIN: quant_min)."""
    if isinstance(scale, torch.Tensor):
        inverse = torch.reciprocal(scale.to(torch.float32)).to(x.dtype)
    else:  # eager computes 1.0f / scale in float32
        inverse = float(np.float32(1.0) / np.float32(scale))
    float_zero = isinstance(zero_point, torch.Tensor) and zero_point.is_floating_point()
    zero = zero_point.to(x.dtype) if isinstance(zero_point, torch.Tensor) else zero_point
    q = torch.round(x * inverse + zero) if float_zero else torch.round(x * inverse) + zero
    beyond = q.isnan() if saturate else ~(q.abs() < 2.0 ** 63)
    q = torch.where(beyond, float("-inf"), q)
    in_range = (q >= quant_min) & (q <= quant_max)
    clamped = torch.clamp(q, quant_min, quant_max)
    if float_zero:  # eager's kernel subtracts a float zero point and scales without rounding between
        out = ((clamped.double() - zero_point.double()) * scale.double()).to(x.dtype)
    else:
        out = (clamped - zero) * (scale.to(x.dtype) if isinstance(scale, torch.Tensor) else scale)
    return _stop(out) + torch.where(in_range, x - _stop(x), 0.0), in_range


def fake_quantize_per_tensor_affine(x: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int,
                                    quant_min: int, quant_max: int) -> torch.Tensor:
    return _fake_quantize(x, scale, zero_point, quant_min, quant_max, saturate=True)[0]


def fake_quantize_per_tensor_affine_cachemask_tensor_qparams(
        x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, fake_quant_enabled: torch.Tensor,
        quant_min: int, quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, in_range = _fake_quantize(x, scale.reshape(()), zero_point.reshape(()), quant_min, quant_max,
                                   saturate=True)
    enabled = fake_quant_enabled.reshape(()) != 0  # eager: off -> x itself, mask all true
    return torch.where(enabled, out, x), in_range | ~enabled


def fake_quantize_per_channel_affine(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int,
                                     quant_min: int, quant_max: int) -> torch.Tensor:
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return _fake_quantize(x, scale.reshape(shape), zero_point.reshape(shape), quant_min, quant_max,
                          saturate=False)[0]


_REDUCE = {"add": "sum", "multiply": "prod"}


def scatter_reduce_src(x: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor, *,
                       reduce: str) -> torch.Tensor:
    return torch.scatter_reduce(x, dim, index, src, _REDUCE[reduce], include_self=True)


def scatter_reduce_value(x: torch.Tensor, dim: int, index: torch.Tensor, value: float, *,
                         reduce: str) -> torch.Tensor:
    src = torch.full(index.shape, value, dtype=x.dtype, device=x.device)
    return torch.scatter_reduce(x, dim, index, src, _REDUCE[reduce], include_self=True)


ADDED = {
    aten.fake_quantize_per_tensor_affine.default: fake_quantize_per_tensor_affine,
    aten.fake_quantize_per_tensor_affine.tensor_qparams: fake_quantize_per_tensor_affine,
    aten._fake_quantize_per_tensor_affine_cachemask_tensor_qparams.default:
        fake_quantize_per_tensor_affine_cachemask_tensor_qparams,
    aten.fake_quantize_per_channel_affine.default: fake_quantize_per_channel_affine,
    aten.scatter.reduce: scatter_reduce_src,
    aten.scatter.value_reduce: scatter_reduce_value,
}

"""Ops torch.export keeps whole that nothing lowered before tvmgraph/added_decompositions.py
(each failed to compile), against torch eager: fake quantization (values, and the
straight-through gradient of quantization-aware training) and `scatter(..., reduce=)`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import Fn, ModuleGraph, assert_close


def _with_specials(x: torch.Tensor) -> torch.Tensor:
    """x with NaN, infinities, values beyond int64 and ties of the rounding in its first rows."""
    x = x.clone()
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.05])
    x[1, :3] = torch.tensor([0.15, -0.25, 0.35])
    return x


def _fake_quantized(x, scale, zero_point, float_zero_point, enabled):
    return [
        torch.fake_quantize_per_tensor_affine(x, 0.1, 3, -128, 127),
        torch.fake_quantize_per_tensor_affine(x, 0.07, 0, 0, 15),
        torch.fake_quantize_per_tensor_affine(x, scale[0], zero_point[0].long(), -128, 127),
        torch.fake_quantize_per_channel_affine(x, scale, zero_point, 1, -128, 127),
        torch.fake_quantize_per_channel_affine(x, scale, float_zero_point, 1, -8, 7),
        torch._fake_quantize_per_tensor_affine_cachemask_tensor_qparams(
            x, scale[:1], zero_point[:1], enabled, -128, 127)[0],
    ]


def test_fake_quantize_matches_eager_bit_for_bit() -> None:
    """Every form, per tensor and per channel, scales and zero points as numbers and tensors,
    FakeQuantize's switch on and off, NaN and infinities included (eager's per-tensor kernels
    saturate them, its per-channel one gives quant_min)."""
    scale = torch.rand(6) * 0.2 + 0.03
    zero_point = torch.randint(-5, 5, (6,), dtype=torch.int32)
    float_zero_point = torch.randn(6)
    graph = ModuleGraph(Fn(_fake_quantized))
    for x, on in ((_with_specials(torch.randn(4, 6) * 8), 1), (torch.randn(4, 6) * 3, 0)):
        enabled = torch.tensor([on])
        expected = _fake_quantized(x, scale, zero_point, float_zero_point, enabled)
        actual = graph(x, scale, zero_point, float_zero_point, enabled)
        for i, (a, e) in enumerate(zip(actual, expected)):
            torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"form {i}: {m}")


def test_fake_quantize_trains_with_the_straight_through_gradient() -> None:
    """Quantization-aware training of a linear layer: weights per channel, activations per
    tensor, some clipped; three SGD steps give eager's losses and parameters (the gradient
    passes where the value is in range, stops where it is clipped)."""
    model = nn.Linear(6, 5)
    reference = copy.deepcopy(model)
    scale, zero_point = torch.rand(5) * 0.1 + 0.02, torch.randint(-3, 3, (5,), dtype=torch.int32)

    def loss_of(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = torch.fake_quantize_per_channel_affine(linear.weight, scale, zero_point, 0, -8, 7)
        h = torch.fake_quantize_per_tensor_affine(x, 0.05, 0, -20, 20)
        return nn.functional.linear(h, w, linear.bias).pow(2).mean()

    class QAT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return loss_of(self.linear, x)

    from tests.conftest import SGDStep  # lr 1, momentum 0.9

    graph = SGDStep(QAT())
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0, momentum=0.9)
    for _ in range(3):
        x = torch.randn(8, 6)
        loss = graph(x)
        optimizer.zero_grad()
        expected = loss_of(reference, x)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)


def _scattered(x: torch.Tensor) -> list[torch.Tensor]:
    rows = torch.tensor([[1, 1, 0, 2, 0, 1]])
    cols = torch.tensor([[1, 1, 0, 2]]).expand(3, -1)
    return [
        torch.zeros(3, 6).scatter(0, rows.expand(3, -1), x, reduce="add"),
        torch.ones(3, 6).scatter(1, cols, x, reduce="multiply"),
        x.scatter(1, cols, 2.5, reduce="multiply"),
        x.scatter(0, rows, -1.5, reduce="add"),
    ]


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
def test_scatter_with_reduce_matches_eager() -> None:
    """`Tensor.scatter(..., reduce="add" | "multiply")`, from a tensor and from a number, a
    repeated index included (every repeat reduces into the destination's own value)."""
    graph = ModuleGraph(Fn(_scattered))
    for _ in range(2):
        x = torch.randn(3, 6)
        for actual, expected in zip(graph(x), _scattered(x)):
            assert_close(actual, expected)

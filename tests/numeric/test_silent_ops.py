"""Ops whose stock TVM 0.27 lowering gave silently wrong numbers, against torch eager (CPU, LLVM).

Each case failed before tvmgraph/converters_nn.py (wrong values, shapes or dtypes, or a NaN
gradient) and must now match eager within the dtype's tolerance, or be refused with an
UnsupportedOpError naming the op. Gradients come from a training graph whose parameter is the
op's input: SGD with lr=1 makes the update equal the gradient of `sum(op(x) * w)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmgraph
from tests.conftest import Fn, ModuleGraph, SGDStep, assert_close
from tvmgraph.errors import UnsupportedOpError

# torch.testing's own defaults for the half types; float32 and int64 come from conftest.
HALF_TOLERANCES = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def _grid() -> torch.Tensor:
    return torch.rand(2, 4, 5, 2) * 2.2 - 1.1  # a few points outside [-1, 1] exercise padding


def _quarter_grid() -> torch.Tensor:
    return torch.randint(-4, 5, (2, 4, 5, 2)) / 4.0  # points on pixel centres and half-way


def _bool_mask() -> torch.Tensor:
    # Row 1 is fully masked: SDPA must give zeros there (torch's _safe_softmax), not NaN.
    return torch.tensor([[True, False, True, True], [False] * 4, [True, True, False, False], [True] * 4])


def _float_mask() -> torch.Tensor:
    return torch.zeros(1, 2, 4, 4).masked_fill(~_bool_mask(), float("-inf"))


def x4() -> torch.Tensor:
    return torch.randn(2, 3, 7, 9)


FORWARD = [
    pytest.param(lambda x: F.max_pool2d(x, 2, return_indices=True), lambda: (x4(),),
                 id="max_pool2d-return_indices"),
    pytest.param(lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, return_indices=True),
                 lambda: (x4()[0],), id="max_pool2d-return_indices-unbatched-ceil"),
    pytest.param(lambda x: F.max_pool2d(x, 3, stride=1, return_indices=True),
                 lambda: (torch.randint(0, 2, (1, 2, 6, 6)).float(),), id="max_pool2d-return_indices-ties"),
    pytest.param(lambda x: F.max_pool1d(x, 3, stride=2, padding=1, return_indices=True),
                 lambda: (torch.randn(2, 3, 10),), id="max_pool1d-return_indices"),
    pytest.param(lambda x: F.max_pool1d(x, 2, stride=2, dilation=2, ceil_mode=True, return_indices=True),
                 lambda: (torch.randn(2, 3, 11),), id="max_pool1d-return_indices-dilation-ceil"),
    pytest.param(lambda x: F.max_pool3d(x, 2, return_indices=True), lambda: (torch.randn(1, 2, 5, 6, 7),),
                 id="max_pool3d-return_indices"),
    pytest.param(lambda x: F.max_pool3d(x, 3, stride=2, padding=1, return_indices=True),
                 lambda: (torch.randn(1, 2, 5, 6, 7),), id="max_pool3d-return_indices-padding"),
    pytest.param(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, divisor_override=2), lambda: (x4(),),
                 id="avg_pool2d-divisor_override"),
    pytest.param(lambda x: F.avg_pool2d(x, 3, stride=2, ceil_mode=True, divisor_override=5), lambda: (x4(),),
                 id="avg_pool2d-divisor_override-ceil"),
    pytest.param(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
                 lambda: (x4(),), id="avg_pool2d-ceil-exclude_pad"),
    pytest.param(lambda x: F.avg_pool3d(x, 2, divisor_override=3), lambda: (torch.randn(1, 2, 5, 6, 7),),
                 id="avg_pool3d-divisor_override"),
    pytest.param(lambda x, g: F.grid_sample(x, g, align_corners=False), lambda: (x4(), _grid()),
                 id="grid_sample-bilinear-zeros"),
    pytest.param(lambda x, g: F.grid_sample(x, g, padding_mode="border", align_corners=True),
                 lambda: (x4(), _grid()), id="grid_sample-bilinear-border-align_corners"),
    pytest.param(lambda x, g: F.grid_sample(x, g, padding_mode="reflection", align_corners=False),
                 lambda: (x4(), _grid()), id="grid_sample-bilinear-reflection"),
    pytest.param(lambda x, g: F.grid_sample(x, g, mode="nearest", align_corners=False),
                 lambda: (torch.randn(2, 2, 4, 4), _quarter_grid()), id="grid_sample-nearest-ties"),
    pytest.param(lambda x, g: torch.grid_sampler_2d(x, g, 0, 0, False), lambda: (x4(), _grid()),
                 id="grid_sampler_2d"),
    pytest.param(lambda x: F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True), lambda: (x4(),),
                 id="upsample_bilinear2d_aa-down"),
    pytest.param(lambda x: F.interpolate(x, size=(3, 20), mode="bilinear", antialias=True),
                 lambda: (torch.randn(1, 2, 13, 6),), id="upsample_bilinear2d_aa-mixed"),
    pytest.param(lambda x: F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True, align_corners=True),
                 lambda: (x4(),), id="upsample_bilinear2d_aa-align_corners"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=0.45, mode="bilinear", antialias=True),
                 lambda: (torch.randn(1, 2, 13, 17),), id="upsample_bilinear2d_aa-scale_factor"),
    pytest.param(lambda x: F.interpolate(x, size=(5, 5), mode="nearest"), lambda: (torch.randn(1, 1, 8, 8),),
                 id="upsample_nearest2d-size"),
    pytest.param(lambda x: F.interpolate(x, size=(13, 3), mode="nearest"), lambda: (torch.randn(1, 2, 9, 11),),
                 id="upsample_nearest2d-size-up-down"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest"), lambda: (torch.randn(1, 2, 5, 7),),
                 id="upsample_nearest2d-scale_factor"),
    pytest.param(lambda x, w, b: torch.native_layer_norm(x, [9], w, b, 1e-5),
                 lambda: (x4(), torch.randn(9), torch.randn(9)), id="native_layer_norm"),
    pytest.param(lambda x: torch.native_layer_norm(x, [7, 9], None, None, 1e-5), lambda: (x4(),),
                 id="native_layer_norm-no_affine"),
    pytest.param(lambda x, w, b: torch.native_group_norm(x, w, b, 2, 4, 63, 2, 1e-5),
                 lambda: (torch.randn(2, 4, 7, 9), torch.randn(4), torch.randn(4)), id="native_group_norm"),
    pytest.param(lambda x: torch.native_group_norm(x, None, None, 2, 4, 63, 2, 1e-5),
                 lambda: (torch.randn(2, 4, 7, 9),), id="native_group_norm-no_affine"),
    pytest.param(lambda x: F.scaled_dot_product_attention(x, x * 0.5, x, attn_mask=_bool_mask()),
                 lambda: (torch.randn(1, 2, 4, 8),), id="_safe_softmax-sdpa-masked_row"),
    # selu and celu decompose into elu(x, alpha, scale, input_scale); scale was dropped
    pytest.param(F.selu, lambda: (torch.randn(4, 9),), id="selu"),
    pytest.param(lambda x: F.celu(x, 0.5), lambda: (torch.randn(4, 9),), id="celu-alpha"),
    pytest.param(lambda x: F.elu(x, 0.7), lambda: (torch.randn(4, 9),), id="elu-alpha"),
]


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("fn, make_args", FORWARD)
def test_forward_matches_eager(fn: Callable, make_args: Callable) -> None:
    """The inference graph returns what eager returns: same shapes, dtypes (int64 indices) and
    values within the float32 tolerance."""
    args = make_args()
    expected = _as_tuple(fn(*args))
    actual = _as_tuple(ModuleGraph(Fn(fn))(*args))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_close(a, e)


def _assert_half_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    torch.testing.assert_close(actual, expected, **HALF_TOLERANCES[expected.dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_half_batch_norm_keeps_dtype(dtype: torch.dtype, train: bool) -> None:
    """BatchNorm2d in float16/bfloat16 returns the input's dtype (it returned float32), with
    eager's values; in train mode the running statistics also stay in that dtype and match."""
    model = nn.BatchNorm2d(3).to(dtype).train(train)
    with torch.no_grad():
        model.running_mean.uniform_(-1, 1)
        model.running_var.uniform_(0.5, 2)
    reference = nn.BatchNorm2d(3).to(dtype).train(train)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 7, 9).to(dtype)
    expected = reference(x)
    actual = ModuleGraph(model)(x)
    _assert_half_close(actual, expected)
    _assert_half_close(model.running_mean, reference.running_mean)
    _assert_half_close(model.running_var, reference.running_var)


def test_grid_sample_bicubic_is_refused() -> None:
    """Bicubic grid_sample (TVM's cubic kernel is not torch's) is an UnsupportedOpError naming
    the op and the modes that work, not a wrong number."""
    graph = ModuleGraph(Fn(lambda x, g: F.grid_sample(x, g, mode="bicubic", align_corners=False)))
    message = r"aten\.grid_sampler_2d\.default .*mode='bicubic'.*'bilinear' or 'nearest'"
    with pytest.raises(UnsupportedOpError, match=message):
        graph(x4(), _grid())


# ---- gradients ----

class OpOfParameter(nn.Module):
    """loss = sum(fn(x) * w), with the op input x as the parameter."""

    def __init__(self, fn: Callable, x: torch.Tensor):
        super().__init__()
        self.fn = fn
        self.x = nn.Parameter(x.clone())

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (self.fn(self.x) * w).sum()


GRADIENTS = [
    # ceil_mode: TVM's max-pool gradient read past the input (values like 7e22)
    pytest.param(lambda x: F.max_pool1d(x, 3, stride=2, ceil_mode=True), lambda: torch.randn(1, 2, 3),
                 id="max_pool1d-ceil-partial_window"),
    pytest.param(lambda x: F.max_pool2d(x, 3, stride=2, ceil_mode=True), lambda: torch.randn(1, 2, 6, 7),
                 id="max_pool2d-ceil"),
    # one window over the whole width, several channels: TVM's pool gradient was wrong
    pytest.param(lambda x: F.max_pool1d(x, 3, stride=1), lambda: torch.randn(1, 3, 3), id="max_pool1d-whole_width"),
    pytest.param(F.selu, lambda: torch.randn(4, 9), id="selu"),
    pytest.param(lambda x: F.celu(x, 0.5), lambda: torch.randn(4, 9), id="celu-alpha"),
    pytest.param(lambda x: F.avg_pool2d(x, 2, stride=2, ceil_mode=True), x4, id="avg_pool2d-ceil"),
    pytest.param(lambda x: F.avg_pool2d(x, 3, stride=3, padding=1, ceil_mode=True), x4, id="avg_pool2d-ceil-padding"),
    pytest.param(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, divisor_override=2), x4,
                 id="avg_pool2d-divisor_override"),
    pytest.param(lambda x: F.max_pool1d(x, 3, stride=2, padding=1, ceil_mode=True), lambda: torch.randn(2, 3, 10),
                 id="max_pool1d-ceil-padding"),
    pytest.param(lambda x: F.max_pool1d(x, 3, stride=1), lambda: torch.randint(0, 3, (2, 3, 10)).float(),
                 id="max_pool1d-ties"),
    pytest.param(lambda x: F.scaled_dot_product_attention(x, x * 0.5, x, attn_mask=_bool_mask()),
                 lambda: torch.randn(1, 2, 4, 8), id="_safe_softmax-sdpa-masked_row"),
    pytest.param(lambda x: F.scaled_dot_product_attention(x, x * 0.5, x, attn_mask=_float_mask()),
                 lambda: torch.randn(1, 2, 4, 8), id="_safe_softmax-sdpa-float_mask"),
    pytest.param(lambda x: torch.ops.aten._safe_softmax(x.masked_fill(~_bool_mask(), float("-inf")), -1),
                 lambda: torch.randn(4, 4), id="_safe_softmax-masked_fill"),
    pytest.param(lambda x: torch.ops.aten._safe_softmax(x, -1), lambda: torch.randn(3, 4), id="_safe_softmax"),
    pytest.param(lambda x: F.interpolate(x, size=(4, 5), mode="bilinear", antialias=True), x4,
                 id="upsample_bilinear2d_aa"),
    pytest.param(lambda x: F.interpolate(x, size=(5, 5), mode="nearest"), lambda: torch.randn(1, 2, 8, 8),
                 id="upsample_nearest2d-size"),
    pytest.param(lambda x: F.interpolate(x, size=(11, 13), mode="nearest"), x4, id="upsample_nearest2d-size-up"),
    pytest.param(lambda x: F.group_norm(x, 3), lambda: torch.randn(2, 6, 5), id="group_norm-no_affine"),
]


@pytest.mark.parametrize("fn, make_x", GRADIENTS)
def test_gradient_matches_eager(fn: Callable, make_x: Callable) -> None:
    """One SGD step with lr=1 moves the op's input by minus torch.autograd's gradient of
    sum(op(x) * w) (float32 tolerance; no NaN)."""
    x = make_x()
    w = torch.randn_like(fn(x))
    leaf = x.clone().requires_grad_()
    (fn(leaf) * w).sum().backward()
    model = OpOfParameter(fn, x)
    SGDStep(model)(w)
    assert_close(x - model.x.detach(), leaf.grad)


def test_masked_attention_still_recomputed(caplog: pytest.LogCaptureFixture) -> None:
    """The NaN-free `_safe_softmax` keeps SDPA with a mask in the shape RecomputeAttention
    matches (scores + mask -> softmax -> matmul): the pass still fires, and the gradient
    (fully masked row included) matches eager."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x * 0.5, x, attn_mask=_bool_mask())

    x = torch.randn(1, 2, 4, 6)  # not test_gradient_matches_eager's shape: a compiled-cache hit logs no pass
    w = torch.randn_like(fn(x))
    leaf = x.clone().requires_grad_()
    (fn(leaf) * w).sum().backward()
    model = OpOfParameter(fn, x)
    graph = SGDStep(model)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        graph(w)
    assert "RecomputeAttention: 1 attention(s) recomputed in the backward pass" in caplog.text
    assert_close(x - model.x.detach(), leaf.grad)


def _nan_activations(x):
    """x [2, 3, 4, 4] holding NaN: every op torch propagates it through."""
    zeros = torch.zeros_like(x)
    return (F.relu(x), F.relu6(x), torch.clamp(x, -1, 1), torch.clamp_min(x, 0), F.hardtanh(x),
            torch.maximum(x, zeros), torch.minimum(zeros, x), F.elu(x), torch.sigmoid(x), F.silu(x),
            torch.tanh(x), F.gelu(x), torch.exp(x), torch.softmax(x, -1), F.hardswish(x),
            F.max_pool2d(x, 2), F.adaptive_max_pool2d(x, 1), F.max_pool2d(x, 3, 1, 1), x.amax((2, 3)))


def test_nan_propagates_like_eager() -> None:
    """TVM's CPU max/min drop a NaN operand: relu(NaN) was 0, clamp(NaN, -1, 1) was 1,
    sigmoid(NaN) 0 (its exp clamps), a max pool over a NaN its other values
    (tvmgraph/schedules/propagate_nan.py). Each output now has NaN exactly where eager's has."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 4)
    x[0, 1, 2, 3] = x[1, 0, 0, 0] = float("nan")
    for i, (a, e) in enumerate(zip(ModuleGraph(Fn(_nan_activations))(x), _nan_activations(x))):
        assert torch.equal(a.isnan(), e.isnan()), f"output {i}: NaN at {a.isnan().nonzero().tolist()}"
        assert_close(a, e, equal_nan=True)


def test_a_nan_input_makes_the_training_loss_nan_as_in_eager() -> None:
    """A NaN reaching a ReLU network shows in the loss, as in eager, instead of training on
    with a finite loss."""
    from tests.conftest import TrainGraph

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 6), torch.randn(4, 2)
    x[2, 1] = float("nan")
    assert torch.isnan(nn.functional.mse_loss(model(x), y))
    assert torch.isnan(graph(x, y))

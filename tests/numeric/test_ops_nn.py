"""nn ops that tvmgraph could not run or differentiate (convolutions of every rank, plain and
transposed; 3-D and adaptive poolings; unfold; linear, trilinear and bicubic interpolation; 3-D grid_sample; chunked
linear_cross_entropy; _batch_norm_with_update), against torch eager and torch.autograd.

Forward cases run several per inference graph, gradient cases several per training graph: every
differentiable input (data and weights) is a parameter, loss = sum_i sum(op_i(...) * w_i), and
one SGD step with lr=1 moves each parameter by minus its gradient. The Relax gradients themselves
are also checked in float64 against torch and central differences (tests/numeric/grad_check.py).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear_cross_entropy_options import LinearCrossEntropyOptions
from tvm import relax

from tests.conftest import Fn, ModuleGraph, SGDStep, TrainGraph, assert_close, assert_steps_match_eager
from tests.numeric.grad_check import OpCase, check_op, normal, spaced

op = relax.op
# Gradients go through one more reduction and the lr=1 update than the forward.
GRAD_TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def _randn(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(*shape)


def _quietly(fn: Callable, *args: object) -> torch.Tensor:
    """fn(*args) without its UserWarning (torch warns of the copy 'same' padding makes when it
    pads unevenly: an even kernel with an odd dilation)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args)


# (id, fn, input makers): fn(*inputs) -> tensor or tuple of tensors.
Case = tuple[str, Callable, tuple[Callable[[], torch.Tensor], ...]]

CONV_CASES: list[Case] = [
    ("conv3d-groups2-stride-dilation", lambda x, w: F.conv3d(x, w, None, (2, 1, 2), (1, 0, 1), (1, 2, 1), 2),
     (_randn(2, 4, 5, 6, 7), _randn(6, 2, 3, 2, 3))),
    ("conv3d-bias", lambda x, w, b: F.conv3d(x, w, b, 1, 1), (_randn(1, 2, 4, 5, 3), _randn(3, 2, 3, 3, 3), _randn(3))),
    ("conv_transpose1d-stride3-dilation", lambda x, w: F.conv_transpose1d(x, w, None, 3, 1, 2, 3, 1),
     (_randn(2, 3, 5), _randn(3, 2, 3))),
    ("conv_transpose2d-groups2-output_padding", lambda x, w, b: F.conv_transpose2d(x, w, b, 2, 1, (1, 0), 2, 2),
     (_randn(2, 4, 5, 4), _randn(4, 3, 3, 2), _randn(6))),
    # output_padding 1 at stride 1 (allowed below the dilation; Relax refuses it)
    ("conv_transpose2d-output_padding-past-stride", lambda x, w: F.conv_transpose2d(x, w, None, 1, 0, 1, 1, 2),
     (_randn(1, 2, 4, 3), _randn(2, 3, 3, 2))),
    ("conv_transpose3d-groups2", lambda x, w: F.conv_transpose3d(x, w, None, (2, 1, 1), (1, 0, 0), (1, 0, 0), 2),
     (_randn(1, 4, 3, 2, 3), _randn(4, 1, 3, 2, 2))),
    # Dilated, stride 1: dx is a conv of dy with the flipped kernel (tvmgraph/gradients/conv.py),
    # in and out channels swapped per group; uneven padding ('same' with an even kernel), none,
    # and padding past the dilated kernel (the transposed conv then).
    ("conv1d-dilation4-same", lambda x, w, b: F.conv1d(x, w, b, 1, 4, 4), (_randn(2, 3, 20), _randn(5, 3, 3), _randn(5))),
    ("conv1d-dilation3-groups2-even-kernel-same", lambda x, w: _quietly(F.conv1d, x, w, None, 1, "same", 3, 2),
     (_randn(2, 4, 17), _randn(6, 2, 4))),
    ("conv1d-dilation2-depthwise-unpadded", lambda x, w: F.conv1d(x, w, None, 1, 0, 2, 4), (_randn(2, 4, 19), _randn(4, 1, 3))),
    ("conv1d-dilation2-padding-past-kernel", lambda x, w: F.conv1d(x, w, None, 1, 3, 2), (_randn(1, 2, 9), _randn(3, 2, 2))),
    ("conv2d-dilation2x3-groups3", lambda x, w: F.conv2d(x, w, None, 1, (2, 1), (2, 3), 3),
     (_randn(2, 6, 9, 11), _randn(6, 2, 3, 2))),
    # a 1 x k kernel dilated along the width only, on images taller than 1: a conv2d, not a conv1d
    ("conv2d-1x3-kernel-dilation1x2", lambda x, w: F.conv2d(x, w, None, 1, (0, 2), (1, 2)),
     (_randn(2, 3, 5, 9), _randn(4, 3, 1, 3))),
]

# 1-D and 3-D convolutions in float64 were refused (the stock converter's result is float32).
FLOAT64_CASES: list[Case] = [
    ("conv1d-float64", lambda x, w: F.conv1d(x, w, None, 2, 1),
     (lambda: torch.randn(2, 2, 7, dtype=torch.float64), lambda: torch.randn(3, 2, 3, dtype=torch.float64))),
    ("conv_transpose3d-float64", lambda x, w: F.conv_transpose3d(x, w, None, 2),
     (lambda: torch.randn(1, 2, 3, 2, 3, dtype=torch.float64), lambda: torch.randn(2, 3, 2, 2, 2, dtype=torch.float64))),
]

POOL_CASES: list[Case] = [
    ("avg_pool3d", lambda x: F.avg_pool3d(x, (3, 2, 3), (2, 1, 2), (1, 0, 1)), (_randn(2, 2, 5, 4, 7),)),
    ("avg_pool3d-exclude-pad", lambda x: F.avg_pool3d(x, 3, 2, 1, count_include_pad=False), (_randn(1, 2, 5, 6, 4),)),
    ("max_pool3d-dilation", lambda x: F.max_pool3d(x, (3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 1, 2)),
     (_randn(2, 2, 5, 4, 8),)),
    # ties: torch's gradient goes to the first maximum of each window only
    ("max_pool3d-ties", lambda x: F.max_pool3d(x, 2, 1), (lambda: torch.randint(0, 3, (1, 2, 3, 4, 4)).float(),)),
    ("adaptive_avg_pool3d", lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), (_randn(2, 2, 5, 4, 7),)),
    ("adaptive_max_pool1d", lambda x: F.adaptive_max_pool1d(x, 4), (_randn(2, 3, 9),)),
    ("adaptive_max_pool2d-unbatched", lambda x: F.adaptive_max_pool2d(x, (3, 5)), (_randn(3, 7, 8),)),
    ("adaptive_max_pool3d", lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), (_randn(1, 2, 5, 7, 3),)),
]

RESAMPLE_CASES: list[Case] = [
    ("unfold", lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)), (_randn(2, 3, 6, 7),)),
    ("unfold-unbatched", lambda x: F.unfold(x, 2), (_randn(2, 4, 5),)),
    ("interpolate-linear-size", lambda x: F.interpolate(x, size=7, mode="linear"), (_randn(2, 3, 5),)),
    ("interpolate-linear-align_corners-down", lambda x: F.interpolate(x, size=3, mode="linear", align_corners=True),
     (_randn(2, 3, 8),)),
    ("interpolate-trilinear-scale", lambda x: F.interpolate(x, scale_factor=1.7, mode="trilinear"),
     (_randn(1, 2, 3, 4, 5),)),
    ("interpolate-trilinear-size-align_corners",
     lambda x: F.interpolate(x, size=(2, 6, 3), mode="trilinear", align_corners=True), (_randn(1, 2, 4, 3, 5),)),
    # its decomposition computes source coordinates from an arange (which needed a gradient)
    ("interpolate-bicubic", lambda x: F.interpolate(x, size=(5, 7), mode="bicubic"), (_randn(1, 2, 4, 5),)),
    ("grid_sample-3d-trilinear-zeros", lambda x, g: F.grid_sample(x, g, align_corners=False),
     (_randn(2, 3, 4, 5, 3), lambda: torch.rand(2, 3, 2, 4, 3) * 2.4 - 1.2)),
    ("grid_sample-3d-trilinear-border-align_corners",
     lambda x, g: F.grid_sample(x, g, padding_mode="border", align_corners=True),
     (_randn(1, 2, 3, 4, 5), lambda: torch.rand(1, 2, 3, 2, 3) * 2.4 - 1.2)),
    ("grid_sample-3d-nearest", lambda x, g: F.grid_sample(x, g, mode="nearest", align_corners=False),
     (_randn(1, 2, 3, 4, 5), lambda: torch.rand(1, 2, 3, 2, 3) * 2.4 - 1.2)),
]

CHUNKED = LinearCrossEntropyOptions(batch_chunk_size=2, allow_retain_graph=True)
LOSS_CASES: list[Case] = [
    ("linear_cross_entropy-chunked-mean-ignore_index",
     lambda x, w, b: F.linear_cross_entropy(x, w, torch.tensor([1, 0, 3, 1, -100, 2]), linear_bias=b,
                                            ignore_index=-100, options=CHUNKED),
     (_randn(6, 5), _randn(4, 5), _randn(4))),
    ("linear_cross_entropy-chunked-sum-weight",
     lambda x, w: F.linear_cross_entropy(x, w, torch.tensor([1, 0, 3, 1, 2]), reduction="sum",
                                         weight=torch.tensor([1.0, 2.0, 0.5, 1.5]), options=CHUNKED),
     (_randn(5, 5), _randn(4, 5))),
    ("linear_cross_entropy-chunked-none-weight",
     lambda x, w: F.linear_cross_entropy(x, w, torch.tensor([1, 0, 3, 1, 2]), reduction="none",
                                         weight=torch.tensor([1.0, 2.0, 0.5, 1.5]), options=CHUNKED),
     (_randn(5, 5), _randn(4, 5))),
]


class Calls(nn.Module):
    """Every case's fn on its inputs; with ``train``, the inputs are parameters and the output
    is ``sum_i sum(fn_i(...) * w_i)`` for the weights given to forward."""

    def __init__(self, cases: list[Case], inputs: list[list[torch.Tensor]], train: bool):
        super().__init__()
        self.fns = [fn for _, fn, _ in cases]
        self.train_mode = train
        if train:
            self.params = nn.ParameterList([nn.Parameter(x.clone()) for xs in inputs for x in xs])
        self.arity = [len(xs) for xs in inputs]

    def forward(self, *flat: torch.Tensor):
        source = list(self.params) if self.train_mode else list(flat)
        outputs, at = [], 0
        for fn, n in zip(self.fns, self.arity):
            out = fn(*source[at:at + n])
            outputs += list(out) if isinstance(out, tuple) else [out]
            at += n
        if not self.train_mode:
            return tuple(outputs)
        return sum((o * w).sum() for o, w in zip(outputs, flat))


def _inputs(cases: list[Case]) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    return [[make() for make in makers] for _, _, makers in cases]


def check_forward(cases: list[Case]) -> None:
    inputs = _inputs(cases)
    expected = Calls(cases, inputs, train=False)(*(x for xs in inputs for x in xs))
    actual = ModuleGraph(Calls(cases, inputs, train=False))(*(x for xs in inputs for x in xs))
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert_close(a, e)


def check_gradients(cases: list[Case]) -> None:
    inputs = _inputs(cases)
    eager = Calls(cases, inputs, train=True)
    outputs = Calls(cases, inputs, train=False)(*(x for xs in inputs for x in xs))
    weights = [torch.randn_like(o) for o in outputs]
    eager(*weights).backward()
    model = Calls(cases, inputs, train=True)
    SGDStep(model)(*weights)
    names = [f"{case[0]} input {i}" for case, xs in zip(cases, inputs) for i in range(len(xs))]
    for name, before, after, expected in zip(names, eager.params, model.params, eager.params):
        delta = before.detach() - after.detach()
        torch.testing.assert_close(delta, expected.grad, **GRAD_TOLERANCE, msg=lambda m: f"{name}: {m}")


GROUPS = {"conv": CONV_CASES, "float64": FLOAT64_CASES, "pool": POOL_CASES, "resample": RESAMPLE_CASES, "loss": LOSS_CASES}


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS.values(), ids=GROUPS.keys())
def test_forward_matches_eager(group: list[Case]) -> None:
    """Each op's outputs (values and int64 indices) are eager's, within the float32 tolerance."""
    check_forward(group)


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS.values(), ids=GROUPS.keys())
def test_gradients_match_autograd(group: list[Case]) -> None:
    """One SGD step (lr=1) moves every input and weight by torch.autograd's gradient."""
    check_gradients(group)


def test_adaptive_max_pool_indices() -> None:
    """return_indices gives torch's int64 indices: each window's first maximum, flat in the
    plane, windows of unequal sizes included."""
    torch.manual_seed(0)
    x2, x3 = torch.randn(2, 3, 7, 9), torch.randint(0, 4, (1, 2, 5, 4, 6)).float()  # x3 has ties
    fn = lambda a, b: (*F.adaptive_max_pool2d(a, (3, 4), return_indices=True),  # noqa: E731
                       *F.adaptive_max_pool3d(b, (2, 3, 4), return_indices=True))
    for actual, expected in zip(ModuleGraph(Calls([("", fn, ())], [[x2, x3]], False))(x2, x3), fn(x2, x3)):
        assert_close(actual, expected)


class _Pooled(nn.Module):
    def __init__(self, x: torch.Tensor, fn: Callable):
        super().__init__()
        self.x, self.fn = nn.Parameter(x.clone()), fn

    def forward(self, weights: torch.Tensor) -> torch.Tensor:
        return (self.fn(self.x) * weights).sum()


@pytest.mark.parametrize("fn, x", [
    (lambda x: F.adaptive_max_pool1d(x, 4), torch.randint(0, 2, (2, 3, 9)).float()),
    (lambda x: F.adaptive_max_pool2d(x, (3, 4)), torch.randint(0, 2, (2, 3, 7, 9)).float()),
    (lambda x: F.adaptive_max_pool2d(torch.relu(x), (3, 5)), torch.randn(2, 3, 7, 8)),
    (lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), torch.randint(0, 2, (1, 2, 5, 7, 3)).float()),
], ids=["1d-ties", "2d-ties", "2d-after-relu", "3d-ties"])
def test_adaptive_max_pool_gives_a_window_s_gradient_to_its_first_maximum(fn: Callable, x: torch.Tensor) -> None:
    """Windows that do not tile the plane, holding ties (zeros and ones, a ReLU's zeros): torch
    gives each window's gradient to its first maximum in row-major order; a `max` over the
    window shared it between the tied elements."""
    weights = torch.randn_like(fn(x))
    leaf = x.clone().requires_grad_()
    (fn(leaf) * weights).sum().backward()
    model = _Pooled(x, fn)
    SGDStep(model)(weights)
    assert_close(x - model.x.detach(), leaf.grad, atol=1e-6, rtol=1e-6)


def test_adaptive_max_pool_of_a_window_holding_nan_is_nan() -> None:
    x = torch.randn(1, 2, 5, 7)
    x[0, 0, 1, 2] = x[0, 0, 1, 4] = x[0, 1, 3, 0] = float("nan")
    fn = lambda t: F.adaptive_max_pool2d(t, (2, 3), return_indices=True)  # noqa: E731
    for actual, expected in zip(ModuleGraph(_Fn(fn))(x), fn(x)):
        assert_close(actual, expected, equal_nan=True)


class _Fn(nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.mark.parametrize("make", [
    lambda: nn.InstanceNorm2d(3, affine=True),
    lambda: nn.BatchNorm2d(3, momentum=None),
    lambda: nn.BatchNorm2d(3, track_running_stats=False),
], ids=["instance_norm", "batch_norm_cumulative", "batch_norm_no_running_stats"])
def test_float64_norms_written_as_instance_norm_train_like_eager(make) -> None:
    """In a model.double(): TVM's instance_norm kernel takes float32 and float16 only (the
    importer writes these norms as one), and such graphs failed to compile; computed in float64
    now (legalize_fixes.py). Inference, then three SGD steps with the running statistics."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), make(), nn.ReLU(), nn.Flatten(), nn.Linear(27, 2)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    frozen = copy.deepcopy(model).eval()
    assert_close(ModuleGraph(frozen)(x), frozen(x).detach())
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert_steps_match_eager(graph, model, reference, nn.MSELoss(), x, y, steps=3)
    for (name, buffer), (_, expected) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(buffer, expected) if not buffer.is_floating_point() else torch.allclose(buffer, expected), name


def test_norms_without_running_statistics_of_data_with_a_large_mean_match_eager() -> None:
    """float32 InstanceNorm, F.instance_norm and F.batch_norm without running statistics (all
    lowered as an instance norm) on x * 0.1 + 300: TVM's one-pass variance, E[x^2] - E[x]^2,
    cancelled (half of eager's values, 768 NaNs; found by a sweep). Two passes now; what is
    left is float32's rounding of a mean 3000 standard deviations from 0."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, 64) * 0.1 + 300.0
    image = torch.randn(8, 4, 6, 6) + 100.0
    norm = nn.InstanceNorm2d(4)

    def norms(x, image):
        return norm(image), F.instance_norm(x), F.batch_norm(x, None, None, training=True)

    for got, expected in zip(ModuleGraph(Fn(norms))(x, image), norms(x.double(), image.double()), strict=True):
        assert_close(got, expected.float(), atol=2e-3, rtol=0)


def test_batch_norm_with_update() -> None:
    """aten._batch_norm_with_update: eager's output and saved statistics, and the running
    statistics updated in place as eager updates them."""
    x = torch.randn(4, 3, 5)
    stats = [torch.rand(3), torch.rand(3) + 0.5]
    eager_stats = [s.clone() for s in stats]
    weight, bias = torch.randn(3), torch.randn(3)

    class BatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", stats[0])
            self.register_buffer("var", stats[1])

        def forward(self, x):
            return torch.ops.aten._batch_norm_with_update(x, weight, bias, self.mean, self.var, 0.3, 1e-4)[:3]

    expected = torch.ops.aten._batch_norm_with_update(x, weight, bias, *eager_stats, 0.3, 1e-4)[:3]
    module = BatchNorm()
    for actual, want in zip(ModuleGraph(module)(x), expected):
        assert_close(actual, want)
    assert_close(module.mean, eager_stats[0])
    assert_close(module.var, eager_stats[1])


# ---- the Relax gradients, float64 and central differences ----

RELAX_CASES = [
    OpCase("conv3d", lambda x, w: op.nn.conv3d(x, w, (2, 1, 2), (1, 0, 1), (1, 2, 1), 2),
           lambda x, w: F.conv3d(x, w, None, (2, 1, 2), (1, 0, 1), (1, 2, 1), 2), normal((1, 4, 5, 4, 5), (4, 2, 3, 2, 2))),
    OpCase("conv2d_transpose", lambda x, w: op.nn.conv2d_transpose(x, w, 2, 1, (1, 0), 2, 2),
           lambda x, w: F.conv_transpose2d(x, w, None, 2, 1, (1, 0), 2, 2), normal((2, 4, 5, 4), (4, 3, 3, 2))),
    OpCase("conv1d_transpose", lambda x, w: op.nn.conv1d_transpose(x, w, 3, 1, 2, 1, 3),
           lambda x, w: F.conv_transpose1d(x, w, None, 3, 1, 2, 3, 1), normal((2, 3, 5), (3, 2, 3))),
    OpCase("conv3d_transpose", lambda x, w: op.nn.conv3d_transpose(x, w, (2, 1, 1), (1, 0, 0), (1, 0, 0), 1, 2),
           lambda x, w: F.conv_transpose3d(x, w, None, (2, 1, 1), (1, 0, 0), (1, 0, 0), 2, 1),
           normal((1, 4, 3, 2, 3), (4, 1, 3, 2, 2))),
    OpCase("avg_pool3d-exclude-pad", lambda x: op.nn.avg_pool3d(x, (3, 2, 3), (2, 1, 2), (1, 0, 1), count_include_pad=False),
           lambda x: F.avg_pool3d(x, (3, 2, 3), (2, 1, 2), (1, 0, 1), count_include_pad=False), normal((1, 2, 5, 4, 7))),
    OpCase("max_pool3d", lambda x: op.nn.max_pool3d(x, (3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 1, 2)),
           lambda x: F.max_pool3d(x, (3, 2, 3), (2, 1, 2), (1, 0, 1), (1, 1, 2)), spaced((1, 2, 5, 4, 8))),
    OpCase("adaptive_avg_pool3d", lambda x: op.nn.adaptive_avg_pool3d(x, (2, 3, 4)),
           lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)), normal((1, 2, 5, 4, 7))),
]


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.id == "max_pool3d" else []) for c in RELAX_CASES
])
def test_relax_gradient(case: OpCase) -> None:
    """The registered Relax gradient equals torch.autograd (float32, float64) and central
    differences (float64)."""
    check_op(case)


def test_max_pool3d_gradient_picks_first_maximum() -> None:
    """With ties in a window, the whole gradient goes to its first maximum (as torch's
    indices say), not shared among the ties."""
    x = np.zeros((1, 1, 2, 2, 2))
    case = OpCase("max_pool3d-all-ties", lambda x: op.nn.max_pool3d(x, 2), lambda x: F.max_pool3d(x, 2),
                  lambda rng: [x], fd=False)
    check_op(case)


@pytest.mark.parametrize("dilation, conv", [(4, "conv1d"), ((2, 3), "conv2d"), (1, "conv1d_transpose")])
def test_a_dilated_conv_input_gradient_multiplies_the_taps_only(dilation, conv: str) -> None:
    """A stride-1 dilated conv's dx is a conv of dy with the flipped kernel (a conv1d's a conv1d):
    TOPI's transposed conv would multiply the zeros it inserts between the taps (k = 3, d = 4:
    3x the work). Without dilation dx stays the transposed conv."""
    from tests.numeric.grad_check import vjp_module

    rng = np.random.default_rng(0)
    if conv == "conv1d_transpose":  # dilation 1: the transposed conv, as before
        conv, dilation = "conv1d", 1
    one_d = conv == "conv1d"
    x = rng.standard_normal((2, 4, 20) if one_d else (2, 4, 9, 11)).astype("float32")
    w = rng.standard_normal((6, 2, 3) if one_d else (6, 2, 3, 2)).astype("float32")
    fn = ((lambda a, b: op.nn.conv1d(a, b, 1, 4, dilation, 2)) if one_d
          else (lambda a, b: op.nn.conv2d(a, b, 1, (2, 1), dilation, 2)))
    out_shape = (F.conv1d(torch.from_numpy(x), torch.from_numpy(w), None, 1, 4, dilation, 2) if one_d
                 else F.conv2d(torch.from_numpy(x), torch.from_numpy(w), None, 1, (2, 1), dilation, 2)).shape
    text = vjp_module(fn, [x, w], [0, 1], out_shape)["main_adjoint"].script()
    if dilation == 1:
        assert "conv2d_transpose" in text
    else:
        assert "conv2d_transpose" not in text and "R.flip" in text
        assert ("R.nn.conv1d(" if one_d else "R.nn.conv2d(") in text.split("R.flip", 1)[1]


def test_adaptive_max_pool_of_a_window_of_minus_infinity_is_minus_infinity() -> None:
    """TVM's argmax gives -1 for an all -inf window, and the gather then read outside it."""
    x = torch.randn(1, 1, 5, 7)
    x[0, 0, :3, :3] = float("-inf")
    fn = lambda t: F.adaptive_max_pool2d(t, (2, 3))  # noqa: E731
    assert torch.equal(ModuleGraph(_Fn(fn))(x), fn(x))

"""Property-based fuzzing against eager: random small models, shapes, dtypes and input layouts.

`hypothesis` composes a model from the layers below (linear, activations, norms, residual
blocks, a layer called twice, softmax, reductions...), then checks the graph against eager
PyTorch: inference outputs in eval mode, and parameters after a few SGD-momentum or Adam steps in
train mode. CI runs a fixed (derandomized) set of `TVMGRAPH_TEST_FUZZ_EXAMPLES` examples
(default 6) without shrinking; set it higher to search more (random, with shrinking).

Every failure it finds becomes a named regression test at the end of this file.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import tvmgraph

EXAMPLES = int(os.environ.get("TVMGRAPH_TEST_FUZZ_EXAMPLES", "6"))
SEARCHING = "TVMGRAPH_TEST_FUZZ_EXAMPLES" in os.environ
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-3), torch.float64: dict(atol=1e-9, rtol=1e-7)}
ACTIVATIONS = {
    "relu": nn.ReLU, "relu6": nn.ReLU6, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "silu": nn.SiLU, "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "elu": nn.ELU, "softplus": nn.Softplus, "hardswish": nn.Hardswish,
}


class Residual(nn.Module):
    """x + f(x): pre-norm transformer blocks, ResNets."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


class Twice(nn.Module):
    """One layer called twice: its parameter gets two gradient contributions."""

    def __init__(self, width: int):
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


class Lambda(nn.Module):
    def __init__(self, fn, name: str):
        super().__init__()
        self.fn = fn
        self.name = name

    def forward(self, x):
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


FUNCTIONS = {
    "scale": lambda x: x * 0.5 + 0.25,
    "square": lambda x: x * x,
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "log_softmax": lambda x: torch.log_softmax(x, dim=-1),
    "center": lambda x: x - x.mean(dim=-1, keepdim=True),
    "transpose_twice": lambda x: x.t().contiguous().t(),
    "clamp": lambda x: x.clamp(-1.0, 1.0),
}


def make_layer(spec: tuple, width: int) -> tuple[nn.Module, int]:
    """The module for one layer spec and the feature width after it."""
    kind = spec[0]
    if kind == "linear":
        return nn.Linear(width, spec[1], bias=spec[2]), spec[1]
    if kind == "act":
        return ACTIVATIONS[spec[1]](), width
    if kind == "layernorm":
        return nn.LayerNorm(width), width
    if kind == "batchnorm":
        return nn.BatchNorm1d(width), width
    if kind == "residual":
        return Residual(nn.Sequential(nn.Linear(width, width), ACTIVATIONS[spec[1]]())), width
    if kind == "twice":
        return Twice(width), width
    return Lambda(FUNCTIONS[kind], kind), width


@dataclass
class Case:
    """One fuzzed example: the model's layers and how it is called."""

    layers: list[tuple]
    batch: int
    width: int
    classes: int
    dtype: torch.dtype
    layout: str
    optimizer: str

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        modules, width = [], self.width
        for spec in self.layers:
            module, width = make_layer(spec, width)
            modules.append(module)
        modules.append(nn.Linear(width, self.classes))
        return nn.Sequential(*modules).to(self.dtype)

    def inputs(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(self.batch, self.width, generator=g, dtype=self.dtype)
        y = torch.randint(0, self.classes, (self.batch,), generator=g)
        return with_layout(x, self.layout), with_layout(y, self.layout)


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in another memory layout: what users pass without thinking about it."""
    if layout == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    if layout == "offset":  # a contiguous view one element into a bigger buffer: misaligned
        buffer = torch.zeros(t.numel() + 1, dtype=t.dtype)
        buffer[1:] = t.reshape(-1)
        return buffer[1:].view(t.shape)
    return t


layer_specs = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("act"), st.sampled_from(sorted(ACTIVATIONS))),
    st.tuples(st.just("layernorm")),
    st.tuples(st.just("batchnorm")),
    st.tuples(st.just("residual"), st.sampled_from(["relu", "gelu", "tanh"])),
    st.tuples(st.just("twice")),
    st.tuples(st.sampled_from(sorted(FUNCTIONS))),
)
cases = st.builds(
    Case,
    layers=st.lists(layer_specs, min_size=1, max_size=5),
    batch=st.integers(2, 6),
    width=st.integers(2, 12),  # a norm over one feature is degenerate (its output is its bias)
    classes=st.integers(2, 5),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    layout=st.sampled_from(["contiguous", "transposed", "offset"]),
    optimizer=st.sampled_from(["sgd", "adam"]),
)


class Infer(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


class Train(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def optimizer_for(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    if case.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def check_case(case: Case, steps: int = 3) -> None:
    """Inference (eval mode) and `steps` training steps (train mode) of the graph vs eager."""
    tol = TOLERANCE[case.dtype]
    eager = case.model().eval()
    graph_model = copy.deepcopy(eager)
    x, _ = case.inputs(1)
    with torch.no_grad():
        expected = eager(x)
    torch.testing.assert_close(Infer(graph_model)(x), expected, **tol, msg=lambda m: f"inference: {m}\n{case}")

    eager.train()
    graph_model.train()
    eager_opt = optimizer_for(case, eager)
    graph = Train(graph_model, optimizer_for(case, graph_model))
    for step in range(steps):
        x, y = case.inputs(10 + step)
        eager_opt.zero_grad()
        eager_loss = nn.functional.cross_entropy(eager(x), y)
        eager_loss.backward()
        eager_opt.step()
        loss = graph(x, y)
        torch.testing.assert_close(loss, eager_loss.detach(), **tol, msg=lambda m: f"loss, step {step}: {m}\n{case}")
    for (name, got), want in zip(graph_model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), **tol,
                                   msg=lambda m: f"parameter {name} after {steps} steps: {m}\n{case}")
    for (name, got), want in zip(graph_model.named_buffers(), eager.buffers()):
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"buffer {name}: {m}\n{case}")


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not SEARCHING,
          phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if SEARCHING else [])],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases)
def test_random_models_match_eager(case: Case) -> None:
    """A random model: the graph's outputs and its training steps equal eager's."""
    check_case(case)


# ---- regressions the fuzzer found, each fixed and pinned by name ----

def regression(layers: list[tuple], **overrides) -> Case:
    fields = dict(batch=4, width=6, classes=3, dtype=torch.float32, layout="contiguous", optimizer="sgd")
    return Case(layers=layers, **{**fields, **overrides})


def test_two_residual_layers_in_a_row() -> None:
    """FuseEpilogue left an undefined variable (`Var lv36 is not defined`) for x + a(x) + b(x')."""
    check_case(regression([("residual", "relu"), ("residual", "gelu")]))


def test_layer_called_twice_accumulates_both_gradients() -> None:
    """One Linear used twice in build: its update must sum both contributions, like eager."""
    check_case(regression([("twice",)]))


def test_float64_layer_norm() -> None:
    """TVM legalizes layer_norm for float32/float16 only: float64 failed in LegalizeOps."""
    check_case(regression([("layernorm",), ("act", "gelu")], dtype=torch.float64))


def test_misaligned_int64_labels_and_inputs() -> None:
    """Contiguous views one element into a bigger tensor (labels y[i:i+64]) crashed the process."""
    check_case(regression([("linear", 5, True), ("act", "relu")], layout="offset"))

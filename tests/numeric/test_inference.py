"""Inference through tvmgraph.nn.Graph matches torch eager, model by model (CPU, LLVM)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import tvmgraph
from tests.conftest import ModuleGraph, assert_close
from tests.models import EncoderBlock, SmallCNN, SoftmaxAttention, mlp


def run_both(model: nn.Module, *args: torch.Tensor) -> tuple[object, object]:
    graph = ModuleGraph(model)
    out = graph(*args)
    with torch.no_grad():
        expected = model(*args)
    return out, expected


class ModuleMyLinear(nn.Module):
    """Seed 000's eager module: matmul plus bias, parameters made by hand."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features))
        self.bias = nn.Parameter(torch.randn(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) + self.bias


def test_seed_linear_module() -> None:
    """Seed 000's GraphMyLinear: the graph returns what the eager module returns."""
    out, expected = run_both(ModuleMyLinear(4, 3), torch.randn(1, 4))
    assert_close(out, expected)


def test_linear_without_bias() -> None:
    """Seed 002's LinearGraph: nn.Linear(3, 8, False) on a (4, 3) input."""
    out, expected = run_both(nn.Linear(3, 8, bias=False), torch.randn(4, 3))
    assert_close(out, expected)


def test_mlp() -> None:
    out, expected = run_both(mlp((784, 128, 64, 10)).eval(), torch.randn(16, 784))
    assert_close(out, expected)


def test_cnn_eval() -> None:
    """Conv (stride 1/2), depthwise conv, BatchNorm (eval), ReLU6, max/avg/adaptive pools, flatten."""
    model = SmallCNN(dropout=0.2).eval()
    for m in model.modules():  # non-trivial running statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    out, expected = run_both(model, torch.randn(4, 3, 16, 16))
    assert_close(out, expected)


@pytest.mark.parametrize("approximate", ["none", "tanh"], ids=["gelu", "gelu_tanh"])
def test_transformer_block_eval(approximate: str) -> None:
    """LayerNorm, nn.MultiheadAttention, GELU, residual adds."""
    out, expected = run_both(EncoderBlock(approximate=approximate).eval(), torch.randn(2, 8, 32))
    assert_close(out, expected)


def test_softmax_attention() -> None:
    out, expected = run_both(SoftmaxAttention(), torch.randn(2, 5, 16))
    assert_close(out, expected)


def test_embedding_with_int64_input() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(40, 3))
    out, expected = run_both(model, torch.randint(0, 50, (6, 5)))
    assert_close(out, expected)


class StructuredGraph(tvmgraph.nn.Graph):
    """Inputs and outputs that are lists, tuples and None (seed 002's accepted types)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def build(self, x, pair, nothing):
        a, b = pair
        assert nothing is None
        return [self.linear(x), None, (a * b, self.linear(a + b))]


def test_list_tuple_and_none_inputs_and_outputs() -> None:
    graph = StructuredGraph()
    x, a, b = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    out = graph(x, [a, b], None)
    with torch.no_grad():
        expected = graph.build(x, [a, b], None)  # eager: the same code on the same modules
    assert isinstance(out, list) and len(out) == 3 and out[1] is None and isinstance(out[2], tuple)
    assert_close(out[0], expected[0])
    assert_close(out[2][0], expected[2][0])
    assert_close(out[2][1], expected[2][1])


def test_output_may_be_an_input() -> None:
    class Passthrough(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def build(self, x, y):
            return self.linear(x), y

    y = torch.randn(3)
    _, y_out = Passthrough()(torch.randn(1, 2), y)
    assert torch.equal(y_out, y)


def test_same_signature_compiles_once() -> None:
    graph = ModuleGraph(mlp())
    for _ in range(3):
        graph(torch.randn(4, 32))
    assert graph.num_compiled == 1


def test_new_batch_size_compiles_new_entry_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp().eval()
    graph = ModuleGraph(model)
    small, big = torch.randn(4, 32), torch.randn(9, 32)
    assert_close(graph(small), model(small).detach())
    with caplog.at_level(logging.WARNING, logger="tvmgraph"):
        graph(torch.randn(7, 32))
    # quiet by default: a recompile is INFO, not a warning
    assert not [r for r in caplog.records if r.name.startswith("tvmgraph")]
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(big)
    assert_close(out, model(big).detach())
    assert graph.num_compiled == 3
    assert f"(GRAPH:{graph.name}:ModuleGraph) recompiling (program #3): guard failed:" in caplog.text
    assert "argument 'args[0]' was float32[7, 32] on cpu, now float32[9, 32] on cpu" in caplog.text
    # The entries stay cached: going back does not compile again.
    graph(small)
    assert graph.num_compiled == 3


def test_dtype_change_compiles_new_entry() -> None:
    model = nn.Linear(3, 2).double()
    graph = ModuleGraph(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    assert_close(graph(x), model(x).detach())
    model.float()
    assert_close(graph(x.float()), model(x.float()).detach())
    assert graph.num_compiled == 2


def test_train_mode_recompiles_and_updates_batchnorm_stats_like_eager() -> None:
    """BatchNorm in train mode: batch statistics, running stats and num_batches_tracked updated."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU6())
    reference = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU6())
    reference.load_state_dict(model.state_dict())
    graph = ModuleGraph(model.eval())
    x = torch.randn(5, 3, 8, 8)
    graph(x)
    model.train()
    reference.train()
    for _ in range(2):
        out = graph(x)
        with torch.no_grad():
            expected = reference(x)
        assert_close(out, expected)
    assert graph.num_compiled == 2
    assert_close(model[1].running_mean, reference[1].running_mean)
    assert_close(model[1].running_var, reference[1].running_var)
    assert model[1].num_batches_tracked.item() == reference[1].num_batches_tracked.item() == 2


def test_in_place_parameter_change_is_seen_without_recompiling() -> None:
    model = nn.Linear(3, 2)
    graph = ModuleGraph(model)
    x = torch.randn(4, 3)
    graph(x)
    with torch.no_grad():
        model.weight.mul_(2.0)
        model.bias.add_(1.0)
    assert_close(graph(x), model(x).detach())
    model.weight = nn.Parameter(torch.randn(2, 3))  # a new Parameter object, same shape
    assert_close(graph(x), model(x).detach())
    assert graph.num_compiled == 1


def test_outputs_of_earlier_calls_are_not_overwritten() -> None:
    graph = ModuleGraph(mlp())
    first_in, second_in = torch.randn(4, 32), torch.randn(4, 32)
    first = graph(first_in)
    kept = first.clone()
    graph(second_in)
    assert torch.equal(first, kept)


def test_non_contiguous_input() -> None:
    model = nn.Linear(4, 3)
    x = torch.randn(4, 5).t()[:4]
    assert not x.is_contiguous()
    out, expected = run_both(model, x)
    assert_close(out, expected)

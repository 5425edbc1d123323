"""Activation checkpointing per module (`graph.<module>.to(tvmgraph.nn.GraphModule)`): training
with recomputation equals eager training step for step, and really recomputes (CPU, LLVM)."""

from __future__ import annotations

import copy
import functools
import logging
import pickle

import pytest
import torch
from torch import nn

import tvmgraph
from relay_passes.straighten import BlockModel
from tests.conftest import TrainGraph
from tests.models import EncoderBlock, SmallCNN, mlp
from tests.numeric.test_training import assert_same_state, classification_batches, eager_step
from tvmgraph.errors import ConfigError

STEP_TOL = dict(atol=2e-5, rtol=1e-4)


def options_of(graph: tvmgraph.nn.Graph, path: str) -> tvmgraph.nn.GraphModule:
    """`graph.model.layer1.to(GraphModule)` for `path` "model.layer1"."""
    return functools.reduce(getattr, path.split("."), graph).to(tvmgraph.nn.GraphModule)


def checkpointed_graph(model: nn.Module, loss_fn: nn.Module, optimizer: torch.optim.Optimizer,
                       paths: list[str]) -> TrainGraph:
    graph = TrainGraph(model, loss_fn, optimizer)
    for path in paths:
        options_of(graph, path).activation_checkpointing = True
    return graph


def recomputed(graph: tvmgraph.nn.Graph) -> list[str]:
    """Bindings the backward pass recomputes (relax.transform.Gradient names them `*_cp`)."""
    train_step = graph.lowered.mod["train_step"]
    return [b.var.name for block in train_step.body.blocks for b in block.bindings if b.var.name.endswith("_cp")]


def train_against_eager(model: nn.Module, paths: list[str], loss_fn: nn.Module, batches, steps: int,
                        make_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        debug: bool = False):
    """Train `model` in a graph with `paths` checkpointed and a copy eagerly; compare every step
    (`debug`: the graph reports its passes, graph.debug(1))."""
    reference = copy.deepcopy(model)
    ref_optimizer = make_optimizer(reference)
    graph = checkpointed_graph(model, loss_fn, make_optimizer(model), paths)
    if debug:
        graph.debug(1)
    for step in range(steps):
        x, y = batches[step % len(batches)]
        loss = graph(x, y)
        ref_loss = eager_step(reference, loss_fn, [ref_optimizer], x, y)
        torch.testing.assert_close(loss, ref_loss, **STEP_TOL, msg=lambda m: f"step {step} loss: {m}")
        assert_same_state(model, reference)
    return graph


def test_checkpointed_mlp_matches_eager() -> None:
    """The whole MLP checkpointed: the backward pass recomputes the hidden ReLUs. (A Linear
    alone has nothing to recompute: its gradients need only its input, which is kept.)"""
    batches = classification_batches(3, (32,), 10)
    graph = train_against_eager(mlp(), ["model"], nn.CrossEntropyLoss(), batches, 3)
    assert graph.num_compiled == 1 and recomputed(graph)


def test_module_called_twice_is_recomputed_per_call() -> None:
    """One Linear+ReLU block applied twice in forward: both calls are marked, gradients add up."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
            self.head = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.block(self.block(x)))

    batches = classification_batches(2, (16,), 4)
    graph = train_against_eager(Twice(), ["model.block"], nn.CrossEntropyLoss(), batches, 2)
    assert len(recomputed(graph)) >= 2


@pytest.mark.slow
def test_cnn_with_batch_norm_updates_running_stats_once_per_step() -> None:
    """Checkpointed conv/batch-norm features: parameters, running statistics and the batch
    counter equal eager's after every step (the recomputation does not update them again)."""
    batches = classification_batches(2, (3, 12, 12), 10)
    graph = train_against_eager(SmallCNN().train(), ["model.features"], nn.CrossEntropyLoss(), batches, 3)
    assert graph.model.features[1].num_batches_tracked.item() == 3
    assert recomputed(graph)


@pytest.mark.slow
def test_recomputed_dropout_reuses_the_forward_mask() -> None:
    """Dropout inside a checkpointed module: with the same seeds, training with and without
    checkpointing takes the same steps (a fresh mask in the recomputation would change the
    gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10)).train()
    plain_model = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss()
    graph = checkpointed_graph(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), ["model"])
    plain = TrainGraph(plain_model, loss_fn, torch.optim.SGD(plain_model.parameters(), lr=0.1))
    for step, (x, y) in enumerate(classification_batches(3, (32,), 10)):
        torch.manual_seed(step)
        loss = graph(x, y)
        torch.manual_seed(step)
        torch.testing.assert_close(loss, plain(x, y), **STEP_TOL)
        assert_same_state(model, plain_model)
    assert recomputed(graph)


def _transformer() -> nn.Module:
    return nn.Sequential(EncoderBlock(d_model=32), EncoderBlock(d_model=32)).train()


@pytest.mark.slow
def test_transformer_with_checkpointed_layers_matches_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Also with RecomputeLateReads acting (at 16 positions; at 6 the step's peak is not where
    a recomputed value waits): values the backward pass reads late are recomputed a second
    time (docs/passes.md)."""
    batches = [(torch.randn(4, 16, 32), torch.randn(4, 16, 32)) for _ in range(2)]
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        graph = train_against_eager(_transformer(), ["model.0", "model.1"], nn.MSELoss(), batches, 3,
                                    debug=True)
    assert recomputed(graph)
    assert "RecomputeLateReads: checkpointed value recomputed where read late" in caplog.text


def _peak_live_bytes(graph: tvmgraph.nn.Graph) -> int:
    """Peak bytes of live tensors of the lowered train step, its bindings in program order."""
    (block,) = graph.lowered.mod["train_step"].body.blocks
    model = BlockModel(list(block.bindings))
    return model.peak(list(range(model.n)))


@pytest.mark.slow
def test_checkpointed_transformer_layers_plan_less_memory() -> None:
    """Checkpointing both layers keeps their inputs instead of every intermediate result: the
    train step's peak of live tensors drops by more than 30% (batch 4, seq 32, d_model 32)."""
    x, y = torch.randn(4, 32, 32), torch.randn(4, 32, 32)
    peaks = {}
    for paths in ([], ["model.0", "model.1"]):
        model = _transformer()
        graph = checkpointed_graph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.01), paths)
        graph(x, y)
        peaks[bool(paths)] = _peak_live_bytes(graph)
    assert peaks[True] < 0.7 * peaks[False], peaks


@pytest.mark.slow
def test_flag_reads_back_and_a_change_recompiles(caplog: pytest.LogCaptureFixture) -> None:
    model = mlp()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05))
    options = graph.model.to(tvmgraph.nn.GraphModule)
    assert options.activation_checkpointing is False and options.name == "model"
    (x, y), = classification_batches(1, (32,), 10)
    graph(x, y)
    options.activation_checkpointing = True
    assert graph.model.to(tvmgraph.nn.GraphModule).activation_checkpointing is True
    assert graph.model[0].to(tvmgraph.nn.GraphModule).activation_checkpointing is False
    assert graph.config.activation_checkpointing == ("model",)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        graph(x, y)
    assert graph.num_compiled == 2 and recomputed(graph)
    assert "activation_checkpointing () -> ('model',)" in caplog.text
    options.activation_checkpointing = False
    graph(x, y)
    assert graph.num_compiled == 2 and not recomputed(graph)  # the first program again


def test_unknown_and_read_only_options_raise() -> None:
    graph = TrainGraph(mlp(), nn.CrossEntropyLoss(), torch.optim.SGD(mlp().parameters(), lr=0.05))
    options = graph.model.to(tvmgraph.nn.GraphModule)
    with pytest.raises(ConfigError, match=r"GraphModule.stage_id of 'model' is read-only.*set_stage\(stage_id"):
        options.stage_id = 1
    assert options.stage_id is None and options.stage_placement is None
    with pytest.raises(AttributeError, match=r"no option 'activation_checkpoint'.*activation_checkpointing"):
        options.activation_checkpoint = True
    with pytest.raises(ConfigError, match=r"model.to\(GraphModule\).activation_checkpointing takes True or False"):
        options.activation_checkpointing = 1
    assert graph.config.activation_checkpointing == ()


def test_graph_attribute_is_the_module_for_torch_code() -> None:
    """`graph.model` is a proxy (OneFlow's ProxyModule) that torch code can use as the module."""
    model = mlp()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05))
    assert isinstance(graph.model, nn.Sequential) and isinstance(graph.model[0], nn.Linear)
    assert graph.model.to(nn.Module) is model and graph.model[0].to(nn.Module) is model[0]
    assert len(graph.model) == len(model) and [m.to(nn.Module) for m in graph.model] == list(model)
    assert list(graph.model.parameters()) == list(model.parameters())
    graph.model[0].weight.data.zero_()
    assert model[0].weight.abs().sum() == 0
    x = torch.randn(2, 32)
    torch.testing.assert_close(graph.model(x), model(x))
    assert type(copy.deepcopy(graph.model)) is nn.Sequential
    assert type(pickle.loads(pickle.dumps(graph.model))) is nn.Sequential
    other = TrainGraph(graph.model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05))
    assert other.named_modules()[0][1] is model  # another graph registers the module, not the proxy


def test_an_inference_graph_ignores_the_flag_without_recompiling() -> None:
    """Checkpointing recomputes activations for a backward pass; an inference graph has none,
    so switching it on keeps the compiled program."""
    from tests.conftest import ModuleGraph

    model = mlp().eval()
    graph = ModuleGraph(model)
    x = torch.randn(4, 32)
    expected = graph(x)
    graph.model.to(tvmgraph.nn.GraphModule).activation_checkpointing = True
    assert graph.model.to(tvmgraph.nn.GraphModule).activation_checkpointing is True
    torch.testing.assert_close(graph(x), expected)
    assert graph.num_compiled == 1

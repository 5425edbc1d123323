"""Dynamic batch (config.enable_dynamic_batch()): one compiled program runs every batch size,
with the numbers of eager torch (docs/training.md, "Dynamic batch")."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import ModuleGraph, TrainGraph, assert_close
from tests.models import EncoderBlock, SmallCNN, mlp
from tests.numeric.test_training import STEP_TOL, assert_same_state, eager_step
from tvmgraph.errors import GraphArgumentError, TraceError

BATCHES = (1, 7, 64, 300)


def dynamic(graph):
    graph.config.enable_dynamic_batch()
    return graph


@pytest.mark.parametrize("make, shape", [
    (mlp, (32,)),
    pytest.param(lambda: SmallCNN().eval(), (3, 12, 12), marks=pytest.mark.slow),
    pytest.param(lambda: EncoderBlock().eval(), (10, 32), marks=pytest.mark.slow),
], ids=["mlp", "cnn", "transformer"])
def test_inference_every_batch_size_one_compile(make, shape) -> None:
    torch.manual_seed(0)
    model = make()
    graph = dynamic(ModuleGraph(model))
    for batch in BATCHES:
        x = torch.randn(batch, *shape)
        with torch.no_grad():
            expected = model(x)
        assert_close(graph(x), expected, atol=1e-5, rtol=1e-4)
    assert graph.num_compiled == 1


def run_dynamic_side_by_side(model, batches, lr=0.05):
    """Train `model` in a dynamic-batch graph and a copy eagerly on `batches`; compare every step."""
    reference = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)  # noqa: E731
    optimizer, ref_optimizer = make(model), make(reference)
    graph = dynamic(TrainGraph(model, nn.CrossEntropyLoss(), optimizer))
    for step, (x, y) in enumerate(batches):
        loss = graph(x, y)
        ref_loss = eager_step(reference, nn.CrossEntropyLoss(), [ref_optimizer], x, y)
        torch.testing.assert_close(loss, ref_loss, **STEP_TOL, msg=lambda m: f"step {step} (batch {len(x)}): {m}")
        assert_same_state(model, reference)
    return graph


def batches_of(sizes, shape, classes=10):
    return [(torch.randn(n, *shape), torch.randint(0, classes, (n,))) for n in sizes]


def test_training_mlp_varying_batch_matches_eager() -> None:
    torch.manual_seed(0)
    graph = run_dynamic_side_by_side(mlp(), batches_of((8, 3, 64, 1, 300, 8), (32,)))
    assert graph.num_compiled == 1 and graph.step == 6


@pytest.mark.slow
def test_training_cnn_batch_norm_varying_batch_matches_eager() -> None:
    """Batch-norm statistics (batch mean/variance, running stats) over a symbolic batch."""
    torch.manual_seed(0)
    model = SmallCNN().train()
    graph = run_dynamic_side_by_side(model, batches_of((8, 5, 16), (3, 12, 12)))
    assert graph.num_compiled == 1
    assert model.features[1].num_batches_tracked.item() == 3

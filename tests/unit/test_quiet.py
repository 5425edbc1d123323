"""A compile prints nothing at default verbosity: TVM's C++ warnings ("Unknown pragma
pragma_scope" in a cross-entropy training step, "Fast mode segfaults..." for embeddings,
"BlockBuilder destroyed with remaining blocks!" after a failed import) go to the debug log
(tvmgraph/native_output.py) or no longer happen (converters.py).
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from torch import nn

from tests.conftest import ModuleGraph, TrainGraph
from tvmgraph import artifact
from tvmgraph.errors import UnsupportedOpError


@pytest.fixture(autouse=True)
def _always_compile(monkeypatch):
    # A compiled-cache hit would skip code generation, and with it what this file checks.
    monkeypatch.setattr(artifact, "compiled_cache", lambda: None)


class PickTwoPerRow(nn.Module):
    """A loss that gathers two outputs per row: its gradient scatters (cross-entropy's single
    pick per row is a select, tvmgraph/gradients/index.py)."""

    def forward(self, out, picks):
        return out.gather(1, picks).sum()


def test_scatter_training_compile_prints_nothing(capfd, caplog):
    """Code generation's "Unknown pragma pragma_scope" (TOPI's scatter kernel, the gradient of
    gather) reaches the debug log, not stderr."""
    model = nn.Linear(7, 3)
    graph = TrainGraph(model, PickTwoPerRow(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with caplog.at_level(logging.DEBUG, logger="tvmgraph"):
        graph(torch.randn(5, 7), torch.tensor([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2]]))
    assert capfd.readouterr() == ("", "")
    assert any("TVM (codegen)" in r.getMessage() and "pragma_scope" in r.getMessage() for r in caplog.records)


def test_cross_entropy_training_compile_prints_nothing(capfd):
    """Cross-entropy's training step compiles without a word on stdout or stderr."""
    model = nn.Linear(7, 3)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    graph(torch.randn(5, 7), torch.tensor([0, 2, 1, 2, 0]))
    assert capfd.readouterr() == ("", "")


def test_embedding_compile_prints_nothing(capfd):
    """Embedding lowers to a clamped take, not TVM's `fast` one and its segfault warning."""
    graph = ModuleGraph(nn.Sequential(nn.Embedding(11, 3), nn.Linear(3, 2)))
    graph(torch.tensor([[1, 10], [0, 4]]))
    assert capfd.readouterr() == ("", "")


def test_failed_import_prints_nothing(capfd):
    """A converter that refuses an op leaves a half-built Relax function behind; its
    BlockBuilder's complaint when freed goes to the debug log."""
    class BicubicGridSample(nn.Module):
        def forward(self, x, grid):
            return nn.functional.grid_sample(x, grid, mode="bicubic", align_corners=False)

    graph = ModuleGraph(BicubicGridSample())
    with pytest.raises(UnsupportedOpError, match="mode='bicubic'"):
        graph(torch.randn(1, 2, 4, 4), torch.rand(1, 3, 3, 2) * 2 - 1)
    gc.collect()
    assert capfd.readouterr() == ("", "")


def test_a_pass_pipeline_warning_goes_to_the_debug_log(capfd, caplog):
    """TVM's FuseOps warns on stderr about dead code ("please run the DeadCodeElimination Pass
    before FuseOps"), which a training step on zero rows leaves: the debug log takes it."""
    model = nn.Linear(4, 3)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    with caplog.at_level(logging.DEBUG, logger="tvmgraph"):
        graph(torch.randn(0, 4), torch.zeros(0, dtype=torch.long))
    assert capfd.readouterr() == ("", "")
    assert any("TVM (FuseOps)" in r.getMessage() and "dead codes" in r.getMessage() for r in caplog.records)

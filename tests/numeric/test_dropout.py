"""Dropout in train mode: a fresh, seedable mask per call, and gradients through the same mask."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tvmgraph
from tests.conftest import ModuleGraph, TrainGraph
from tvmgraph.dropout import dropout_mask_reference


def test_graph_mask_is_the_documented_hash() -> None:
    """The kept elements are exactly those of the Python reference of the hash, for the seed
    the graph draws from torch's default generator."""
    p = 0.3
    graph = ModuleGraph(nn.Dropout(p).train())
    x = torch.ones(6, 50)
    torch.manual_seed(123)
    out = graph(x)
    torch.manual_seed(123)
    seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64).tolist()
    expected = torch.tensor(dropout_mask_reference(tuple(seed), x.numel(), p, salt=0)).reshape(x.shape)
    assert torch.equal(out != 0, expected)
    torch.testing.assert_close(out[expected], torch.full((int(expected.sum()),), 1 / (1 - p)))


def test_fresh_mask_each_call_and_reproducible_with_manual_seed() -> None:
    graph = ModuleGraph(nn.Dropout(0.5).train())
    x = torch.ones(100, 100)
    torch.manual_seed(0)
    first, second = graph(x).clone(), graph(x).clone()
    assert not torch.equal(first, second)
    torch.manual_seed(0)
    assert torch.equal(graph(x), first)
    kept = (first != 0).float().mean().item()
    assert abs(kept - 0.5) < 0.02  # 10000 Bernoulli draws: 4 standard deviations


@pytest.mark.parametrize("p", [0.1, 0.8])
def test_keep_rate_and_scale(p: float) -> None:
    out = ModuleGraph(nn.Dropout(p).train())(torch.ones(200, 100))
    assert abs((out != 0).float().mean().item() - (1 - p)) < 0.012  # > 4 standard deviations
    torch.testing.assert_close(out[out != 0].unique(), torch.tensor([1 / (1 - p)]))


def test_two_dropouts_draw_different_masks() -> None:
    class Twice(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Dropout(0.5), nn.Dropout(0.5)

        def build(self, x):
            return self.a(x), self.b(x)

    a, b = Twice()(torch.ones(50, 50))
    assert not torch.equal(a != 0, b != 0)


def test_eval_mode_is_identity() -> None:
    x = torch.randn(4, 8)
    assert torch.equal(ModuleGraph(nn.Dropout(0.5).eval())(x), x)


class MaskedDropout(nn.Module):
    """Eager stand-in for dropout with a given keep mask (to mirror the graph's draw)."""

    def __init__(self, keep: torch.Tensor, p: float):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return x * self.keep / (1 - self.p)


def test_training_step_through_dropout_matches_eager_with_the_same_mask() -> None:
    p = 0.4
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 4)).train()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    class Train(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))

        def build(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    torch.manual_seed(7)
    loss = Train()(x, y)
    torch.manual_seed(7)
    seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64).tolist()
    keep = torch.tensor(dropout_mask_reference(tuple(seed), 8 * 32, p, salt=0)).reshape(8, 32).float()
    reference[2] = MaskedDropout(keep, p)
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_loss = nn.functional.cross_entropy(reference(x), y)
    ref_loss.backward()
    opt.step()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-5)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


class RNNOutput(nn.Module):
    """The RNN's output and its final states, flattened (an LSTM's are (h, c))."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        out, final = self.rnn(x)
        return out.sum() + sum(f.sum() for f in (final if isinstance(final, tuple) else (final,)))


RNNS = {
    "lstm": lambda p: nn.LSTM(6, 5, num_layers=3, dropout=p, batch_first=True),
    "gru-bidirectional": lambda p: nn.GRU(6, 5, num_layers=2, dropout=p, bidirectional=True),
    "rnn-relu": lambda p: nn.RNN(6, 5, num_layers=2, dropout=p, nonlinearity="relu"),
    "lstm-projections": lambda p: nn.LSTM(6, 5, num_layers=2, dropout=p, proj_size=3),
}


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("make", RNNS.values(), ids=RNNS.keys())
def test_rnn_dropout_between_layers_trains_as_eager(make) -> None:
    """torch's RNN decomposition never drops out between layers (`num_layers < i - 1`): a
    training graph ran every call as in eval mode. With dropout=1 eager's mask is known (every
    layer's output but the last is zeroed): the training step's loss and updated weights match
    eager's; with 0.5 two calls differ, as eager's do."""
    torch.manual_seed(0)
    model = RNNOutput(make(1.0)).train()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 6)
    graph = TrainGraph(model, lambda out, _: out, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = graph(x, x)
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    eager_loss = reference(x)
    eager_loss.backward()
    eager_optimizer.step()
    torch.testing.assert_close(loss, eager_loss.detach(), atol=1e-5, rtol=1e-5)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5, msg=name)
    half = ModuleGraph(RNNOutput(make(0.5)).train())
    assert not torch.equal(half(x), half(x))


def test_dropout_trains_under_a_dynamic_batch() -> None:
    """The mask's shape was taken as ints: a symbolic batch failed to compile (CompileError
    called a tvmgraph bug), so a TransformerEncoderLayer (dropout 0.1) could not train with a
    dynamic batch. Train mode at batches 8 and 5, one program; kept elements scaled by 1/(1-p)."""
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5))
    graph = TrainGraph(model, lambda out, _: out.square().mean(), torch.optim.SGD(model.parameters(), lr=0.01))
    graph.config.enable_dynamic_batch()
    for batch in (8, 5):
        graph(torch.randn(batch, 4), torch.zeros(batch))
    inference = ModuleGraph(nn.Dropout(0.5).train())
    inference.config.enable_dynamic_batch()
    for batch in (8, 5):
        out = inference(torch.ones(batch, 200))
        assert out.shape == (batch, 200) and set(out.unique().tolist()) == {0.0, 2.0}
    assert inference.num_compiled == 1 and graph.num_compiled == 1

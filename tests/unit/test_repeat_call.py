"""A call that repeats the last one's signature skips building a Signature (graph.py,
`Graph._last_entry_again`); every change a Signature would see still sends it the long way.

Each test calls a graph twice first, so that the call after the change is one the short path
looks at: a wrong "same as last time" would run the stale program and fail the comparison
with eager torch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph.errors import GraphArgumentError, NestedGraphError
from tvmgraph.graph import Graph
from tvmgraph.spec import Signature
from tests.conftest import ModuleGraph, TrainGraph, assert_close


class Scaled(nn.Module):
    """A module whose forward reads a plain Python attribute (an attribute guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.scale = 2.0

    def forward(self, x):
        return self.linear(x) * self.scale


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), Scaled()).eval()


def test_every_field_of_a_signature_is_checked_by_the_short_path() -> None:
    """A field added to Signature must be checked in `_last_entry_again` too (then add it here)."""
    assert [f.name for f in dataclasses.fields(Signature)] == [
        "args", "leaves", "module_modes", "optimizers", "structure", "options", "default_dtype"]


def test_a_repeated_call_does_not_look_for_its_entry_again(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up = []
    entry_for = Graph._entry_for
    monkeypatch.setattr(Graph, "_entry_for", lambda self, *a: looked_up.append(1) or entry_for(self, *a))
    m = model()
    graph, x = ModuleGraph(m), torch.randn(5, 4)
    for _ in range(4):
        assert_close(graph(x), m(x))
    assert len(looked_up) == 1
    graph(torch.randn(2, 4))  # a new shape: the long way
    assert len(looked_up) == 2


def _new_batch(m, graph, x):
    return torch.randn(7, 4)


def _double(m, graph, x):
    m.double()  # no registration hook sees this: the entry's tensors changed under it
    return x.double()


def _train_mode(m, graph, x):
    m.train()  # batch norm on batch statistics
    return x


def _attribute(m, graph, x):
    m[2].scale = -3.0
    return x


def _replaced_layer(m, graph, x):
    m[0] = nn.Linear(4, 6)
    return x


def _config(m, graph, x):
    graph.config.allow_fuse_add_to_output(False)
    return x


@pytest.mark.parametrize("change", [_new_batch, _double, _train_mode, _attribute, _replaced_layer, _config],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_change_after_repeated_calls_runs_a_program_for_it(change) -> None:
    torch.manual_seed(0)
    m = model()
    graph, x = ModuleGraph(m), torch.randn(5, 4)
    for _ in range(2):
        graph(x)
    x = change(m, graph, x)
    expected = m(x)
    assert_close(graph(x), expected)
    assert_close(graph(x), m(x) if m.training else expected)
    assert graph.num_compiled == 2


def test_an_optimizer_change_after_repeated_steps_trains_as_eager() -> None:
    """SGD without momentum, then with: the program with a momentum buffer must take over."""
    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    graph = TrainGraph(ours, nn.MSELoss(), opt_ours)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    for step in range(6):
        if step == 3:
            for opt in (opt_ours, opt_theirs):
                opt.param_groups[0]["momentum"] = 0.9
        loss = graph(x, y)
        opt_theirs.zero_grad()
        expected = nn.functional.mse_loss(theirs(x), y)
        expected.backward()
        opt_theirs.step()
        assert_close(loss, expected)
    assert_close(ours.weight, theirs.weight)
    assert graph.num_compiled == 2


def test_a_keyword_argument_after_repeated_calls_is_still_refused() -> None:
    graph, x = ModuleGraph(model()), torch.randn(5, 4)
    graph(x)
    graph(x)
    with pytest.raises(GraphArgumentError, match="keyword argument"):
        graph(x=x)


def test_a_graph_called_inside_another_build_after_repeated_calls_is_still_refused() -> None:
    inner, x = ModuleGraph(model()), torch.randn(5, 4)
    inner(x)
    inner(x)

    class Outer(tvmgraph.nn.Graph):
        def build(self, x):
            return inner(x)

    with pytest.raises(NestedGraphError, match="inside build"):
        Outer()(x)

"""What build() takes and returns: dicts (string keys) in and out, keyword arguments put in
their places among build()'s parameters, and the same structures through tvmgraph.save/load."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph.errors import GraphArgumentError, GraphOutputError


class Classifier(tvmgraph.nn.Graph):
    """A model's output as Hugging Face models give it: a dict with the logits and a loss."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)

    def build(self, batch, mask=None, scale=None):
        logits = self.head(batch["x"])
        if mask is not None:
            logits = logits.masked_fill(mask, 0.0)
        if scale is not None:
            logits = logits * scale
        loss = nn.functional.cross_entropy(logits, batch["y"])
        return {"logits": logits, "loss": loss, "extra": (logits.sum(), [None, logits.amax()])}


def _eager(graph: Classifier, batch, mask=None, scale=None):
    with torch.no_grad():
        logits = graph.head(batch["x"])
        logits = logits if mask is None else logits.masked_fill(mask, 0.0)
        logits = logits if scale is None else logits * scale
        return logits, nn.functional.cross_entropy(logits, batch["y"])


def _batch():
    return {"x": torch.randn(5, 4), "y": torch.randint(0, 3, (5,))}


def test_dicts_in_and_out_keep_their_structure() -> None:
    graph, batch = Classifier(), _batch()
    out = graph(batch)
    assert list(out) == ["logits", "loss", "extra"] and out["extra"][1][0] is None
    logits, loss = _eager(graph, batch)
    torch.testing.assert_close(out["logits"], logits)
    torch.testing.assert_close(out["loss"], loss)
    torch.testing.assert_close(out["extra"][1][1], logits.amax())


def test_keyword_arguments_take_their_places() -> None:
    """`scale=` given, `mask` skipped: mask takes its default (None); one compile per structure."""
    graph, batch = Classifier(), _batch()
    mask, scale = torch.rand(5, 3) > 0.5, torch.tensor(2.0)
    torch.testing.assert_close(graph(batch, scale=scale)["logits"], _eager(graph, batch, scale=scale)[0])
    torch.testing.assert_close(graph(batch=batch, mask=mask)["logits"], _eager(graph, batch, mask=mask)[0])
    torch.testing.assert_close(graph(batch, mask, scale)["loss"], _eager(graph, batch, mask, scale)[1])
    graph(batch, mask=mask)
    assert graph.num_compiled == 3


def test_dict_keys_that_are_not_strings_and_keyword_only_parameters_are_clear_errors() -> None:
    graph = Classifier()
    with pytest.raises(GraphArgumentError, match=r"argument 'batch' is dict; .*dict \(string keys\)"):
        graph({0: torch.ones(1)})

    class KeywordOnly(tvmgraph.nn.Graph):
        def build(self, x, *, scale):
            return x * scale

    with pytest.raises(GraphArgumentError, match=r"keyword-only parameters \(scale\)"):
        KeywordOnly()(torch.ones(2), scale=torch.ones(2))

    class NumberOut(tvmgraph.nn.Graph):
        def build(self, x):
            return {"x": x, "n": 3}

    with pytest.raises(GraphOutputError, match=r"returned int at output\['n'\]"):
        NumberOut()(torch.ones(2))


def test_a_saved_graph_takes_and_returns_the_same_dicts(tmp_path: Path) -> None:
    graph, batch = Classifier(), _batch()
    expected = graph(batch)
    path = tvmgraph.save(graph, tmp_path / "classifier")
    loaded = tvmgraph.load(path)
    out = loaded(batch)
    assert list(out) == ["logits", "loss", "extra"] and out["extra"][1][0] is None
    torch.testing.assert_close(torch.as_tensor(out["logits"]), expected["logits"])
    with pytest.raises(Exception, match=r"must be a dict with keys \['x', 'y'\]"):
        loaded({"x": batch["x"]})


Pair = collections.namedtuple("Pair", ["features", "bias"])
Scores = collections.namedtuple("Scores", ["logits", "probabilities"])


class NamedIO(tvmgraph.nn.Graph):
    """A namedtuple in (read by field) and out (a model output read as `out.logits`)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 3)

    def build(self, pair):
        logits = self.head(pair.features) + pair.bias
        return Scores(logits, logits.softmax(-1))


def test_namedtuples_in_and_out_keep_their_class(tmp_path: Path) -> None:
    """Flattened as plain tuples, `pair.features` failed to trace and `out.logits` was an
    AttributeError. A saved graph returns a namedtuple of the same name and fields."""
    graph = NamedIO()
    pair = Pair(torch.randn(2, 4), torch.randn(2, 3))
    out = graph(pair)
    expected = graph.head(pair.features) + pair.bias
    assert type(out) is Scores
    torch.testing.assert_close(out.logits, expected)
    torch.testing.assert_close(out.probabilities, expected.softmax(-1))
    loaded = tvmgraph.load(tvmgraph.save(graph, tmp_path / "named"))
    saved = loaded(pair)
    assert type(saved).__name__ == "Scores" and saved._fields == ("logits", "probabilities")
    torch.testing.assert_close(torch.as_tensor(saved.logits), expected)

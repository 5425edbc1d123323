"""Index inputs out of range raise IndexOutOfRangeError (an IndexError, as in eager) instead of
crashing the process; negative indices that torch accepts give eager's numbers; indices computed
in the graph are kept inside the tensor (tvmgraph/index_guard.py, converters.py).

Before the fix an out-of-range token id or label read outside the tensor in the kernel
("Fast mode segfaults when there are out-of-bounds indices"), and `x[idx]` with idx = -1 read
before its start.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import ModuleGraph, TrainGraph, assert_close
from tvmgraph.errors import IndexOutOfRangeError, TvmGraphError


class Gather(nn.Module):
    def forward(self, x, index):
        return torch.gather(x, 1, index)


class IndexSelect(nn.Module):
    def forward(self, x, index):
        return torch.index_select(x, 0, index.view(-1))  # through a view: still traced to `index`


class Scatter(nn.Module):
    def forward(self, x, index):
        return torch.zeros(3, 5).scatter(1, index, x)


class OneHot(nn.Module):
    def forward(self, x, classes):
        return x * nn.functional.one_hot(classes, 4)


class Items(nn.Module):
    """x[idx] and torch.take: torch counts negative indices from the end."""

    def forward(self, x, idx):
        return x[idx] * 2, torch.take(x, idx)


class Bags(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(5, 2, mode="max")

    def forward(self, ids, offsets):
        return self.bag(ids, offsets)


class Unpool(nn.Module):
    def forward(self, x, indices):
        return nn.functional.max_unpool1d(x, indices, 2)


class MultiMargin(nn.Module):
    def forward(self, x, target):
        return nn.functional.multi_margin_loss(x, target)


class MultiLabelMargin(nn.Module):
    def forward(self, x, target):
        return nn.functional.multilabel_margin_loss(x, target)


CASES = {
    # name: (model, good args, bad input position, bad values, op in the message)
    # (found by a sweep: these ops read outside their tensors, where eager raises)
    "embedding_bag": (Bags(), (torch.tensor([0, 4, 1]), torch.tensor([0, 2])), 0, [0, 7, 1], "aten.embedding_bag"),
    "embedding_bag_offsets": (Bags(), (torch.tensor([0, 4, 1]), torch.tensor([0, 2])), 1, [0, 5],
                              "aten.embedding_bag"),
    "max_unpool": (Unpool(), (torch.randn(1, 1, 3), torch.tensor([[[1, 2, 5]]])), 1, [[[1, 2, 9]]],
                   "aten.max_unpool2d"),
    "multi_margin_loss": (MultiMargin(), (torch.randn(2, 4), torch.tensor([3, 0])), 1, [4, 0],
                          "aten.multi_margin_loss"),
    "multilabel_margin_loss": (MultiLabelMargin(), (torch.randn(2, 4), torch.tensor([[3, -1, 0, 0], [1, 2, -1, 0]])),
                               1, [[5, -1, 0, 0], [1, 2, -1, 0]], "aten.multilabel_margin_loss"),
    "embedding": (nn.Embedding(10, 4), (torch.tensor([[1, 9], [0, 3]]),), 0, [[1, 10], [0, 3]], "aten.embedding"),
    "embedding_negative": (nn.Embedding(10, 4), (torch.tensor([1, 2]),), 0, [1, -1], "aten.embedding"),
    "gather": (Gather(), (torch.randn(3, 4), torch.tensor([[0], [3], [1]])), 1, [[0], [4], [1]], "aten.gather"),
    "gather_negative": (Gather(), (torch.randn(3, 4), torch.tensor([[0], [3], [1]])), 1, [[0], [-1], [1]],
                        "aten.gather"),
    "index_select": (IndexSelect(), (torch.randn(3, 4), torch.tensor([[2, 0]])), 1, [[3, 0]], "aten.index_select"),
    "scatter": (Scatter(), (torch.randn(3, 1), torch.tensor([[4], [0], [2]])), 1, [[5], [0], [2]], "aten.scatter"),
    "one_hot": (OneHot(), (torch.randn(3, 4), torch.tensor([0, 3, 1])), 1, [0, 4, 1], "aten.one_hot"),
    "one_hot_negative": (OneHot(), (torch.randn(3, 4), torch.tensor([0, 3, 1])), 1, [0, -1, 1], "aten.one_hot"),
    "index_tensor": (Items(), (torch.randn(4, 3), torch.tensor([0, 3])), 1, [0, 4], "aten.index"),
    "index_tensor_negative": (Items(), (torch.randn(4, 3), torch.tensor([0, -4])), 1, [0, -5], "aten.index"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_index_input_out_of_range_raises(case):
    """Eager refuses the index (IndexError, or RuntimeError for gather/scatter); the graph raises
    IndexOutOfRangeError (an IndexError), naming the graph, the input, the op and the valid
    range, and still runs valid inputs afterwards."""
    model, args, position, bad_values, op = CASES[case]
    graph = ModuleGraph(model)
    good = graph(*args)
    bad = list(args)
    bad[position] = torch.tensor(bad_values)
    with pytest.raises((IndexError, RuntimeError)):
        model(*bad)
    with pytest.raises(IndexOutOfRangeError) as info:
        graph(*bad)
    assert isinstance(info.value, TvmGraphError)
    message = str(info.value)
    assert message.startswith(f"{graph.name}: input 'args_{position}' holds ") and op in message, message
    assert "valid values are" in message
    again = graph(*args)
    for a, b in zip(torch.utils._pytree.tree_leaves(again), torch.utils._pytree.tree_leaves(good)):
        assert_close(a.detach(), b.detach())


def test_negative_indices_give_eager_numbers():
    """`x[idx]` and `torch.take` with in-range negative indices count from the end, as in eager."""
    model = Items()
    x, idx = torch.randn(4, 3), torch.tensor([-1, 0, -4, 2])
    for actual, expected in zip(ModuleGraph(model)(x, idx), model(x, idx)):
        assert_close(actual, expected)


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 3))

    def forward(self, idx):
        return self.table[idx]


def test_negative_indices_in_training_match_eager():
    """The gradient of `table[idx]` with negative idx lands on the right rows, step after step."""
    model = Lookup()
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    idx, target = torch.tensor([-1, 0, -5, -1]), torch.randn(4, 3)
    for _ in range(3):
        loss = graph(idx, target)
        ref_opt.zero_grad()
        ref_loss = nn.functional.mse_loss(reference(idx), target)
        ref_loss.backward()
        ref_opt.step()
        assert_close(loss, ref_loss.detach())
        assert_close(model.table.detach(), reference.table.detach())


def _trains_like_eager(loss_fn, classes: int, x: torch.Tensor, y: torch.Tensor, steps: int):
    """A Linear(4, classes) trained `steps` SGD-momentum steps as a graph and in eager: the
    losses and weights agree after each; returns (model, graph)."""
    model = nn.Linear(4, classes)
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        loss = graph(x, y)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert_close(loss, ref_loss.detach())
        assert_close(model.weight.detach(), reference.weight.detach())
    return model, graph


def test_cross_entropy_labels_out_of_range_in_training():
    """A label >= the number of classes raises before the step (parameters untouched); labels
    equal to ignore_index are accepted and train as in eager."""
    x = torch.randn(6, 4)
    model, graph = _trains_like_eager(nn.CrossEntropyLoss(ignore_index=-1), 5, x,
                                      torch.tensor([0, 4, -1, 2, -1, 3]), steps=2)
    before = model.weight.detach().clone()
    for labels in ([0, 5, -1, 2, -1, 3], [0, 1, -2, 2, -1, 3]):
        with pytest.raises(IndexOutOfRangeError, match=r"input 'y' holds .* aten\.cross_entropy_loss .*"
                                                       r"valid values are 0\.\.4, or -1 \(ignore_index\)"):
            graph(x, torch.tensor(labels))
    assert torch.equal(model.weight.detach(), before)
    assert graph.step == 2


def test_embedding_ids_out_of_range_in_training():
    """An embedding training graph rejects an out-of-range id the same way."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 3))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph(torch.tensor([[1, 2], [3, 9]]), torch.tensor([0, 2]))
    with pytest.raises(IndexOutOfRangeError, match=r"input 'x' holds 11 at \[1, 0\], out of range for "
                                                   r"aten\.embedding from 'model\.0' \(Embedding\)"):
        graph(torch.tensor([[1, 2], [11, 9]]), torch.tensor([0, 2]))


class ComputedIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x):
        ids = (x * 100).long()  # computed in the graph: not an input the guard can check
        return self.emb(ids), torch.gather(x, 1, ids[:, :1])


def test_indices_computed_in_graph_stay_inside_the_tensor():
    """Indices computed in the graph are not checked, but never address memory outside the
    tensor: out-of-range values are clamped to the nearest row (eager raises; the graph must at
    least not crash)."""
    model = ComputedIds()
    x = torch.tensor([[0.5, 0.01], [-3.0, 0.02]])  # ids [[50, 1], [-300, 2]]
    emb, gathered = ModuleGraph(model)(x)
    weight = model.emb.weight.detach()
    assert_close(emb.detach(), weight[torch.tensor([[9, 1], [0, 2]])])
    assert_close(gathered, torch.tensor([[0.01], [-3.0]]))


def test_one_hot_targets_train_like_eager_and_are_checked():
    """torch decomposes one_hot with a runtime assertion, which made the program impure: Relax
    autodiff refused it ("now only support one dataflow block"). The assertion is dropped from
    the program and checked on the torch side: steps match eager, and a class out of range
    raises before the step."""
    def loss_fn(out, y):
        return nn.functional.mse_loss(out, nn.functional.one_hot(y, 3).to(out.dtype))

    x = torch.randn(6, 4)
    _, graph = _trains_like_eager(loss_fn, 3, x, torch.tensor([0, 2, 1, 2, 0, 1]), steps=3)
    with pytest.raises(IndexOutOfRangeError, match=r"input 'y' holds 3 at \[1\], out of range for aten\.one_hot "
                                                   r"from build\(\) itself: valid values are 0\.\.2"):
        graph(x, torch.tensor([0, 3, 1, 2, 0, 1]))
    assert graph.step == 3


class OneHotOfArgmax(nn.Module):
    def forward(self, x):
        return nn.functional.one_hot(x.argmax(1), 5) * x.max(1, keepdim=True).values


def test_one_hot_of_a_computed_class_matches_eager():
    x = torch.randn(7, 5)
    assert_close(ModuleGraph(OneHotOfArgmax())(x), OneHotOfArgmax()(x))

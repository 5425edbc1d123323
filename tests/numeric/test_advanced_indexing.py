"""Advanced indexing against torch eager (tvmgraph/advanced_indexing.py).

Before it, `x[:, i, j]` returned a tensor of another shape, `x[:, k, i]` one of the right shape
with other values, and `y[y < 0] = 0` zeroed y's first two rows: silently wrong numbers.
Indexing results are exact (int64 compared with equal); training steps within 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmgraph
from tests.conftest import Fn, ModuleGraph, SGDStep, TrainGraph, assert_close, assert_steps_match_eager
from tvmgraph.errors import CompileError, IndexOutOfRangeError, UnsupportedOpError

_I = torch.tensor([0, 2, -1])
_J = torch.tensor([1, 3, 0])
_K = torch.tensor([[0], [1]])


def _masked_assignment(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y < 0] = 0
    return y


def _row_mask_assignment(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y[:, 0, 0, 0] > 0] = 7.0
    return y


def _masked_values(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y < 0] = y[y < 0] * 2 - 1  # one value per true element, in order
    return y


def _row_mask_vector(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y[:, 0, 0, 0] > 0] += torch.arange(20.0).view(4, 5)  # broadcast over the selected rows
    return y


def _inner_mask_assignment(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[:, y[0, :, :, 0] > 0] = -3.0  # a mask on a dim after a whole one
    return y


def _never_true(y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    y[y > 100] = y[y > 100] + 1  # no true element, no values: nothing read outside them
    return y


CASES = {
    "pairs_after_a_whole_dim": lambda x: x[:, _I, _J],
    "pairs_on_dims_apart": lambda x: x[:, _I, :, _J],
    "broadcast_indices": lambda x: x[:, _K, _I],
    "last_two_dims": lambda x: x[:, :, _I, _J],
    "first_two_dims": lambda x: x[_K, _I],
    "ellipsis": lambda x: x[..., _I],
    "boolean_mask": lambda x: x[x > 0],
    "row_mask": lambda x: x[x[:, 0, 0, 0] > 0],
    "mask_after_a_whole_dim": lambda x: x[:, x[0, :, 0, 0] > 0],
    "nonzero": lambda x: torch.nonzero(x > 0.5),
    "masked_select_broadcasting_both": lambda x: torch.masked_select(x[0, 0, :1], x[:, :, 0, :] > 0),
    "masked_assignment": _masked_assignment,
    "row_mask_assignment": _row_mask_assignment,
    "masked_values": _masked_values,
    "row_mask_vector": _row_mask_vector,
    "inner_mask_assignment": _inner_mask_assignment,
    "never_true": _never_true,
}


@pytest.mark.parametrize("name", list(CASES))
def test_indexing_matches_eager(name: str) -> None:
    fn = CASES[name]
    graph = ModuleGraph(Fn(fn))
    for _ in range(2):  # a second input: masks select other elements, counts change
        x = torch.randn(2, 3, 4, 5)
        expected = fn(x)
        out = graph(x)
        assert out.shape == expected.shape and out.dtype == expected.dtype
        assert torch.equal(out, expected)


ACCUMULATIONS = {
    "index_add_": lambda x, idx, v: x.index_add_(0, idx % 5, v),  # index_add_ takes no negative index
    "index_put_accumulate": lambda x, idx, v: x.index_put_((idx,), v, accumulate=True),
    "add_at_indices": lambda x, idx, v: x.index_put_((idx, idx % 3), v[:, 0], accumulate=True),
}


@pytest.mark.parametrize("name", list(ACCUMULATIONS))
def test_accumulating_at_repeated_indices_sums_every_value(name: str) -> None:
    """Thousands of values added at a few repeated indices: TOPI's index_put added them in a
    parallel loop, and two threads adding at one index lost a sum (legalize_fixes.py). Values
    of whole numbers: any order of the adds gives the exact sum, so the graph must equal eager."""
    fn = ACCUMULATIONS[name]
    graph = ModuleGraph(Fn(lambda x, idx, v: fn(x.clone(), idx, v)))
    for _ in range(3):
        x = torch.zeros(5, 3)
        idx = torch.randint(-5, 5, (20000,))
        v = torch.randint(-3, 4, (20000, 3)).float()
        assert torch.equal(graph(x, idx, v), fn(x.clone(), idx, v))


def test_writing_at_repeated_indices_keeps_the_last_value_as_eager() -> None:
    """`h[idx] = v` and `h[idx] += v` with a repeated index: eager on the CPU writes in order, the
    last value wins; TOPI's index_put wrote in parallel and the graph kept the first (h[2] = 3
    where eager has 4), and a loss over h trained another way (found by a sweep)."""
    def assign(h, idx, v):
        h = h.clone()
        h[idx] = v
        return h

    def add(h, idx, v):
        h = h.clone()
        h[idx] += v
        return h

    idx, v = torch.tensor([0, 5, 2, 2, 1]), torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    for fn in (assign, add):
        assert torch.equal(ModuleGraph(Fn(fn))(torch.zeros(6, 1), idx, v), fn(torch.zeros(6, 1), idx, v))
    # Past torch's grain size eager writes in parallel too, and which value wins is open; the
    # graph keeps the last, whatever its threads.
    many = torch.randint(0, 7, (5000,))
    values = torch.arange(5000.0).unsqueeze(1).expand(5000, 3)
    last = {int(i): float(k) for k, i in enumerate(many)}
    expected = torch.tensor([last[r] for r in range(7)]).unsqueeze(1).expand(7, 3)
    assert torch.equal(ModuleGraph(Fn(assign))(torch.zeros(7, 3), many, values), expected)


class PickedByScalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4))

    def forward(self, i, j):
        return (self.w[i] * 2).sum() + self.w[:, j].pow(2).sum() + self.w[i, j]


def test_indexing_by_a_0d_tensor_argument_matches_eager_with_one_program() -> None:
    """`w[i]` with `i` a 0-d int tensor: export writes `select(w, 0, i.item())`, whose index the
    converter took for a constant (a CompileError); the item also made a shape of a value, which
    autodiff refuses. Both ways, negative indices too, one program for every index."""
    torch.manual_seed(0)
    model = PickedByScalars()
    reference, fixed = copy.deepcopy(model), copy.deepcopy(model)
    inference, step = ModuleGraph(fixed), SGDStep(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=1.0, momentum=0.9)  # SGDStep's
    for i, j in [(2, 1), (-1, 3), (0, -2)]:
        i, j = torch.tensor(i), torch.tensor(j)
        assert_close(inference(i, j), fixed(i, j).detach())
        optimizer.zero_grad()
        expected = reference(i, j)
        expected.backward()
        optimizer.step()
        assert_close(step(i, j), expected.detach())
        assert_close(model.w.detach(), reference.w.detach())
    assert inference.num_compiled == step.num_compiled == 1
    # Out of range: eager's IndexError, before the program runs (IndexGuard), not a wrapped row.
    for i, j in [(5, 0), (-6, 0), (0, 4)]:
        with pytest.raises(IndexOutOfRangeError, match="out of range for aten.select"):
            inference(torch.tensor(i), torch.tensor(j))


class MaskedActivations(nn.Module):
    """A leaky ReLU written as masked assignments, then indexing by pairs of index tensors."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 24)

    def forward(self, x):
        h = self.fc(x).view(-1, 2, 3, 4).clone()
        h[h < 0] = 0.5
        h[:, 1][h[:, 0] > 0.3] = 2.0
        return h[:, :, _I, _J]


class PickedParameters(nn.Module):
    """Rows of a parameter picked by pairs of indices computed in the graph."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 5, 6))

    def forward(self, x):
        i, j = x.argmax(-1) % 4, x.argmin(-1) % 5
        return self.w[i, j] + self.w[i[:, None], :, j[:, None]].sum(-1)


@pytest.mark.parametrize("make, x, y", [
    (MaskedActivations, torch.randn(5, 6), torch.randn(5, 2, 3)),
    (PickedParameters, torch.randn(7, 9), torch.randn(7, 6)),
], ids=["masked_assignments", "picked_parameters"])
def test_training_through_indexing_matches_eager(make, x: torch.Tensor, y: torch.Tensor) -> None:
    model = make()
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert_steps_match_eager(graph, model, reference, nn.MSELoss(), x, y, steps=3)


def test_a_loss_over_masked_elements_is_refused_with_the_rewrite() -> None:
    class MaskedLoss(nn.Module):
        def forward(self, out, y):
            keep = y >= 0
            return F.cross_entropy(out[keep], y[keep])

    model = nn.Linear(8, 5)
    graph = TrainGraph(model, MaskedLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UnsupportedOpError, match=r"computes a shape from tensor values.*masked_fill\(~m, -100\)"):
        graph(torch.randn(4, 8), torch.tensor([1, -1, 3, 4]))


def test_a_converter_result_unlike_the_traced_one_stops_the_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The importer's own `index.Tensor` (an outer product of `i` and `j`) is caught by its shape."""
    from tvmgraph import converters

    monkeypatch.setitem(converters.CONVERTERS, "index.Tensor",
                        lambda node, importer: importer._index_tensor(node))
    graph = ModuleGraph(Fn(lambda x: x[:, _I, _J] * 2))  # not the program of a test above (compiled cache)
    with pytest.raises(CompileError, match=r"aten\.index\.Tensor .* unlike the one torch traced "
                                           r"\(4 dimensions, torch gives 3 \(\[2, 3, 6\]\)\)"):
        graph(torch.randn(2, 3, 4, 6))


def test_complex_tensors_are_refused_with_the_fix() -> None:
    graph = ModuleGraph(Fn(lambda z: z * 2))
    with pytest.raises(UnsupportedOpError, match=r"complex64 tensor; TVM has no complex dtypes.*view_as_real"):
        graph(torch.ones(2, dtype=torch.complex64))


def test_float8_casts_are_refused_with_the_fix() -> None:
    """The importer raised NotImplementedError ("input_type torch.float8_e4m3fn is not handled"),
    reported as a CompileError that called itself a tvmgraph bug."""
    graph = ModuleGraph(Fn(lambda x: x.to(torch.float8_e4m3fn).float()))
    with pytest.raises(UnsupportedOpError, match=r"float8_e4m3fn tensor; TVM 0.27's PyTorch importer has no float8"):
        graph(torch.ones(2))


def test_graph_name_is_in_the_refusal() -> None:
    graph = ModuleGraph(Fn(lambda z: torch.fft.rfft(z).abs()))
    with pytest.raises(UnsupportedOpError, match=rf"^{graph.name}: aten\._fft_r2c"):
        graph(torch.ones(8))
    assert isinstance(tvmgraph.errors.UnsupportedOpError("x"), NotImplementedError)


def test_indexing_under_a_dynamic_batch_matches_eager_with_one_program() -> None:
    """Masks and pairs of indices on a tensor whose batch is symbolic; a negative index into the
    batch counts from its end at every batch size."""

    def pick(x):
        h = x.clone()
        h[h < 0] = 0
        return h[h > 0.1], h[:, [0, 2]][:, [1, 0]], h[torch.tensor([-1, 0]), torch.tensor([1, 3])]

    class Dynamic(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.config.enable_dynamic_batch(True)

        def build(self, x):
            return pick(x)

    graph = Dynamic()
    for batch in (5, 9, 2):
        x = torch.randn(batch, 4)
        for got, expected in zip(graph(x), pick(x)):
            assert got.shape == expected.shape and torch.equal(got, expected)
    assert len(graph._state().entries) == 1


def test_index_put_under_a_dynamic_batch_matches_eager_with_one_program() -> None:
    """Scatters into a symbolic batch and from it into a fixed table (a graph network's edges):
    the index tensors' and x's sizes are symbolic; such a graph failed to compile (the
    converter's indices needed every size known)."""

    def scatter(x, idx, v):
        return (x.clone().index_add_(0, idx % 4, v),
                torch.zeros(7, 3).index_put_((idx % 7, idx % 3), v[:, 0], accumulate=True),
                x.clone().index_put_((idx % 5,), v * 2))  # no accumulation: one of the writers wins

    class Dynamic(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.config.enable_dynamic_batch(True)

        def build(self, x, idx, v):
            return scatter(x, idx, v)

    graph = Dynamic()
    for batch in (600, 900, 5):
        x, idx = torch.randn(batch, 3), torch.randint(0, 100, (batch,))
        v = torch.randint(-3, 4, (batch, 3)).float()
        got, expected = graph(x, idx, v), scatter(x, idx, v)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        written = torch.zeros(batch, dtype=torch.bool)
        written[idx % 5] = True
        assert torch.equal(got[2][~written], x[~written])  # rows no index names are x's
    assert len(graph._state().entries) == 1


def test_masked_select_under_a_dynamic_batch_matches_eager() -> None:
    """torch.masked_select of a tensor and a mask of the same symbolic shape (its shape check
    called tvm.ir.structural_equal, which TVM 0.27 does not have: a CompileError at any batch);
    a mask of another symbolic shape is refused with the fix."""
    graph = ModuleGraph(Fn(torch.masked_select))
    graph.config.enable_dynamic_batch()
    for batch in (5, 8):
        x = torch.randn(batch, 4)
        assert torch.equal(graph(x, x > 0), torch.masked_select(x, x > 0))
    sliced = ModuleGraph(Fn(lambda x, m: torch.masked_select(x, m[:1])))
    sliced.config.enable_dynamic_batch()
    with pytest.raises(UnsupportedOpError, match="symbolic size: expand it first"):
        sliced(x, x > 0)

"""Surprising tracing behaviours, pinned so that a change to any of them is noticed.

Each test states what happens today; `# should be X!` marks where eager code would differ.
docs/footguns.md explains each one to users.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph import errors
from tests.conftest import ModuleGraph


class Scaled(tvmgraph.nn.Graph):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.scale = 1.0
        self.trace_count = 0

    def build(self, x):
        self.trace_count += 1  # Python side effects run while tracing only
        return self.linear(x) * self.scale


def test_python_attributes_read_by_build_are_guarded() -> None:
    """A changed plain value compiles again (tvmgraph/attribute_guard.py); the counter that
    build() itself bumps is a side effect and no guard."""
    graph = Scaled()
    x = torch.ones(1, 2)
    first = graph(x)
    graph(x)
    assert graph.num_compiled == 1
    graph.scale = 3.0
    torch.testing.assert_close(graph(x), first * 3)
    assert graph.num_compiled == 2


def test_python_side_effects_in_build_run_once_per_signature() -> None:
    graph = Scaled()
    for _ in range(3):
        graph(torch.ones(1, 2))
    assert graph.trace_count == 1  # should be 3!
    graph(torch.ones(5, 2))  # a new signature traces again
    assert graph.trace_count == 2


def test_train_eval_switch_is_not_frozen() -> None:
    """Unlike OneFlow (which fixes the mode at the first call), a mode change recompiles."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    graph = ModuleGraph(model.eval())
    x = torch.randn(8, 4)
    eval_out = graph(x)
    model.train()
    train_out = graph(x)
    assert not torch.allclose(eval_out, train_out)
    assert graph.num_compiled == 2


def test_outputs_are_fresh_tensors_each_call() -> None:
    graph = ModuleGraph(nn.Linear(2, 2))
    a = graph(torch.ones(1, 2))
    b = graph(torch.ones(1, 2))
    assert a.data_ptr() != b.data_ptr()


def test_an_inference_graph_call_is_not_recorded_by_autograd() -> None:
    """A graph call is not an autograd op (as OneFlow's): an input that requires grad gives a
    plain output, and an eager backward() through it is torch's own error."""
    graph = ModuleGraph(nn.Linear(2, 2))
    x = torch.ones(1, 2, requires_grad=True)
    out = graph(x)
    assert not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()  # should reach x.grad, as eager's would!


def test_in_place_change_of_an_input_is_written_back() -> None:
    class Bumps(tvmgraph.nn.Graph):
        def build(self, x):
            x.add_(1)
            return x * 2

    x = torch.zeros(3)
    out = Bumps()(x)
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    torch.testing.assert_close(x, torch.ones(3))  # as eager does


def test_random_ops_in_build_draw_at_every_call_not_frozen() -> None:
    """torch.rand is traced as a constant by some tracers (TVM's own importer drew randn once);
    here it draws fresh numbers at every call, and a random op without a lowering is an error."""
    class Noisy(tvmgraph.nn.Graph):
        def build(self, x):
            return x + torch.rand(x.shape)

    graph = Noisy()
    first, second = graph(torch.zeros(3)), graph(torch.zeros(3))
    assert not torch.equal(first, second)
    assert ((0 <= first) & (first < 1)).all()

    class Counts(tvmgraph.nn.Graph):
        def build(self, x):
            return torch.poisson(x)

    with pytest.raises(errors.UnsupportedOpError, match=r"aten.poisson.default from build\(\) itself"):
        Counts()(torch.ones(3))


def test_transformer_encoder_with_a_padding_mask_computes_padded_positions_as_the_slow_path() -> None:
    """Under no_grad in eval, eager's nn.TransformerEncoder runs a nested-tensor fast path that
    writes 0 at the padded positions; the graph computes them as eager's general path does
    (which eager also runs with grad enabled). Every position that is not padding is eager's."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2).eval()

    class Encode(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.encoder = encoder

        def build(self, x, pad):
            return self.encoder(x, src_key_padding_mask=pad)

    x, pad = torch.randn(3, 6, 16), torch.zeros(3, 6, dtype=torch.bool)
    pad[0, 4:] = True
    got = Encode()(x, pad)
    with torch.no_grad(), pytest.warns(UserWarning, match="nested tensors is in prototype"):
        fast = encoder(x, src_key_padding_mask=pad)
    general = encoder(x, src_key_padding_mask=pad).detach()  # grad enabled: the general path
    torch.testing.assert_close(got, general, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[~pad], fast[~pad], atol=2e-5, rtol=2e-5)
    assert not fast[pad].any() and got[pad].abs().min() > 0  # should be 0 at padding, as eager's fast path!

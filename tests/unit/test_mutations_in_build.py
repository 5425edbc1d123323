"""In-place writes inside build(): buffers are written back like eager's; a write to a parameter,
and nn.Embedding's max_norm renormalization (which torch.export keeps and decomposition then
dropped, silently), are an UnsupportedOpError naming the module and the fix."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import ModuleGraph
from tvmgraph.errors import TraceError, UnsupportedOpError


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("average", torch.zeros(8))

    def forward(self, x):
        h = self.lin(x)
        h.masked_fill_(h > 1.0, 1.0)
        self.calls += 1
        self.average.mul_(0.9).add_(0.1 * h.mean(0))
        return h


def test_buffers_written_in_place_match_eager() -> None:
    model = Counter()
    reference = copy.deepcopy(model)
    graph = ModuleGraph(model)
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(graph(x), reference(x))
    assert model.calls.item() == reference.calls.item() == 3
    torch.testing.assert_close(model.average, reference.average)


def test_embedding_max_norm_is_refused_not_dropped() -> None:
    """Eager renormalizes the rows it reads, in the weight; the graph ran without it: outputs
    and the weight 1.9 away from eager's after one step."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0))
    with pytest.raises(UnsupportedOpError, match=r"embedding_renorm_.*'model\.0' \(Embedding\).*max_norm"):
        ModuleGraph(model)(torch.randint(0, 10, (3, 5)))


class Clipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.clamp_(-0.1, 0.1)  # WGAN-style weight clipping
        return F.relu(self.lin(x))


def test_a_parameter_written_in_build_is_refused() -> None:
    """It was a CompileError calling itself a tvmgraph bug (torch.export's PARAMETER_MUTATION)."""
    with pytest.raises(UnsupportedOpError, match=r"parameter\(s\) model\.lin\.weight in place.*Fix: do it outside"):
        ModuleGraph(Clipped())(torch.randn(2, 4))


class WritesThroughDetach(nn.Module):
    def __init__(self, target: str):
        super().__init__()
        self.target = target
        self.register_buffer("ema", torch.ones(4))

    def forward(self, x):
        if self.target == "input":
            x.detach().mul_(3)
        elif self.target == "buffer":
            self.ema.detach()[1:].mul_(0.5)  # through a view of the detached alias too
        else:
            h = x * 2
            h.detach().clamp_(max=0.2)
            return h.sum(0)
        return x.sum(0) + self.ema


@pytest.mark.parametrize("target", ["input", "buffer", "activation"])
def test_a_write_through_detach_is_refused_not_lost(target: str) -> None:
    """Eager writes x through x.detach(); the graph wrote a copy and lost the update (found by a
    sweep: an EMA buffer stayed at 1). The error names the form the graph keeps."""
    graph = ModuleGraph(WritesThroughDetach(target))
    with pytest.raises(TraceError, match=rf"{graph.name}: build\(\) updates a tensor in place through "
                                         r"\.detach\(\) \(aten\.(mul_|clamp_)\.\w+ from 'model' \(WritesThroughDetach\) at "
                                         r"\S*test_mutations_in_build.py:\d+: .*, on x\.detach\(\)\).*"
                                         r"with torch\.no_grad\(\): x\.mul_\(3\)"):
        graph(torch.randn(2, 4))


class SharesABuffer(nn.Module):
    def __init__(self, shared: torch.Tensor):
        super().__init__()
        self.register_buffer("count", shared)

    def forward(self, x):
        self.count.add_(1)
        return x + self.count


class TwoOwners(nn.Module):
    def __init__(self):
        super().__init__()
        shared = torch.zeros(4)
        self.a, self.b = SharesABuffer(shared), SharesABuffer(shared)

    def forward(self, x):
        return self.b(self.a(x))


class MutatesAnAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.mask = torch.ones(4)  # a plain attribute, not a buffer

    def forward(self, x):
        self.mask.mul_(0.5)
        return x * self.mask


@pytest.mark.parametrize("model, cause", [
    (TwoOwners(), r"'model.a.count' and 'model.b.count' are one tensor \(registered twice\)"),
    (MutatesAnAttribute(), r"A plain tensor attribute \(not a buffer\) is updated in place in build\(\): register it"),
], ids=["buffer_registered_twice", "plain_attribute_updated"])
def test_state_torch_cannot_update_names_the_cause(model: nn.Module, cause: str) -> None:
    """Both blamed a torch.autograd.Function or a legacy module (found by a sweep)."""
    with pytest.raises(TraceError, match=cause):
        ModuleGraph(model)(torch.ones(4))

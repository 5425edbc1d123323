"""What build() returns of its own inputs, as eager returns it: `x.clone()` and
`self.weight.clone()` are new memory; `return x` and `return self.weight` are those tensors."""

from __future__ import annotations

import copy

import torch
from torch import nn

import tvmgraph


class Returns(tvmgraph.nn.Graph):
    def __init__(self, layer: nn.Linear, optimizer: torch.optim.Optimizer | None = None):
        super().__init__()
        self.layer = layer
        if optimizer is not None:
            self.add_optimizer(optimizer)

    def build(self, x):
        out = self.layer(x)
        if self.layer.training:
            out.sum().backward()
        return (x.clone(), self.layer.weight.clone(), self.layer.scale.clone(), x.detach().clone(),
                x, self.layer.weight, out)


def _layer() -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    layer.register_buffer("scale", torch.ones(2))
    return layer


def test_clones_of_inputs_parameters_and_buffers_are_new_memory() -> None:
    """Before: each clone came back on its source's memory (the importer makes `clone` its input's
    variable): `x.fill_(7)` changed the earlier clone, and zeroing the returned weight clone
    zeroed the model's weight."""
    layer = _layer().eval()
    x = torch.randn(4, 3)
    x_before, weight_before = x.clone(), layer.weight.detach().clone()
    x_clone, w_clone, s_clone, xd_clone, x_itself, w_itself, _ = Returns(layer)(x)
    x.fill_(7.0)
    w_clone.mul_(0.0)
    s_clone.add_(5.0)
    assert torch.equal(x_clone, x_before) and torch.equal(xd_clone, x_before)
    assert torch.equal(layer.weight.detach(), weight_before) and torch.equal(layer.scale, torch.ones(2))
    assert x_itself is x and w_itself is layer.weight  # eager returns the tensors themselves


def test_a_training_step_returns_clones_from_before_its_update_and_the_parameter_itself() -> None:
    """Eager's call is build() then optimizer.step(): a clone holds the weight before the step,
    the returned parameter is the parameter (its values after the step). Before: the clone
    showed the update (the step writes the weight's memory in place)."""
    layer = _layer().train()
    reference = copy.deepcopy(layer)
    x = torch.randn(4, 3)
    graph = Returns(layer, torch.optim.SGD(layer.parameters(), lr=1.0))
    _, w_clone, _, _, _, w_itself, _ = graph(x)
    assert torch.equal(w_clone, reference.weight.detach())
    reference(x).sum().backward()
    with torch.no_grad():
        reference.weight -= reference.weight.grad
    assert w_itself is layer.weight
    torch.testing.assert_close(layer.weight.detach(), reference.weight.detach())


def test_frozen_weights_see_an_edit_through_the_returned_parameter() -> None:
    """`enable_frozen_weights` re-packs a weight when its version changes; the returned weight
    was a new tensor on its memory, whose in-place edit torch counted on that tensor only (the
    next call used the old weight: 1.9 off eager)."""
    layer = _layer().eval()
    graph = Returns(layer)
    graph.config.enable_frozen_weights()
    x = torch.randn(4, 3)
    weight = graph(x)[5]
    with torch.no_grad():
        weight.mul_(2.0)
    torch.testing.assert_close(graph(x)[6], layer(x).detach())

"""Parameters the loss does not reach (tvmgraph/training/reached.py): torch leaves their `.grad`
None and its optimizers skip them; a graph did the same? Before, they took the optimizer's step
with a zero gradient: weight decay (AdamW's by default) moved an unused head's weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmgraph
from tvmgraph.errors import OptimizerError
from tvmgraph.training import reached


class PartlyUsed(nn.Module):
    """`head` unused, `teacher` run under no_grad, `frozen_path` read through detach(), `index`
    read only as an integer (argmax): none of them gets a gradient in eager."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.head, self.teacher, self.frozen_path, self.index = (nn.Linear(4, 3) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            hint = self.teacher(x).mean()
        shift = self.frozen_path(x).detach().mean() + self.index.weight.argmax()
        return self.out(F.relu(self.body(x))) + hint + shift


class Step(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, amp: bool = False) -> None:
        super().__init__()
        self.model = model
        self.add_optimizer(optimizer)
        if amp:
            self.config.enable_amp(True)

    def build(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x).float(), y)
        loss.backward()
        return loss


OPTIMIZERS = {
    "sgd-momentum-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adam-wd-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, amsgrad=True),
    "rmsprop-wd": lambda p: torch.optim.RMSprop(p, lr=0.01, weight_decay=0.1),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_parameters_without_a_gradient_are_not_updated(make) -> None:
    torch.manual_seed(0)
    model = PartlyUsed()
    reference = copy.deepcopy(model)
    graph_optimizer, optimizer = make(model.parameters()), make(reference.parameters())
    graph = Step(model, graph_optimizer)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for _ in range(3):
        loss = graph(x, y)
        optimizer.zero_grad()
        expected = F.mse_loss(reference(x), y)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-5, rtol=1e-4, msg=name)
    # the optimizer's state covers the parameters eager's does (Adafactor keeps none)
    assert sorted(graph_optimizer.state_dict()["state"]) == sorted(optimizer.state_dict()["state"])


def test_under_amp_parameters_without_a_gradient_are_not_updated() -> None:
    """AMP traces with autograd off: the program is read instead (reached.from_program)."""
    torch.manual_seed(0)
    model = PartlyUsed()
    before = copy.deepcopy(model.state_dict())
    graph = Step(model, torch.optim.AdamW(model.parameters(), lr=0.01), amp=True)
    graph(torch.randn(8, 4), torch.randn(8, 2))
    for name, value in model.state_dict().items():
        moved = not torch.equal(value, before[name])
        assert moved == name.startswith(("body.", "out.")), name


def test_from_program_follows_only_differentiable_paths() -> None:
    """Before/after on an exported program: a parameter read through zeros_like, an integer or
    stop_gradient (a detach) is not reached; one read through any float op is."""

    class Paths(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Parameter(torch.randn(3)) for _ in range(4))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = (x * self.a).sum() + torch.zeros_like(self.b).sum() + self.b.new_ones(2).sum() + self.c.argmax() \
                + self.d.detach().sum()
            return (self.d * 2, loss)

    exported = torch.export.export(Paths(), (torch.randn(3),), strict=False)
    tvmgraph.stop_gradient.mark(exported)
    assert reached.from_program(exported) == {"a"}


def test_a_loss_that_reaches_no_parameter_is_an_error() -> None:
    model = nn.Linear(4, 2)

    class NoGradLoss(tvmgraph.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = self.model(x).detach().pow(2).mean().requires_grad_()
            loss.backward()
            return loss

    with pytest.raises(OptimizerError, match=r"NoGradLoss_\d+: the loss build\(\) called backward\(\) on depends on "
                                             r"no parameter the optimizers update"):
        NoGradLoss()(torch.randn(3, 4))


def test_backward_with_inputs_updates_only_those_parameters() -> None:
    """`loss.backward(inputs=[...])`: eager gives only the listed parameters a gradient (the
    others keep None and the optimizer skips them); the graph updated every parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)

    def loss_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        loss = m(x).pow(2).mean()
        loss.backward(inputs=list(m[2].parameters()))
        return loss

    class HeadOnly(tvmgraph.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1))

        def build(self, x: torch.Tensor) -> torch.Tensor:
            return loss_of(self.model, x)

    graph, optimizer = HeadOnly(), torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for _ in range(2):
        x = torch.randn(8, 4)
        graph(x)
        optimizer.zero_grad(set_to_none=True)
        loss_of(reference, x)
        optimizer.step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5, msg=name)
    assert torch.equal(model[0].weight, reference[0].weight)  # never moved, as in eager


def test_inference_mode_in_build_stops_the_gradient_as_no_grad() -> None:
    """`torch.inference_mode()` (a context and a decorator) in build(): export recorded nothing,
    and the graph differentiated through it (0.05 off after one step)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    reference = copy.deepcopy(model)

    @torch.inference_mode()
    def teacher(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x)

    def loss_of(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            target = m(x)
        return (m(x) * target.clone() + m(x) * teacher(m, x).clone()).mean()

    class Step(tvmgraph.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x: torch.Tensor) -> torch.Tensor:
            loss = loss_of(self.model, x)
            loss.backward()
            return loss

    graph, optimizer = Step(), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(8, 4)
        graph(x)
        optimizer.zero_grad()
        loss_of(reference, x).backward()
        optimizer.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)

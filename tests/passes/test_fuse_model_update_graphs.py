"""FuseModelUpdate on small training graphs, against eager torch: one parameter (a group
whose kernel has a single result), 0-d parameters, parameters used directly in build(), and
gradients that are an input or a simple function of one. Every option is on (the default
config); each graph trains 4 steps and its losses and parameters equal eager's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import tvmgraph
from tests.conftest import TrainGraph

STEP_TOL = dict(atol=2e-5, rtol=1e-4)
STEPS = 4

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1),
}


class Holder(nn.Module):
    """Parameters that build() reads directly, not through a module call: a matrix `p` and a
    0-d `t` (a learnable temperature)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 3))
        self.t = nn.Parameter(torch.tensor(1.5))


# id -> loss(holder, x), with x of shape (4, 3)
DIRECT: dict[str, Callable[[Holder, torch.Tensor], torch.Tensor]] = {
    "p_plus_c": lambda m, x: ((m.p + x) ** 2).mean(),
    "p_times_c": lambda m, x: ((m.p * x) ** 2).mean(),
    "relu_p": lambda m, x: (torch.relu(m.p) * x).pow(2).mean(),
    "p_sum": lambda m, x: (m.p.sum() * x).pow(2).mean(),
    "grad_is_the_input": lambda m, x: (m.p * x).sum(),              # dloss/dp = x
    "grad_is_twice_the_input": lambda m, x: (m.p * x).sum() * 2.0,  # dloss/dp = 2x
    "grad_is_the_parameter": lambda m, x: 0.5 * (m.p * m.p).sum() + x.sum(),  # dloss/dp = p
    "temperature_0d": lambda m, x: (torch.softmax(x / m.t, dim=-1) * x).sum(),
    "both_0d_and_matrix": lambda m, x: (torch.softmax(m.p * x / m.t, dim=-1) * x).sum(),
}


class DirectGraph(tvmgraph.nn.Graph):
    def __init__(self, holder: Holder, loss: Callable, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.holder = holder
        self.loss = loss
        self.add_optimizer(optimizer)

    def build(self, x):
        loss = self.loss(self.holder, x)
        loss.backward()
        return loss


def _trainable(case: str, holder: Holder) -> list[nn.Parameter]:
    """The parameters the loss reads (an unused one would have no gradient)."""
    if case == "temperature_0d":
        return [holder.t]
    if case == "both_0d_and_matrix":
        return [holder.p, holder.t]
    return [holder.p]


def _eager_steps(model: nn.Module, loss_of: Callable, optimizer: torch.optim.Optimizer, batches) -> list:
    losses = []
    for batch in batches:
        loss = loss_of(model, *batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _assert_same_run(losses, expected_losses, model: nn.Module, reference: nn.Module) -> None:
    for step, (loss, ref) in enumerate(zip(losses, expected_losses)):
        torch.testing.assert_close(loss, ref, **STEP_TOL, msg=lambda m, s=step: f"step {s}: {m}")
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **STEP_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(DIRECT), ids=list(DIRECT))
def test_parameters_read_in_build_train_like_eager(case: str, optimizer: str) -> None:
    """A parameter read directly in build() (and a 0-d one), trained STEPS steps with the
    fused in-place update: losses and parameters equal eager's."""
    holder = Holder()
    for param in holder.parameters():
        param.requires_grad_(False)
    for param in _trainable(case, holder):
        param.requires_grad_(True)
    reference = copy.deepcopy(holder)
    batches = [(torch.randn(4, 3),) for _ in range(STEPS)]
    graph = DirectGraph(holder, DIRECT[case], OPTIMIZERS[optimizer](_trainable(case, holder)))
    losses = [graph(x) for (x,) in batches]
    reference_optimizer = OPTIMIZERS[optimizer](_trainable(case, reference))
    expected = _eager_steps(reference, DIRECT[case], reference_optimizer, batches)
    _assert_same_run(losses, expected, holder, reference)


def _linear_probe() -> nn.Sequential:
    """A frozen feature layer and a classifier whose weight alone is trained."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model.requires_grad_(False)
    model[2].weight.requires_grad_(True)
    return model


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=list(OPTIMIZERS))
def test_linear_probe_with_one_trained_parameter_matches_eager(optimizer: str) -> None:
    """One trained parameter (with plain SGD its update kernel has a single result, which
    call_tir_inplace returns as a tensor, not a tuple): STEPS steps equal eager's."""
    model = _linear_probe()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(5, 6), torch.randint(0, 3, (5,))) for _ in range(STEPS)]
    trained = [p for p in model.parameters() if p.requires_grad]
    graph = TrainGraph(model, nn.CrossEntropyLoss(), OPTIMIZERS[optimizer](trained))
    losses = [graph(x, y) for x, y in batches]
    loss_of = lambda m, x, y: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    ref_trained = [p for p in reference.parameters() if p.requires_grad]
    expected = _eager_steps(reference, loss_of, OPTIMIZERS[optimizer](ref_trained), batches)
    _assert_same_run(losses, expected, model, reference)

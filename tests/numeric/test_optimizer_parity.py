"""Optimizer parity beyond one run in graph mode (test_optimizers.py, test_training.py cover the
update rules): a run moves between eager and graph mode through state dicts in torch's layout,
param groups added mid-run, and optimizers the graph cannot run."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import TrainGraph
from tests.models import mlp
from tests.numeric.test_training import STEP_TOL, assert_same_state, eager_step
from tvmgraph.errors import OptimizerError

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, amsgrad=True, weight_decay=1e-2),
    # Per-parameter state of different keys and shapes (factored for weights, whole for biases).
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=0.02, weight_decay=1e-2),
}


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(n)]


def assert_same_optimizer_state(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer) -> None:
    state, ref_state = opt.state_dict(), ref.state_dict()
    assert state["param_groups"] == ref_state["param_groups"]
    assert state["state"].keys() == ref_state["state"].keys()
    for index, values in ref_state["state"].items():
        assert state["state"][index].keys() == values.keys(), index
        for key, value in values.items():
            torch.testing.assert_close(state["state"][index][key], value, **STEP_TOL,
                                       msg=lambda m, i=index, k=key: f"state {i} {k}: {m}")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eager_graph_eager_through_state_dicts(name: str) -> None:
    """Two eager steps, two graph steps, two eager steps, each phase in fresh objects loaded from
    the previous phase's state dicts: the same parameters and optimizer state as six eager steps."""
    make_opt, loss_fn, data = OPTIMIZERS[name], nn.MSELoss(), batches(6)
    start = mlp((8, 16, 4))
    reference = copy.deepcopy(start)
    ref_opt = make_opt(reference.parameters())
    for x, y in data:
        eager_step(reference, loss_fn, [ref_opt], x, y)

    eager = copy.deepcopy(start)
    eager_opt = make_opt(eager.parameters())
    for x, y in data[:2]:
        eager_step(eager, loss_fn, [eager_opt], x, y)

    model = mlp((8, 16, 4))  # other weights: everything must come from the state dicts
    opt = make_opt(model.parameters())
    graph = TrainGraph(model, loss_fn, opt)
    graph.load_state_dict({"modules": {"model": eager.state_dict(), "loss_fn": {}},
                           "optimizers": [eager_opt.state_dict()], "lr_schedulers": [None], "step": 2})
    for x, y in data[2:4]:
        graph(x, y)
    saved = copy.deepcopy(graph.state_dict())
    assert saved["step"] == 4

    resumed = mlp((8, 16, 4))
    resumed.load_state_dict(saved["modules"]["model"])
    resumed_opt = make_opt(resumed.parameters())
    resumed_opt.load_state_dict(saved["optimizers"][0])  # torch's own layout
    for x, y in data[4:]:
        eager_step(resumed, loss_fn, [resumed_opt], x, y)
    assert_same_state(resumed, reference)
    assert_same_optimizer_state(resumed_opt, ref_opt)


def test_param_group_added_mid_run_recompiles() -> None:
    """optimizer.add_param_group between calls: the next call compiles a program that trains the
    new group too (never one that silently skips it), with the new group's own lr."""
    model, loss_fn, data = mlp((8, 16, 4)), nn.MSELoss(), batches(2)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference[0].parameters(), lr=0.1, momentum=0.9)
    graph = TrainGraph(model, loss_fn, opt)
    frozen = model[2].weight.detach().clone()
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": model[2].parameters(), "lr": 0.05})
            ref_opt.add_param_group({"params": reference[2].parameters(), "lr": 0.05})
        x, y = data[step % 2]
        torch.testing.assert_close(graph(x, y), eager_step(reference, loss_fn, [ref_opt], x, y), **STEP_TOL)
        assert_same_state(model, reference)
        if step == 1:
            assert torch.equal(model[2].weight, frozen)  # not in the optimizer yet
    assert not torch.equal(model[2].weight, frozen)
    assert_same_optimizer_state(opt, ref_opt)
    assert graph.num_compiled == 2


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_parameter_unfrozen_mid_run_takes_its_own_first_step(name: str) -> None:
    """model[2].weight frozen (requires_grad False) for two steps, then trained in the same
    group: its state starts at its own first step while the others' go on. SGD with dampening
    skips the dampening on a first step only: flagged per group, the other parameters skipped it
    too (0.9e-2 off eager at the third step)."""
    make_opt, loss_fn, data = OPTIMIZERS[name], nn.MSELoss(), batches(4)
    model = mlp((8, 16, 4))
    reference = copy.deepcopy(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    graph = TrainGraph(model, loss_fn, opt)
    for net in (model, reference):
        net[2].weight.requires_grad_(False)
    for step, (x, y) in enumerate(data):
        if step == 2:
            for net in (model, reference):
                net[2].weight.requires_grad_(True)
        torch.testing.assert_close(graph(x, y), eager_step(reference, loss_fn, [ref_opt], x, y), **STEP_TOL)
        assert_same_state(model, reference)
    assert_same_optimizer_state(opt, ref_opt)


def test_model_double_mid_run_casts_the_state_and_trains_on() -> None:
    """model.double() after two steps: the next call compiles a float64 program, whose state is
    in its parameters' dtype; the float32 momentum buffers are cast (as torch's
    Optimizer.load_state_dict casts state). It failed with an ExecutionError (a float32 buffer
    where the program expects float64). Eager keeps its float32 buffers: losses agree to 1e-6."""
    model, loss_fn, data = mlp((8, 16, 4)), nn.MSELoss(), batches(4)
    reference = copy.deepcopy(model)
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    graph = TrainGraph(model, loss_fn, opt)
    for step, (x, y) in enumerate(data):
        if step == 2:
            model.double(), reference.double()
        if step >= 2:
            x, y = x.double(), y.double()
        torch.testing.assert_close(graph(x, y), eager_step(reference, loss_fn, [ref_opt], x, y), atol=1e-6, rtol=1e-6)
    assert all(s["momentum_buffer"].dtype == torch.float64 for s in opt.state.values())
    assert graph.num_compiled == 2


class Lion(torch.optim.Optimizer):
    """A custom optimizer (sign of an interpolated momentum)."""

    def __init__(self, params, lr: float = 1e-4) -> None:
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.sign(), alpha=-group["lr"])


class ClippedSGD(torch.optim.SGD):
    """A subclass of a supported optimizer that changes its step."""

    def step(self, closure=None):
        for group in self.param_groups:
            torch.nn.utils.clip_grad_value_(group["params"], 0.1)
        return super().step(closure)


@pytest.mark.parametrize("make, message", [
    (lambda ps: torch.optim.LBFGS(ps), r"torch\.optim\.lbfgs\.LBFGS cannot be lowered into a graph; supported"),
    (lambda ps: torch.optim.SparseAdam(ps), r"torch\.optim\.sparse_adam\.SparseAdam cannot be lowered"),
    (lambda ps: Lion(ps), r"test_optimizer_parity\.Lion cannot be lowered into a graph; supported"),
    (lambda ps: ClippedSGD(ps, lr=0.1), r"test_optimizer_parity\.ClippedSGD cannot be lowered into a graph "
                                        r"\(it subclasses torch\.optim\.SGD, .*not an overridden step\(\)"),
], ids=["lbfgs", "sparse_adam", "custom", "sgd_subclass"])
def test_optimizer_the_graph_cannot_run_is_named(make, message: str) -> None:
    model = nn.Linear(4, 2)
    with pytest.raises(OptimizerError, match=rf"TrainGraph_\d+: add_optimizer\(\): .*{message}"):
        TrainGraph(model, nn.MSELoss(), make(model.parameters()))

"""Every torch lr scheduler drives a training graph exactly as it drives eager training, with one
compiled program: the graph reads `lr` (and the momentum or `betas[0]` that CyclicLR and
OneCycleLR cycle) from `param_groups` at every call, and steps `lr_sch` after each call.

All cases share one small MLP and two optimizer structures (SGD with momentum, Adam), so the
compiled cache serves every case after the first of each.
"""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler, swa_utils

from tests.conftest import TrainGraph
from tests.models import mlp
from tests.numeric.test_training import STEP_TOL, assert_same_state, eager_step
from tvmgraph.errors import OptimizerError

STEPS = 6
S = lr_scheduler

# name -> scheduler of an optimizer; every LRScheduler torch ships (checked below) but
# ReduceLROnPlateau, which needs a metric and has tests of its own.
SCHEDULERS = {
    "LambdaLR": lambda opt: S.LambdaLR(opt, lambda epoch: 1.0 / (epoch + 1)),
    "MultiplicativeLR": lambda opt: S.MultiplicativeLR(opt, lambda epoch: 0.8),
    "StepLR": lambda opt: S.StepLR(opt, step_size=2, gamma=0.5),
    "MultiStepLR": lambda opt: S.MultiStepLR(opt, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda opt: S.ConstantLR(opt, factor=0.5, total_iters=3),
    "LinearLR": lambda opt: S.LinearLR(opt, start_factor=0.2, total_iters=4),
    "ExponentialLR": lambda opt: S.ExponentialLR(opt, gamma=0.7),
    "PolynomialLR": lambda opt: S.PolynomialLR(opt, total_iters=5, power=2.0),
    "CosineAnnealingLR": lambda opt: S.CosineAnnealingLR(opt, T_max=5),
    "ChainedScheduler": lambda opt: S.ChainedScheduler(
        [S.ConstantLR(opt, factor=0.5, total_iters=2), S.ExponentialLR(opt, gamma=0.8)], optimizer=opt),
    "SequentialLR": lambda opt: S.SequentialLR(
        opt, [S.LinearLR(opt, start_factor=0.1, total_iters=2), S.ExponentialLR(opt, gamma=0.7)], milestones=[2]),
    # CyclicLR and OneCycleLR also cycle SGD's momentum and Adam's betas[0].
    "CyclicLR": lambda opt: S.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2,
                                       base_momentum=0.7, max_momentum=0.9),
    "OneCycleLR": lambda opt: S.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 2),
    "CosineAnnealingWarmRestarts": lambda opt: S.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=2),
    "SWALR": lambda opt: swa_utils.SWALR(opt, swa_lr=0.02, anneal_epochs=3),
}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99)),
}
# Momentum (or beta1) and lr: the hyperparameters a scheduler may change, compared every step.
WATCHED = ("lr", "momentum", "betas")


def torch_schedulers() -> set[str]:
    """Every public LRScheduler class of torch.optim.lr_scheduler and swa_utils."""
    return {name for module in (lr_scheduler, swa_utils) for name, cls in vars(module).items()
            if inspect.isclass(cls) and issubclass(cls, lr_scheduler.LRScheduler)
            and cls is not lr_scheduler.LRScheduler and not name.startswith("_")}


def test_every_torch_scheduler_is_covered() -> None:
    """A scheduler a new torch adds fails here until it is tested below."""
    assert torch_schedulers() == set(SCHEDULERS) | {"ReduceLROnPlateau"}


def watched(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: g[k] for k in WATCHED if k in g} for g in optimizer.param_groups]


def two_groups(model: nn.Sequential) -> list[dict]:
    """Two param groups with their own lr, so that per-group schedules are checked too."""
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.05}]


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(n)]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_scheduler_matches_eager_without_recompiling(scheduler: str, optimizer: str) -> None:
    model = mlp((8, 16, 4))
    reference = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[optimizer](two_groups(model)), OPTIMIZERS[optimizer](two_groups(reference))
    sch, ref_sch = SCHEDULERS[scheduler](opt), SCHEDULERS[scheduler](ref_opt)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, opt, lr_sch=sch)
    data = batches()
    seen = []
    for step in range(STEPS):
        x, y = data[step % len(data)]
        loss = graph(x, y)
        ref_loss = eager_step(reference, loss_fn, [ref_opt], x, y)
        ref_sch.step()
        torch.testing.assert_close(loss, ref_loss, **STEP_TOL, msg=lambda m: f"step {step} loss: {m}")
        assert_same_state(model, reference)
        assert watched(opt) == watched(ref_opt), f"step {step}"
        assert sch.get_last_lr() == ref_sch.get_last_lr()
        seen.append(watched(opt))
    assert graph.num_compiled == 1 and graph.step == STEPS
    assert len({str(s) for s in seen}) > 1, "the schedule never changed anything"
    if scheduler in ("CyclicLR", "OneCycleLR"):  # the cycled momentum reached the program too
        key = "momentum" if optimizer == "sgd" else "betas"
        assert len({str(s[0][key]) for s in seen}) > 1


def test_reduce_on_plateau_is_refused_by_add_optimizer() -> None:
    """The graph has no metric to give it: the user steps it with theirs (next test)."""
    model = mlp((8, 16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = S.ReduceLROnPlateau(opt)
    message = r"lr_sch=ReduceLROnPlateau\) cannot work.*plateau.step\(metric\) yourself"
    with pytest.raises(OptimizerError, match=message):
        TrainGraph(model, nn.MSELoss(), opt, lr_sch=plateau)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_reduce_on_plateau_stepped_by_the_user(optimizer: str) -> None:
    """plateau.step(metric) between calls: the next call trains with the reduced lr, no recompile."""
    model = mlp((8, 16, 4))
    reference = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[optimizer](model.parameters()), OPTIMIZERS[optimizer](reference.parameters())
    make = lambda o: S.ReduceLROnPlateau(o, mode="min", factor=0.5, patience=0, threshold=0.0)  # noqa: E731
    plateau, ref_plateau = make(opt), make(ref_opt)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, opt)
    data = batches()
    metrics = [1.0, 2.0, 0.5, 0.7, 0.9, 0.1]  # a "validation loss": worse at steps 1, 3 and 4
    for step, metric in enumerate(metrics):
        x, y = data[step % len(data)]
        graph(x, y)
        eager_step(reference, loss_fn, [ref_opt], x, y)
        plateau.step(metric)
        ref_plateau.step(metric)
        assert_same_state(model, reference)
        assert watched(opt) == watched(ref_opt), f"step {step}"
    assert opt.param_groups[0]["lr"] == pytest.approx(OPTIMIZERS[optimizer]([torch.zeros(1)]).defaults["lr"] / 8)
    assert graph.num_compiled == 1


def test_momentum_cycled_through_zero_keeps_two_programs() -> None:
    """SGD momentum switched between zero and non-zero changes the program (torch then keeps no
    momentum buffer up to date): the graph compiles one entry for each and reuses them."""
    model = mlp((8, 16, 4))
    reference = copy.deepcopy(model)
    make = lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=1, base_momentum=0.0,  # noqa: E731
                                max_momentum=0.9)
    opt, ref_opt = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](reference.parameters())
    sch, ref_sch = make(opt), make(ref_opt)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, opt, lr_sch=sch)
    for step, (x, y) in enumerate(batches(STEPS)):
        graph(x, y)
        eager_step(reference, loss_fn, [ref_opt], x, y)
        ref_sch.step()
        assert_same_state(model, reference)
        assert watched(opt) == watched(ref_opt), f"step {step}"
    assert graph.num_compiled == 2


def test_each_optimizer_steps_its_own_scheduler() -> None:
    """Two optimizers in one graph, each with its scheduler: the graph steps both after each call."""
    model = mlp((8, 16, 4))
    reference = copy.deepcopy(model)

    def make(m: nn.Sequential):
        sgd, adam = OPTIMIZERS["sgd"](m[0].parameters()), OPTIMIZERS["adam"](m[2].parameters())
        return (sgd, S.StepLR(sgd, step_size=2, gamma=0.5)), (adam, SCHEDULERS["OneCycleLR"](adam))

    pairs, ref_pairs = make(model), make(reference)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, pairs[0][0], lr_sch=pairs[0][1])
    graph.add_optimizer(pairs[1][0], lr_sch=pairs[1][1])
    for step, (x, y) in enumerate(batches(STEPS)):
        graph(x, y)
        eager_step(reference, loss_fn, [o for o, _ in ref_pairs], x, y)
        for _, ref_sch in ref_pairs:
            ref_sch.step()
        assert_same_state(model, reference)
        for (opt, _), (ref_opt, _) in zip(pairs, ref_pairs):
            assert watched(opt) == watched(ref_opt), f"step {step}"
    assert graph.num_compiled == 1


@pytest.mark.slow  # two programs of its own (other graph classes and shapes)
def test_docs_example_runs() -> None:
    """The examples of docs/training.md's "Learning-rate schedulers" section, in order."""
    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    section = text.split("## Learning-rate schedulers")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/training.md", "exec"), namespace)
    assert namespace["graph"].num_compiled == 1 and namespace["plateau"].last_epoch == 3

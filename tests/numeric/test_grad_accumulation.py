"""Gradient accumulation (set_gradient_accumulation_steps) equals eager accumulation, call for call.

Eager reference: the batch split on dim 0 into n micro-batches, each micro-batch's loss divided
by n and backpropagated, the summed gradients clipped (when a group asks), one optimizer step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tvmgraph
from tests.conftest import ModuleGraph, TrainGraph
from tests.models import SmallCNN, mlp
from tvmgraph.errors import ConfigError, MicroBatchError

# Ten calls of float32 training, each summing n micro-batch gradients whose kernels reassociate
# differently from MKL/oneDNN: rounding noise, far below a real difference (the loss moves >1e-2).
TOL = dict(atol=5e-5, rtol=2e-4)


def eager_accumulated_step(model, loss_fn, optimizer, x, y, steps):
    """One eager step over `steps` micro-batches; returns the micro-batch losses and outputs."""
    optimizer.zero_grad()
    losses, outputs = [], []
    for xs, ys in zip(x.chunk(steps), y.chunk(steps)):
        out = model(xs)
        loss = loss_fn(out, ys)
        (loss / steps).backward()
        losses.append(loss.detach())
        outputs.append(out.detach())
    for group in optimizer.param_groups:
        if "clip_grad_max_norm" in group:
            torch.nn.utils.clip_grad_norm_(group["params"], group["clip_grad_max_norm"],
                                           group.get("clip_grad_norm_type", 2.0))
    optimizer.step()
    return torch.stack(losses), torch.cat(outputs)


def assert_same_training_state(model, reference, optimizer, ref_optimizer) -> None:
    """Parameters, buffers (batch norm running stats, num_batches_tracked) and optimizer state."""
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), reference.parameters()):
        state, ref_state = optimizer.state[p], ref_optimizer.state[q]
        assert state.keys() == ref_state.keys()
        for key in state:
            torch.testing.assert_close(state[key].cpu(), ref_state[key].cpu(), **TOL, msg=lambda m, k=key: f"{k}: {m}")


def run_accumulated(model, make_optimizer, loss_fn, batches, steps, calls=10):
    """Train a copy eagerly and `model` in a graph with accumulation; compare after every call."""
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=3, gamma=0.5)
    graph = TrainGraph(model, loss_fn, optimizer, lr_sch=scheduler)
    graph.config.set_gradient_accumulation_steps(steps)
    for call in range(calls):
        x, y = batches[call % len(batches)]
        loss = graph(x, y)
        ref_losses, _ = eager_accumulated_step(reference, loss_fn, ref_optimizer, x, y, steps)
        ref_scheduler.step()
        torch.testing.assert_close(loss, ref_losses.mean(), **TOL, msg=lambda m: f"call {call} loss: {m}")
        assert_same_training_state(model, reference, optimizer, ref_optimizer)
    assert graph.num_compiled == 1 and graph.step == calls
    # The scheduler stepped once per call, not once per micro-batch.
    assert scheduler.last_epoch == calls
    assert optimizer.param_groups[0]["lr"] == pytest.approx(ref_optimizer.param_groups[0]["lr"])
    return graph


def batches_of(n: int, shape: tuple[int, ...], classes: int, batch: int):
    return [(torch.randn(batch, *shape), torch.randint(0, classes, (batch,))) for _ in range(n)]


OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    # The CNN's batch norm biases feeding another conv + batch norm have an exactly-zero gradient
    # (a per-channel shift is normalized away); both sides see only rounding noise (~1e-9) there,
    # which Adam would normalize to +-lr with its default eps. eps=1e-4 keeps noise at noise level.
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-4),
}


@pytest.mark.parametrize(("optimizer", "steps"), [("sgd_momentum", 4), ("adam", 3)])
def test_mlp_matches_eager_accumulation(optimizer: str, steps: int) -> None:
    run_accumulated(mlp(), OPTIMIZERS[optimizer], nn.CrossEntropyLoss(), batches_of(3, (32,), 10, 12), steps)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_cnn_batch_norm_matches_eager_accumulation(optimizer: str) -> None:
    """Batch norm normalizes each micro-batch by its own statistics and updates the running
    stats once per micro-batch, as in eager."""
    graph = run_accumulated(SmallCNN().train(), OPTIMIZERS[optimizer], nn.CrossEntropyLoss(),
                            batches_of(2, (3, 8, 8), 10, 8), steps=2)
    assert graph.model.features[1].num_batches_tracked.item() == 10 * 2


def test_clipping_applies_to_the_accumulated_gradient() -> None:
    def make(m):
        return torch.optim.SGD([{"params": list(m.parameters()), "clip_grad_max_norm": 0.05}], lr=0.1, momentum=0.9)

    run_accumulated(mlp(), make, nn.CrossEntropyLoss(), batches_of(2, (32,), 10, 8), steps=4, calls=4)


class LogitsGraph(tvmgraph.nn.Graph):
    """Returns the loss, the batched logits and a 0-d float output."""

    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(optimizer)

    def build(self, x, y):
        logits = self.model(x)
        loss = self.loss_fn(logits, y)
        loss.backward()
        return loss, logits, logits.detach().abs().max()


def test_outputs_concatenate_on_dim_0_and_scalars_average() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    graph = LogitsGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    graph.config.set_gradient_accumulation_steps(4)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    loss, logits, peak = graph(x, y)
    ref_losses, ref_logits = eager_accumulated_step(reference, nn.CrossEntropyLoss(), ref_optimizer, x, y, 4)
    assert logits.shape == (16, 10)
    torch.testing.assert_close(logits, ref_logits, **TOL)  # each micro-batch's logits, in order
    torch.testing.assert_close(loss, ref_losses.mean(), **TOL)
    micro_peaks = torch.stack([part.abs().max() for part in ref_logits.chunk(4)])
    torch.testing.assert_close(peak, micro_peaks.mean(), **TOL)
    # Compiled for one micro-batch (run 4 times, one after another); graph.trace keeps the full batch.
    micro_x = graph.lowered.mod["accumulate_grads"].params[0]
    assert [int(d) for d in micro_x.ty.shape] == [4, 32]
    full_x = graph.trace(x, y).lower().mod["main"].params[0]
    assert [int(d) for d in full_x.ty.shape] == [16, 32]


def test_indivisible_batch_is_an_error_naming_graph_argument_and_fix() -> None:
    model = mlp()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.set_gradient_accumulation_steps(4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MicroBatchError, match=rf"{graph.name}: argument 'x' has 10 rows on dim 0.*"
                                              rf"cannot split into 4 equal micro-batches.*multiple of 4.*\(2, 5, 10\)"):
        graph(torch.randn(10, 32), torch.randint(0, 10, (10,)))
    assert graph.num_compiled == 0 and graph.step == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_an_indivisible_batch_under_a_dynamic_batch_is_an_error_at_every_call() -> None:
    """The dynamic program was compiled at batch 8 (4 micro-batches of 2); a later batch of 10
    ran it on 4 x 2 rows, silently dropping two (the check ran at compile time only)."""
    model = mlp()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.set_gradient_accumulation_steps(4)
    graph.config.enable_dynamic_batch()
    graph(torch.randn(8, 32), torch.randint(0, 10, (8,)))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MicroBatchError, match=rf"{graph.name}: argument 'x' has 10 rows on dim 0"):
        graph(torch.randn(10, 32), torch.randint(0, 10, (10,)))
    assert graph.step == 1 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_accumulation_without_optimizer_is_a_config_error() -> None:
    graph = ModuleGraph(mlp())
    graph.config.set_gradient_accumulation_steps(2)
    with pytest.raises(ConfigError, match=rf"{graph.name}: set_gradient_accumulation_steps\(2\).*no optimizer"):
        graph(torch.randn(4, 32))


@pytest.mark.slow
def test_changing_steps_recompiles_and_one_step_keeps_train_step() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    entries = []
    for steps in (1, 2, 4, 2):
        graph.config.set_gradient_accumulation_steps(steps)
        loss = graph(x, y)
        ref_losses, _ = eager_accumulated_step(reference, nn.CrossEntropyLoss(), ref_optimizer, x, y, steps)
        torch.testing.assert_close(loss, ref_losses.mean(), **TOL, msg=lambda m, s=steps: f"steps={s}: {m}")
        assert_same_training_state(model, reference, optimizer, ref_optimizer)
        entries.append(graph.lowered.entry)
    assert graph.num_compiled == 3  # 1, 2, 4; the second 2 reuses its program
    assert entries == ["train_step", "accumulate_grads", "accumulate_grads", "accumulate_grads"]
    functions = {gv.name_hint for gv in graph.lowered.mod.get_global_vars()}
    assert {"accumulate_grads", "apply_update"} <= functions and "train_step" not in functions

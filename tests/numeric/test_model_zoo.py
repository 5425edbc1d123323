"""Models no one here wrote (tests/numeric/zoo.py): inference and 10 training steps against eager.

Inference runs in eval mode. Training runs in train mode with each model's usual optimizer
(SGD momentum + weight decay, or AdamW), the GPT with gradient clipping and a cosine schedule;
after every step the loss and every parameter and buffer must match eager's.

Training is compared with eager run in float64, each step from the graph's weights and buffers
(the references' optimizer states stay their own, so a wrong momentum or Adam state still
shows). Compared over a whole trajectory instead, ten float32 steps drift from float64 by about
1e-5 in an activation, and that decides discrete events: a pre-activation of -9e-6 in float64
was +5e-7 after tvmgraph's three ResNet-18 steps on an AVX2 Zen 3 (eager's: -1.1e-5), so one
ReLU let one gradient through and a filter moved by 7e-4; on the U-Net eager float32 itself
drifted by 2e-3. From the same weights one step differs by about 1e-7, too little to flip an
edge. A tensor may also pass by being no further from float64 than twice eager float32's
own distance (from the same weights), which a wrong gradient (moving parameters by more than
1e-3) is not.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import ModuleGraph, TrainGraph
from tests.numeric.test_training import eager_step
from tests.numeric.zoo import ZOO, GPT, ZooEntry

# Inference: one forward pass, float32 kernels that sum in another order than MKL/oneDNN.
INFER_TOL = dict(atol=1e-4, rtol=1e-4)
# Against a float64 reference, one float32 step from the same weights stays within ~1e-6; a
# wrong gradient moves parameters by more than 1e-3.
ZOO_STEP_TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True], ids=["", "frozen"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_inference_matches_eager(name: str, frozen: bool) -> None:
    """Eval-mode outputs of the graph equal eager's, also with its weights packed once
    (enable_frozen_weights): twice, the second call reading the packed weights again."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make().eval()
    x, _ = entry.batch(torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    graph = ModuleGraph(model)
    graph.config.enable_frozen_weights(frozen)
    for _ in range(2 if frozen else 1):
        torch.testing.assert_close(graph(x), expected, **INFER_TOL)


def _optimizers(entry: ZooEntry, name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "gpt_tied":  # OneFlow-style clipping inside the step
        return torch.optim.AdamW([{"params": list(model.parameters()), "clip_grad_max_norm": 1.0}],
                                 lr=3e-3, weight_decay=0.01)
    return entry.optimizer(model)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_training_matches_eager(name: str) -> None:
    """Ten training steps: the loss and every parameter and buffer after each step equal eager's."""
    assert_zoo_trains_as_in_eager(name, torch.device("cpu"), steps=10)


def assert_zoo_trains_as_in_eager(name: str, device: torch.device, steps: int) -> None:
    """`steps` training steps of ZOO[name] on `device`, each checked against eager float64 and
    float32 on the same device taken from the graph's weights (the module docstring)."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make().train().to(device)
    reference = copy.deepcopy(model).double()
    if isinstance(model, GPT):  # deepcopy keeps the tie; check it so the test means what it says
        assert reference.head.weight is reference.tok.weight
    eager32 = copy.deepcopy(model)
    optimizers = [_optimizers(entry, name, m) for m in (model, reference, eager32)]
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10) for o in optimizers]
    graph = TrainGraph(model, entry.loss, optimizers[0], lr_sch=schedules[0])
    g = torch.Generator().manual_seed(2)
    batches = [tuple(t.to(device) for t in entry.batch(g)) for _ in range(3)]
    for step in range(steps):
        x, y = batches[step % len(batches)]
        for other in (reference, eager32):  # this step from the graph's weights (module docstring)
            other.load_state_dict(model.state_dict())
        loss = graph(x, y)
        ref_loss = eager_step(reference, entry.loss, [optimizers[1]], _double(x), y)
        loss32 = eager_step(eager32, entry.loss, [optimizers[2]], x, y)
        for schedule in schedules[1:]:
            schedule.step()
        _assert_step_close(loss, ref_loss, loss32, f"step {step} loss")
        for (key, got), want, got32 in zip(model.state_dict().items(), reference.state_dict().values(),
                                          eager32.state_dict().values()):
            assert got.device.type == device.type, f"step {step} {key} left {device} for {got.device}"
            _assert_step_close(got, want, got32, f"step {step} {key}")
    assert graph.num_compiled == 1


def _assert_step_close(got: torch.Tensor, want: torch.Tensor, eager32: torch.Tensor, what: str) -> None:
    """`got` within ZOO_STEP_TOL of the float64 `want`, or no further from it than twice eager
    float32 (`eager32`) is (see the module docstring)."""
    if not want.is_floating_point():
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
        return
    try:
        torch.testing.assert_close(got, want.float(), **ZOO_STEP_TOL)
    except AssertionError as error:
        ours = (got.double() - want).abs().max().item()
        eagers = (eager32.double() - want).abs().max().item()
        assert ours <= 2 * eagers, f"{what}: {ours:.3g} from float64 (eager float32: {eagers:.3g})\n{error}"


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t

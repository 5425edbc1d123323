"""Models no one here wrote (tests/numeric/zoo.py): inference and 10 training steps against eager.

Inference runs in eval mode. Training runs in train mode with each model's usual optimizer
(SGD momentum + weight decay, or AdamW), the GPT with gradient clipping and a cosine schedule;
after every step the loss and every parameter and buffer must match eager's.

Training is compared with eager run in float64 on the same weights: over ten steps eager's own
float32 drifts from it by up to 2e-3 on the U-Net (its conv kernels round differently), while
tvmgraph's float32 stays within 3e-7 of it, so float32 eager would be the noisier reference.
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
# Against a float64 reference, ten float32 steps stay within ~1e-6; a wrong gradient moves
# parameters by more than 1e-3.
ZOO_STEP_TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_inference_matches_eager(name: str) -> None:
    """Eval-mode outputs of the graph equal eager's."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make().eval()
    x, _ = entry.batch(torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(ModuleGraph(model)(x), expected, **INFER_TOL)


def _optimizers(entry: ZooEntry, name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "gpt_tied":  # OneFlow-style clipping inside the step
        return torch.optim.AdamW([{"params": list(model.parameters()), "clip_grad_max_norm": 1.0}],
                                 lr=3e-3, weight_decay=0.01)
    return entry.optimizer(model)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_training_matches_eager(name: str) -> None:
    """Ten training steps: the loss and every parameter and buffer after each step equal eager's."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.make().train()
    reference = copy.deepcopy(model).double()
    if isinstance(model, GPT):  # deepcopy keeps the tie; check it so the test means what it says
        assert reference.head.weight is reference.tok.weight
    optimizer, ref_optimizer = _optimizers(entry, name, model), _optimizers(entry, name, reference)
    schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10) for o in (optimizer, ref_optimizer)]
    graph = TrainGraph(model, entry.loss, optimizer, lr_sch=schedules[0])
    g = torch.Generator().manual_seed(2)
    batches = [entry.batch(g) for _ in range(3)]
    for step in range(10):
        x, y = batches[step % len(batches)]
        loss = graph(x, y)
        ref_loss = eager_step(reference, entry.loss, [ref_optimizer], _double(x), y)
        schedules[1].step()
        torch.testing.assert_close(loss, ref_loss.float(), **ZOO_STEP_TOL, msg=lambda m: f"step {step} loss: {m}")
        for (key, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
            want = want.float() if want.is_floating_point() else want
            torch.testing.assert_close(got, want, **ZOO_STEP_TOL, msg=lambda m: f"step {step} {key}: {m}")


def _double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t

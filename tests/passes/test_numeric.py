"""The memory and cast-scale passes keep results equal to torch (CPU, LLVM).

StraightenBindings and CompressMemory change when kernels run and where their results live, not
what they compute: a graph with them equals the same graph without them bit for bit, and both
equal eager torch within float32 tolerance. FuseCastScale computes a cast and a scale in one
kernel, exactly as torch does in two.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import tvm
from torch import nn
from tvm import relax

from tests.conftest import ModuleGraph, TrainGraph, assert_close
from tests.models import SmallCNN, mlp

STEP_TOL = dict(atol=2e-5, rtol=1e-4)


def _train(model: nn.Module, batches, memory_passes: bool = True,
           caplog: pytest.LogCaptureFixture | None = None) -> tuple[list[torch.Tensor], TrainGraph]:
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    graph.config.enable_straighten_algorithm(memory_passes)
    graph.config.enable_compress_memory(memory_passes)
    if caplog is not None:
        graph.debug(1)
    return [graph(x, y) for x, y in batches], graph


def _eager(model: nn.Module, batches) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = nn.CrossEntropyLoss()(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.slow
def test_cnn_training_with_memory_passes_matches_eager(caplog: pytest.LogCaptureFixture) -> None:
    """A BatchNorm/ReLU6/depthwise CNN trained 3 steps: losses and every parameter, buffer and
    momentum equal eager's; both passes report what they did (the straightened order lowers
    the peak, the arena beats StaticPlanBlockMemory and some kernels run in place)."""
    batches = [(torch.randn(8, 3, 12, 12), torch.randint(0, 10, (8,))) for _ in range(3)]
    model = SmallCNN().train()
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        losses, _ = _train(model, batches, caplog=caplog)
    for step, (loss, ref) in enumerate(zip(losses, _eager(reference, batches))):
        torch.testing.assert_close(loss, ref, **STEP_TOL, msg=lambda m, s=step: f"step {s}: {m}")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, **STEP_TOL, msg=lambda m, n=name: f"{n}: {m}")
    text = caplog.text
    assert "StraightenBindings: peak live memory train_step" in text
    assert "CompressMemory: memory planned:" in text and "train_step" in text
    line = next(s for s in text.splitlines() if "CompressMemory" in s)
    assert "kept" not in line.split("train_step")[1].split(";")[0]


def test_memory_passes_change_no_bit() -> None:
    """The MLP trained 3 steps with and without StraightenBindings and CompressMemory: the same
    losses and parameters, bit for bit."""
    batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(3)]
    model = mlp()
    twin = copy.deepcopy(model)
    with_passes, _ = _train(model, batches)
    without, _ = _train(twin, batches, memory_passes=False)
    assert all(torch.equal(a, b) for a, b in zip(with_passes, without))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_inference_with_memory_passes_matches_eager() -> None:
    """Inference of the CNN (eval mode) with in-place kernels and an arena equals eager."""
    model = SmallCNN().eval()
    x = torch.randn(4, 3, 12, 12)
    graph = ModuleGraph(model)
    with torch.no_grad():
        assert_close(graph(x), model(x))


class CastScale(nn.Module):
    """Loss scaling in float64: both cast-and-scale forms, one cast also used elsewhere."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wide = x.to(torch.float64)
        return wide * scale, 0.5 * x.to(torch.float64), wide + 1.0


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_cast_scale_matches_torch(fuse: bool, caplog: pytest.LogCaptureFixture) -> None:
    """float32 -> float64 casts scaled by a 0-d tensor and by a constant: equal to torch; fused,
    one kernel is reported (the cast that `wide + 1.0` also reads is left alone)."""
    x, scale = torch.randn(4, 8), torch.tensor(1024.0, dtype=torch.float64)
    graph = ModuleGraph(CastScale())
    graph.config.allow_fuse_cast_scale(fuse)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        outputs = graph(x, scale)
    for out, ref in zip(outputs, CastScale()(x, scale)):
        assert_close(out, ref)
    assert ("FuseCastScale: 1 cast + scale kernel(s)" in caplog.text) is fuse


def training_step_module() -> tvm.IRModule:
    """The MLP training step in the form CompressMemory sees (after CallTIRRewrite)."""
    from relay_passes.fuse_model_update import FuseModelUpdate
    from relay_passes.lower_call_tir_with_grad import LowerCallTIRWithGrad
    from relay_passes.straighten import StraightenBindings

    model = mlp()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    graph(torch.randn(16, 32), torch.randint(0, 10, (16,)))
    T = relax.transform
    with tvm.target.Target({"kind": "llvm"}):
        return tvm.transform.Sequential([
            FuseModelUpdate(), T.InlinePrivateFunctions(), LowerCallTIRWithGrad(), T.LegalizeOps(),
            T.AnnotateTIROpPattern(), T.FuseOps(), T.FuseTIR(), StraightenBindings(report=lambda m: None),
            T.RewriteDataflowReshape(), T.ToNonDataflow(), T.RemovePurityChecking(), T.CallTIRRewrite(),
        ])(graph.lowered.mod)


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed", "kept"])
def test_recompute_attention_matches_eager(recompute: bool, caplog: pytest.LogCaptureFixture) -> None:
    """An encoder block (torch's multi-head attention) trained 3 steps, attention probabilities
    recomputed in the backward pass or kept: equal to eager; the pass says so.

    SGD, not Adam: the key projection's bias has an exact zero gradient (softmax ignores a
    constant per row), and Adam would scale both sides' rounding noise there up to lr."""
    from tests.models import EncoderBlock

    torch.manual_seed(0)
    model = EncoderBlock()
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    graph.config.enable_recompute_attention(recompute)
    graph.debug(1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    batches = [(torch.randn(2, 6, 32), torch.randn(2, 6, 32)) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        for x, y in batches:
            loss = graph(x, y)
            ref_loss = nn.functional.mse_loss(reference(x), y)
            ref_optimizer.zero_grad()
            ref_loss.backward()
            ref_optimizer.step()
            torch.testing.assert_close(loss, ref_loss.detach(), **STEP_TOL)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **STEP_TOL)
    assert ("RecomputeAttention: 1 attention(s) recomputed in the backward pass" in caplog.text) is recompute

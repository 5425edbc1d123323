"""The CUDA paths on a GPU, against eager PyTorch on the same GPU: inference, training steps,
float16 AMP with a grad scaler, a saved graph loaded and run, and MetaSchedule tuning with the
XGBoost cost model. Skipped where torch sees no GPU (CI has none; run them where one is lent:
docs/benchmarks.md, "CUDA"). The compile-only CUDA tests live beside the CPU ones."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import tvmgraph
from tests.conftest import ModuleGraph, TrainGraph, assert_close
from tests.models import EncoderBlock, SmallCNN, mlp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")
# TVM's GPU kernels sum in float32 in another order than cuBLAS/cuDNN (kept off TF32 by
# conftest.py): the CPU tests' float32 tolerance, loosened 10x for the longer reductions of a step.
STEP_TOL = dict(atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("make, shape", [(lambda: mlp(), (16, 32)),
                                         (lambda: SmallCNN(), (4, 3, 16, 16)),
                                         (lambda: EncoderBlock(), (2, 8, 32))],
                         ids=["mlp", "cnn", "encoder"])
def test_inference_matches_eager(make, shape) -> None:
    model = make().to(CUDA).eval()
    x = torch.randn(*shape, device=CUDA)
    graph = ModuleGraph(model)
    out = graph(x)
    assert out.device == x.device
    with torch.no_grad():
        assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    assert_close(graph(x + 1), model(x + 1).detach(), atol=1e-4, rtol=1e-4)


def _train_side_by_side(model, make_optimizer, x, y, steps=5):
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer)
    for _ in range(steps):
        loss = graph(x, y)
        ref_optimizer.zero_grad()
        ref_loss = nn.functional.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_optimizer.step()
        assert_close(loss, ref_loss.detach(), **STEP_TOL)
    assert graph.num_compiled == 1
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.device == x.device, name
        assert_close(p.detach(), q.detach(), **STEP_TOL)
    return graph, model, reference


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_training_matches_eager(optimizer) -> None:
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
            "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2)}[optimizer]
    x, y = torch.randn(32, 32, device=CUDA), torch.randint(0, 10, (32,), device=CUDA)
    _train_side_by_side(mlp().to(CUDA), make, x, y)


def test_cnn_training_with_batch_norm_matches_eager() -> None:
    """Batch statistics, their running averages and the convolution gradients, on the GPU."""
    x, y = torch.randn(8, 3, 16, 16, device=CUDA), torch.randint(0, 10, (8,), device=CUDA)
    _, model, reference = _train_side_by_side(
        SmallCNN().to(CUDA), lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), x, y, steps=3)
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            assert_close(buffer, dict(reference.named_buffers())[name], **STEP_TOL)


def test_depthwise_and_pointwise_weight_gradients_match_eager() -> None:
    """Weight gradients summed over 16 * 32 * 32 pixels with few weights each (depthwise 3x3,
    1x1, a 3x3 stem): one thread block per weight, warp-shuffle sums (LongReduction)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.ReLU(),
                          nn.Conv2d(32, 64, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(64, 10)).to(CUDA)
    x, y = torch.randn(16, 3, 32, 32, device=CUDA), torch.randint(0, 10, (16,), device=CUDA)
    _train_side_by_side(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), x, y, steps=3)


def test_profile_times_the_kernels_on_the_gpu() -> None:
    """graph.profile on CUDA waits for each kernel: the kernels' times add up to at least most
    of a call that the GPU's work dominates (a launch alone takes microseconds; unsynchronized,
    the table timed launches). No upper bound: each wait adds its own microseconds, which
    outweigh a small graph's kernels (an H100 ran a batch of 256 in 0.4 ms; 3x was too tight)."""
    graph = ModuleGraph(SmallCNN().to(CUDA).eval())
    profile = graph.profile(torch.randn(1024, 3, 32, 32, device=CUDA))
    assert profile.limits is None and profile.kernels
    assert profile.kernel_seconds >= 0.5 * profile.call_seconds, profile.table()


def test_float16_amp_with_grad_scaler_matches_eager() -> None:
    """torch.autocast's CUDA default (float16) and dynamic loss scaling inside the step: losses
    and scales step for step against eager autocast + GradScaler, an overflow skipped by both.
    (The loss was once rounded to float16, so the seed 65536 overflowed and the graph skipped
    its first step: CUDA autocast's float32 log_softmax is `_log_softmax(x, dim, half_to_float)`.)"""
    model = mlp().to(CUDA)
    reference = copy.deepcopy(model)
    # SGD: Adam's first steps move a parameter with a near-zero gradient by +-lr whichever way
    # rounding tips it, which hides what this test compares.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer)
    graph.config.enable_amp(True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=3)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16, growth_interval=3)
    graph.set_grad_scaler(scaler)
    x, y = torch.randn(16, 32, device=CUDA), torch.randint(0, 10, (16,), device=CUDA)
    for step in range(10):
        inputs = x * 1e5 if step == 4 else x  # float16 overflows: both skip the step
        loss = graph(inputs, y)
        with torch.autocast("cuda", torch.float16):
            ref_loss = nn.functional.cross_entropy(reference(inputs), y)
        ref_optimizer.zero_grad()
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.step(ref_optimizer)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale(), step
        if torch.isfinite(ref_loss):
            assert_close(loss, ref_loss.detach().float(), atol=1e-2, rtol=1e-2)
    assert graph.num_compiled == 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == torch.float32  # master weights
        # float16 gradients (a relative step of 2**-11) summed in another order, over 9 momentum
        # steps: on an H200, 5 of 4096 weights moved apart by up to 3.5e-3.
        assert_close(p.detach(), q.detach(), atol=5e-3, rtol=5e-3)


def test_float16_amp_encoder_matches_eager() -> None:
    """Attention, layer norm and GELU under CUDA float16 autocast (softmax in float32 by
    autocast's policy): losses and parameters step for step against eager."""
    model = EncoderBlock().to(CUDA)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    graph = TrainGraph(model, nn.MSELoss(), optimizer)
    graph.config.enable_amp(True)
    x, y = torch.randn(4, 16, 32, device=CUDA), torch.randn(4, 16, 32, device=CUDA)
    for step in range(5):
        loss = graph(x, y)
        with torch.autocast("cuda", torch.float16):
            ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_optimizer.zero_grad()
        ref_loss.backward()
        ref_optimizer.step()
        assert loss.dtype == torch.float32
        assert_close(loss, ref_loss.detach().float(), atol=1e-2, rtol=1e-2)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("built_here", [True, False], ids=["host", "cuda-target"])
def test_saved_graph_loads_and_runs_on_the_gpu(tmp_path: Path, built_here: bool) -> None:
    """tvmgraph.save from a graph that ran on the GPU (target "host"), and a cross-build from CPU
    inputs (target "cuda", as `tvmgraph export` does on a machine with no GPU): both load here
    and compute eager's numbers."""
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 16, 16)
    if built_here:
        out_dir = tvmgraph.save(ModuleGraph(model.to(CUDA)), tmp_path / "g", example_args=(x.to(CUDA),))
    else:
        out_dir = tvmgraph.save(ModuleGraph(model), tmp_path / "g", example_args=(x,), target="cuda",
                                arch="sm_{}{}".format(*torch.cuda.get_device_capability()))
        model = model.to(CUDA)
    loaded = tvmgraph.load(out_dir)
    out = loaded(x.to(CUDA))
    with torch.no_grad():
        assert_close(torch.as_tensor(out).to(CUDA), model(x.to(CUDA)), atol=1e-4, rtol=1e-4)


def test_tuning_on_the_gpu_is_applied_and_keeps_eager_numbers(tmp_path: Path) -> None:
    """MetaSchedule measures CUDA candidates on this GPU (XGBoost cost model); a new graph of
    the same name compiles with the log and still computes eager's numbers."""
    import autotune.log

    class GpuMLP(ModuleGraph):
        pass

    model = mlp((256, 512, 512, 10)).to(CUDA).eval()
    x = torch.randn(64, 256, device=CUDA)
    report = tvmgraph.tune(GpuMLP(model), x, trials=32, log_dir=tmp_path)
    print(report.table())
    assert "cuda" in report.target
    assert report.trials >= 32 and report.kernels
    assert report.graph_untuned_ms > 0 and report.graph_tuned_ms > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune.log, "tuning_root", lambda: tmp_path)
        with torch.no_grad():
            assert_close(GpuMLP(model)(x), model(x), atol=1e-4, rtol=1e-4)

"""graph.profile: each kernel's time, FLOPs and bytes, against the machine's limits (tvmgraph/profile.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tvmgraph
import tvmgraph.hardware
from tests.conftest import ModuleGraph, TrainGraph
from tests.models import mlp
from tvmgraph.hardware import Limits
from tvmgraph.profile import RUNTIME, KernelTime

# A made-up machine: 100 GFLOP/s, 10 GB/s, so the ridge is at 10 FLOP per byte.
MACHINE = Limits("test CPU", 2, 100.0, 10.0)


@pytest.fixture(autouse=True)
def _no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tvmgraph.hardware, "limits", lambda remeasure=False: MACHINE)


def test_inference_profile_counts_each_kernel_once_with_its_flops() -> None:
    torch.manual_seed(0)
    model = mlp((64, 128, 10))
    report = ModuleGraph(model).profile(torch.randn(32, 64), repeat=3)
    names = [k.name for k in report.kernels]
    assert len(names) == len(set(names))
    assert RUNTIME in names
    # The first layer's matmul + bias + ReLU: 2*M*N*K multiply-adds plus the bias and the ReLU.
    first = [k for k in report.kernels if k.flops >= 2 * 32 * 64 * 128]
    assert first, report.table(None)
    assert 2 * 32 * 64 * 128 <= first[0].flops <= 2 * 32 * 64 * 128 * 1.05
    # its arguments: x, the weight, the bias and the output, read or written once each
    assert first[0].bytes == 4 * (32 * 64 + 128 * 64 + 128 + 32 * 128)
    assert all(k.seconds > 0 and k.calls >= 1 for k in report.kernels)
    assert report.call_seconds > 0 and report.limits is MACHINE
    text = str(report)
    assert report.graph in text and "test CPU" in text and first[0].name[:20] in text


def test_dynamic_batch_kernels_are_counted_at_the_batch_they_ran() -> None:
    """A dynamic-batch graph's kernels have a symbolic batch; counted at the call's shapes, the
    FLOPs of one call are the static graph's (counted once per symbolic loop, they were 32x too
    few here, and the profile showed 0.1 GFLOP/s kernels)."""
    torch.manual_seed(0)
    model = mlp((64, 128, 10))
    x = torch.randn(32, 64)
    static = ModuleGraph(model).profile(x, repeat=1)
    graph = ModuleGraph(model)
    graph.config.enable_dynamic_batch()
    dynamic = graph.profile(x, repeat=1)
    total = lambda report: sum(k.flops for k in report.kernels)  # noqa: E731
    assert total(static) >= 2 * 32 * 64 * 128
    assert total(dynamic) == pytest.approx(total(static), rel=0.02)


def test_limit_share_is_fma_above_the_ridge_and_bandwidth_below() -> None:
    compute = KernelTime("mm", 1, 1e-3, flops=5e7, bytes=1_000_000)   # 50 FLOP/B, 50 GFLOP/s
    memory = KernelTime("add", 1, 1e-3, flops=1e6, bytes=5_000_000)    # 0.2 FLOP/B, 5 GB/s
    assert compute.limit_share(MACHINE) == pytest.approx((0.5, "FMA"))
    assert memory.limit_share(MACHINE) == pytest.approx((0.5, "BW"))
    assert KernelTime(RUNTIME, 9, 1e-3, 0.0, 0).limit_share(MACHINE) is None
    assert compute.limit_share(None) is None


def test_training_profile_leaves_the_training_state_as_it_was() -> None:
    torch.manual_seed(0)
    model = mlp((16, 32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), optimizer, lr_sch=scheduler)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    graph(x, y)
    params = [p.detach().clone() for p in model.parameters()]
    exp_avg = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    lr, step, rng = optimizer.param_groups[0]["lr"], graph.step, torch.get_rng_state()

    report = graph.profile(x, y, repeat=2)

    assert any(k.name.startswith("update_0_adam") for k in report.kernels), report.table(None)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, optimizer.state[p]["exp_avg"]) for a, p in zip(exp_avg, model.parameters()))
    assert optimizer.param_groups[0]["lr"] == lr and graph.step == step
    assert torch.equal(torch.get_rng_state(), rng)
    assert graph.num_compiled == 1


def test_profile_needs_at_least_one_repeat() -> None:
    graph = ModuleGraph(mlp((4, 4)))
    with pytest.raises(ValueError, match=r"ModuleGraph_\d+: profile\(repeat=0\) needs repeat >= 1"):
        graph.profile(torch.randn(2, 4), repeat=0)


def test_measuring_the_limits_leaves_no_files_behind(tmp_path, monkeypatch) -> None:
    """The FMA / copy probe is compiled into a temporary directory, removed once the library is
    loaded (every run of benchmarks.peak left one in /tmp), and still measures."""
    from tvmgraph import hardware

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(hardware.tempfile, "tempdir", None)  # re-read TMPDIR
    hardware._library.cache_clear()
    try:
        assert hardware.fma_peak_gflops(seconds=0.01, repeats=1) > 0
        assert list(tmp_path.iterdir()) == []
    finally:
        hardware._library.cache_clear()


def _saved_limits(tmp_path, monkeypatch, fma_gflops: float):
    """limits() reading a hardware.json in `tmp_path` that holds `fma_gflops` for this machine."""
    import json

    import dataclasses

    from tvmgraph import config, hardware

    monkeypatch.setattr(config, "settings", dataclasses.replace(config.settings, cache_dir=tmp_path))
    saved = {"cpu": hardware.cpu_name(), "threads": hardware._library().threads(),
             "fma_gflops": fma_gflops, "bandwidth_gbs": 0.5}
    (tmp_path / "hardware.json").write_text(json.dumps(saved))
    return hardware


def test_a_peak_saved_on_a_busy_machine_is_measured_again(tmp_path, monkeypatch) -> None:
    """A saved FMA peak that a short FMA loop beats (one measured while tests ran) is not
    trusted: both limits are measured again and saved."""
    import json

    from tvmgraph import hardware

    monkeypatch.undo()  # the real limits(), not the made-up machine
    _saved_limits(tmp_path, monkeypatch, fma_gflops=0.001)
    hardware.limits.cache_clear()
    try:
        measured = hardware.limits()
    finally:
        hardware.limits.cache_clear()
    assert measured.fma_gflops > 0.001 and measured.bandwidth_gbs != 0.5
    assert json.loads((tmp_path / "hardware.json").read_text())["fma_gflops"] == measured.fma_gflops


def test_a_saved_peak_the_machine_does_not_beat_is_kept(tmp_path, monkeypatch) -> None:
    """A saved record at or above what the short loop reaches is used as saved: the copy
    bandwidth (seconds of streaming) is not measured again."""
    from tvmgraph import hardware

    monkeypatch.undo()
    _saved_limits(tmp_path, monkeypatch, fma_gflops=1e9)
    monkeypatch.setattr(hardware, "bandwidth_gbs", lambda *a, **k: pytest.fail("measured again"))
    hardware.limits.cache_clear()
    try:
        kept = hardware.limits()
    finally:
        hardware.limits.cache_clear()
    assert (kept.fma_gflops, kept.bandwidth_gbs) == (1e9, 0.5)


def test_a_cache_line_goes_between_two_cores_in_nanoseconds() -> None:
    """The round trip is between 10 ns and 100 us on two or more cores (a spinning pair that
    never met would hang or report nonsense), None on one."""
    import os

    from tvmgraph import hardware

    trip = hardware.core_round_trip_ns(rounds=20_000)
    if len(os.sched_getaffinity(0)) < 2:
        assert trip is None
    else:
        assert trip is not None and 10 < trip < 100_000


def test_the_round_trip_is_none_when_openmp_gives_one_thread() -> None:
    """With OMP_THREAD_LIMIT=1 the one thread would wait for a partner forever; it reports None."""
    import subprocess
    import sys

    code = "from tvmgraph import hardware; print(hardware.core_round_trip_ns(rounds=1000))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_THREAD_LIMIT": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "None"

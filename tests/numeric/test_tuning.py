"""The real search, small: MetaSchedule with the XGBoost cost model over a graph's kernels, the
`tvmgraph tune` command killed and resumed, two tuners on one log, measuring over TVM RPC.
(How compiles use a log is tested without searching in tests/unit/test_autotune.py.)"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

import tvmgraph
from autotune.log import TuningLog
from tests.conftest import TrainGraph, assert_close
from tests.unit.test_autotune import CPU, TunedMLP, mlp

REPO = Path(__file__).resolve().parents[2]
FACTORY = '''
import torch, tvmgraph
from torch import nn

class CliMLP(tvmgraph.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)

def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16)).eval()
    return CliMLP(model), (torch.randn(32, 64),)
'''


def test_xgboost_is_the_pinned_version() -> None:
    """MetaSchedule's XGBModel is checked against one xgboost release (STACK.md); the pin in
    pyproject.toml is what is installed."""
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(p for p in pins if p.startswith("xgboost-cpu=="))
    assert importlib.metadata.version("xgboost-cpu") == pin.split("==")[1]
    import xgboost

    assert xgboost.__version__ == pin.split("==")[1]


@pytest.mark.slow
def test_tune_measures_kernels_and_the_compile_uses_only_faster_ones(tmp_path: Path) -> None:
    """16 trials on the MLP: every record is in the log, each tuned kernel is used only where it
    beat its default schedule, and the tuned graph still computes eager's numbers."""
    graph, args = mlp()
    report = tvmgraph.tune(graph, *args, trials=16, log_dir=tmp_path)
    log = TuningLog.for_graph("TunedMLP", CPU, tmp_path)
    _, records, dropped = log.read()
    assert dropped == 0 and len(records) >= 16 and report.trials >= 16
    assert sum(k.trials for k in report.kernels) == len(records)
    for k in report.kernels:
        assert k.default_us is not None and k.default_us > 0
        assert k.use_tuned == (k.tuned_us is not None and k.tuned_us < 0.98 * k.default_us)
    assert report.graph_untuned_ms > 0 and report.graph_tuned_ms > 0
    assert report.enabled == (report.graph_tuned_ms <= report.graph_untuned_ms)
    assert "default µs" in report.table() and str(log.directory) in report.table()
    # The trials already in the log count: asking for as many again measures nothing new.
    again = tvmgraph.tune(graph, *args, trials=16, log_dir=tmp_path, check_graph=False)
    assert again.trials == 0 and len(log.read()[1]) == len(records)
    import autotune.log

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune.log, "tuning_root", lambda: tmp_path)
        fresh, _ = mlp()
        fresh.model.load_state_dict(graph.model.state_dict())
        with torch.no_grad():
            assert_close(fresh(*args), graph.model(*args))


@pytest.mark.slow
def test_a_training_graph_tunes_forward_backward_and_update_kernels(tmp_path: Path) -> None:
    """The kernels of train_step: the forward matmuls, their gradients (dX, dW) and the update."""
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    before = [p.detach().clone() for p in model.parameters()]
    report = tvmgraph.tune(graph, x, y, trials=16, log_dir=tmp_path, check_graph=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "tuning must not train"
    names = [k.name for k in report.kernels]
    assert len(report.kernels) + report.untuned_kernels >= 5, names
    assert any("matmul" in n for n in names)
    assert report.trials >= 16


class _Tuner:
    """`tvmgraph tune` in a subprocess, its output in files (a pipe nobody reads would block it)."""

    def __init__(self, *extra: str, log_dir: Path, script: Path, name: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.out_path, self.err_path = script.parent / f"{name}.out", script.parent / f"{name}.err"
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "tvmgraph.cli", "tune", f"{script}:factory",
                                             "--log-dir", str(log_dir), "--quiet", *extra], cwd=REPO, env=env,
                                            stdout=out, stderr=err, start_new_session=True)

    def wait(self, timeout: float = 1200) -> tuple[int, str, str]:
        rc = self.process.wait(timeout=timeout)
        return rc, self.out_path.read_text(), self.err_path.read_text()


def _records(log_dir: Path) -> list[str]:
    paths = list(log_dir.glob("CliMLP/*/database_tuning_record.json"))
    return paths[0].read_text().splitlines(keepends=True) if paths else []


@pytest.mark.slow
def test_tune_command_resumes_after_sigkill_and_plots(tmp_path: Path) -> None:
    """Killed with SIGKILL mid-search, a rerun keeps every record measured, measures only the
    trials still missing, and prints the kernel table; --plot draws the search."""
    script = tmp_path / "model.py"
    script.write_text(FACTORY)
    log_dir = tmp_path / "tuning"
    first = _Tuner("--trials", "200", log_dir=log_dir, script=script, name="first")
    deadline = time.monotonic() + 900
    while len([line for line in _records(log_dir) if line.endswith("\n")]) < 8:
        assert first.process.poll() is None, first.err_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "no record written in time"
        time.sleep(1)
    os.killpg(first.process.pid, signal.SIGKILL)  # the tuner and its build/run workers
    first.process.wait()
    kept = [line for line in _records(log_dir) if line.endswith("\n")]
    second = _Tuner("--trials", str(len(kept) + 8), "--plot", str(tmp_path / "tuning.png"),
                    log_dir=log_dir, script=script, name="second")
    rc, out, err = second.wait()
    assert rc == 0, err[-3000:]
    after = _records(log_dir)
    assert after[:len(kept)] == kept or [json.loads(a) for a in after[:len(kept)]] == [json.loads(k) for k in kept]
    measured = int(re.search(r"(\d+) trial\(s\) in", out).group(1))
    assert 1 <= measured <= 16 and len(after) == len(kept) + measured, out
    assert "default µs" in out and "tuned µs" in out and "graph CliMLP" in out
    assert (tmp_path / "tuning.png").stat().st_size > 1000


@pytest.mark.slow
def test_two_tuners_on_one_graph_name_do_not_corrupt_its_log(tmp_path: Path) -> None:
    """The second tuner waits for the first's lock, then finds the trials already measured."""
    script = tmp_path / "model.py"
    script.write_text(FACTORY)
    log_dir = tmp_path / "tuning"
    tuners = [_Tuner("--trials", "16", log_dir=log_dir, script=script, name=f"tuner{i}") for i in range(2)]
    results = [t.wait() for t in tuners]
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert sum("is being written by another tuner; waiting" in err for _, _, err in results) == 1
    lines = _records(log_dir)
    assert len(lines) >= 16 and all(json.loads(line) for line in lines)
    log = TuningLog(next(log_dir.glob("CliMLP/*")))
    assert log.read(warn=False)[2] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_tuning_measures_over_rpc(tmp_path: Path) -> None:
    """Candidates built here run on a device registered with a TVM RPC tracker (here a server
    on 127.0.0.1): the records carry measured times."""
    from autotune import RPCTarget

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    tracker = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port",
                                str(port), "--port-end", str(port + 1)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    server = None
    try:
        _wait_for_tracker(port)
        server_port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}",
                                   "--key", "tvmgraph-test", "--host", "127.0.0.1", "--port", str(server_port),
                                   "--port-end", str(server_port + 10)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_device(port, "tvmgraph-test")
        graph, args = mlp()
        report = tvmgraph.tune(graph, *args, trials=8, log_dir=tmp_path,
                               rpc=RPCTarget("127.0.0.1", port, "tvmgraph-test"))
        _, records, _ = TuningLog.for_graph("TunedMLP", CPU, tmp_path).read()
        assert records and any(math.isfinite(min(map(float, r.run_secs))) and float(r.run_secs[0]) < 1
                               for _, r in records)
        assert all(k.default_us is not None for k in report.kernels)
        assert report.graph_untuned_ms is None  # the whole-graph check runs on local targets only
    finally:
        for process in (server, tracker):
            if process is not None:
                process.kill()
                process.wait()


def _wait_for_tracker(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError("the RPC tracker did not start")


def _wait_for_device(port: int, key: str, timeout: float = 120) -> None:
    from tvm import rpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            summary = rpc.connect_tracker("127.0.0.1", port).summary()
            if any(key in str(q) for q in summary.get("queue_info", {}).keys()):
                return
        except Exception:  # noqa: BLE001  (the tracker is still starting)
            pass
        time.sleep(1)
    raise AssertionError(f"no RPC server registered as {key!r}")

"""TVM's thread count: set by `import tvmgraph`, whichever way a process reaches TVM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tvmgraph import threads

POOL_THREADS = "import tvm; print(tvm.get_global_func('runtime.NumThreads')())"


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "TVM_THREAD_POOL_SPIN_COUNT")}
    result = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True,
                            text=True, timeout=120, check=True)
    return result.stdout.strip()


def test_a_process_without_torch_runs_one_thread_per_physical_core() -> None:
    """A serving process (`tvmgraph.load` on numpy arrays) imports tvmgraph and TVM, not torch:
    TVM alone would run half the logical CPUs (one thread on a 2-core machine)."""
    cores, pool = _run("import sys, tvmgraph; from tvmgraph import threads; "
                       "assert 'torch' not in sys.modules; print(threads.physical_cores()); " + POOL_THREADS).split()
    assert int(pool) == int(cores)


def test_kernels_use_torchs_thread_count_when_torch_is_loaded() -> None:
    assert _run("import torch; torch.set_num_threads(1); import tvmgraph; " + POOL_THREADS) == "1"


def test_a_thread_count_the_user_exported_wins() -> None:
    assert _run("import tvmgraph; " + POOL_THREADS, TVM_NUM_THREADS="1") == "1"


def test_hyper_threads_of_one_core_count_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for cpu, core in enumerate([0, 1, 0, 1]):  # 4 logical CPUs, 2 cores with 2 threads each
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert threads.physical_cores(tmp_path) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})  # pinned to one core
    assert threads.physical_cores(tmp_path) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 7})  # no topology for CPU 7
    assert threads.physical_cores(tmp_path) == 2

"""CPU kernels run on torch's OpenMP threads (tvmgraph/openmp_launch.py), not on a second pool."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tvmgraph.openmp_launch import loaded_openmp_runtime

ROOT = Path(__file__).resolve().parents[2]  # the subprocess imports tests.conftest from here

# Runs a graph with parallel kernels right after an eager op, and reports how many threads the
# graph call added to the process and how far its result is from eager's.
CALL_AFTER_EAGER = r"""
import json, os, torch
from tests.conftest import ModuleGraph
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
graph = ModuleGraph(model)
x = torch.randn(128, 256)
with torch.no_grad():
    expected = model(x)  # eager: torch's OpenMP workers start here
before = len(os.listdir("/proc/self/task"))
got = graph(x)
got = graph(x)
print(json.dumps({"new_threads": len(os.listdir("/proc/self/task")) - before,
                  "max_error": (got - expected).abs().max().item()}))
"""


def _call_after_eager(cache: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "TVMGRAPH_OPENMP_THREADS")}
    run = lambda: subprocess.run([sys.executable, "-c", CALL_AFTER_EAGER], capture_output=True, text=True,
                                 timeout=300, check=True, cwd=ROOT, env={**clean, "TVMGRAPH_CACHE_DIR": str(cache),
                                                                         "OMP_NUM_THREADS": "2", **env})
    run()  # compiles into the cache; the second process only loads, so only the call can add threads
    return json.loads(run().stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_graph_call_adds_no_thread_pool_beside_torchs(tmp_path: Path) -> None:
    """The graph's parallel kernels run on the OpenMP workers the eager op started: the call adds no
    thread, and matches eager. With TVMGRAPH_OPENMP_THREADS=0 TVM starts its own pool (the check
    would see it), and without a C compiler for the launcher too; both still match eager."""
    shared = _call_after_eager(tmp_path / "shared")
    assert shared["new_threads"] == 0, shared
    assert shared["max_error"] < 1e-4, shared
    own_pool = _call_after_eager(tmp_path / "own", TVMGRAPH_OPENMP_THREADS="0")
    assert own_pool["new_threads"] >= 1, own_pool
    assert own_pool["max_error"] < 1e-4, own_pool
    no_compiler = _call_after_eager(tmp_path / "no-cc", CC="false")
    assert no_compiler["new_threads"] >= 1, no_compiler
    assert no_compiler["max_error"] < 1e-4, no_compiler


def test_the_openmp_runtime_is_found_in_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
                    "7f20-7f30 r-xp 00000000 08:01 13 /venv/site-packages/torch/lib/libgomp.so.1\n"
                    "7f40-7f50 rw-p 00000000 00:00 0 \n")
    assert loaded_openmp_runtime(maps) == "/venv/site-packages/torch/lib/libgomp.so.1"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
                    "7f40-7f50 rw-p 00000000 00:00 0 [heap]\n")
    assert loaded_openmp_runtime(maps) is None
    assert loaded_openmp_runtime(tmp_path / "missing") is None


@pytest.mark.parametrize("damage", [b"", b"\x7fELF garbage", b"not a library at all"], ids=["empty", "truncated", "foreign"])
def test_a_damaged_launcher_in_the_cache_is_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        damage: bytes) -> None:
    """A truncated or overwritten launcher file was loaded as it was, failed, and every later
    process ran on TVM's own pool with a warning to install a compiler (found by a sweep)."""
    from tvmgraph import config, openmp_launch

    monkeypatch.setattr(config, "settings", dataclasses.replace(config.settings, cache_dir=tmp_path))
    path = openmp_launch._built_launcher()
    path.write_bytes(damage)
    launcher = openmp_launch._loaded_launcher()
    assert launcher.tvmgraph_openmp_init is not None
    assert path.stat().st_size > 1000  # built again in place

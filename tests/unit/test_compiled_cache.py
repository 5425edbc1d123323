"""The persistent compiled cache: what the key depends on, hits, corruption, atomic writes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph import artifact
from tvmgraph.stages import TracedGraph
from tvmgraph.target import target_for
from tests.conftest import ModuleGraph, assert_close
from tests.models import mlp


def key_of(graph: tvmgraph.nn.Graph, *args: torch.Tensor) -> str:
    traced = graph.trace(*args)
    return artifact.graph_key(type(graph).__name__, traced, None, graph.config, target_for(args[0].device), "default")


def test_key_ignores_graph_name_and_parameter_values() -> None:
    x = torch.randn(4, 32)
    first, second = ModuleGraph(mlp()), ModuleGraph(mlp())  # other names, other weights
    assert first.name != second.name
    assert key_of(first, x) == key_of(second, x)


@pytest.mark.parametrize("change", ["batch", "dtype", "mode", "structure"])
def test_key_changes_with_what_changes_the_program(change: str) -> None:
    model, x = mlp(), torch.randn(4, 32)
    base = key_of(ModuleGraph(model), x)
    if change == "batch":
        x = torch.randn(5, 32)
    elif change == "dtype":
        model, x = model.double(), x.double()
    elif change == "mode":
        model = nn.Sequential(model, nn.Dropout(0.5)).eval()
        base = key_of(ModuleGraph(model), x)
        model.train()
    else:
        model = mlp((32, 64, 65, 10))
    assert key_of(ModuleGraph(model), x) != base


def test_key_parts_are_logged_for_explaining_misses(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="tvmgraph.cache"):
        key_of(ModuleGraph(mlp()), torch.randn(2, 32))
    for part in ("program", "constants", "signature", "training", "options", "target", "versions", "tvmgraph"):
        assert f"part {part}" in caplog.text


def test_second_graph_loads_instead_of_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = mlp(), torch.randn(3, 32)
    expected = ModuleGraph(model)(x)  # compiles and stores
    lowerings = []
    original = TracedGraph.lower
    monkeypatch.setattr(TracedGraph, "lower", lambda self, plan=None: lowerings.append(1) or original(self, plan))
    again = ModuleGraph(model)
    assert_close(again(x), expected)
    assert lowerings == []  # neither lowered nor compiled
    assert "loaded from the compiled cache" in again.compiled.as_text()
    assert "R.matmul" in again.lowered.as_text()  # lowered on demand
    assert lowerings == [1]


def _run_in_fresh_process(cache_dir: Path, code: str) -> str:
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, check=True).stdout


MLP_SCRIPT = """
    import torch
    from tests.conftest import ModuleGraph
    from tests.models import mlp
    torch.manual_seed(0)
    model, x = mlp((32, 48, 10)), torch.randn(2, 32)
    print(ModuleGraph(model)(x).flatten().tolist())
"""


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_library", "garbage_metadata", "checksum", "missing_library"])
def test_corrupt_entry_is_detected_and_rebuilt(damage: str, tmp_path: Path) -> None:
    """Entries are written by another process (a library this process has mapped is never
    damaged under it); damaged ones are reported, removed and rebuilt, with the same results."""
    expected = _run_in_fresh_process(tmp_path, MLP_SCRIPT)
    (entry,) = (tmp_path / "compiled").iterdir()
    (lib,) = entry.glob("lib-*.so")
    if damage == "truncated_library":
        lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 3])
    elif damage == "garbage_metadata":
        (entry / "meta.pt").write_bytes(b"not a pickle")
    elif damage == "checksum":
        with open(lib, "ab") as f:
            f.write(b"\0")
    else:
        lib.unlink()
    script = "import logging; logging.basicConfig(level=logging.WARNING)\n" + textwrap.dedent(MLP_SCRIPT)
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, check=True)
    assert "is corrupt" in proc.stderr and "rebuilding" in proc.stderr
    assert proc.stdout == expected
    assert _run_in_fresh_process(tmp_path, MLP_SCRIPT) == expected  # the rebuilt entry is whole


def test_store_leaves_no_temporary_directories() -> None:
    ModuleGraph(mlp((32, 40, 10)))(torch.randn(2, 32))
    root = artifact.compiled_cache().root
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_a_second_process_loads_the_training_graph_from_the_cache(tmp_path: Path) -> None:
    """Two fresh interpreters build the same training graph; the second one compiles nothing."""
    script = textwrap.dedent("""
        import sys, torch, tvmgraph
        from tvmgraph.stages import LoweredGraph
        from examples.train_digits import TrainGraph, make_model, make_optimizer
        compiles = []
        original = LoweredGraph.compile
        LoweredGraph.compile = lambda self, *a, **k: compiles.append(1) or original(self, *a, **k)
        torch.manual_seed(0)
        model = make_model()
        graph = TrainGraph(model, *make_optimizer(model, 10))
        loss = graph(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
        print(len(compiles), float(loss))
    """)
    env = {**os.environ, "TVMGRAPH_CACHE_DIR": str(tmp_path)}
    root = Path(__file__).parents[2]
    runs = [subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == "1" and runs[1][0] == "0"
    assert float(runs[0][1]) == pytest.approx(float(runs[1][1]), rel=1e-6)

"""CPU kernels without their argument checks (codegen.build_executable, `kernel_checks`): what
a graph runs leaves them out, what `tvmgraph.save` writes keeps them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import relax as R

import tvmgraph
from tests.conftest import Fn, ModuleGraph
from tvmgraph import artifact, codegen
from tvmgraph.config import GraphConfig, Settings
from tvmgraph.pipeline import get_pipeline
from tvmgraph.target import target_for


def _add_program() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x, y = relax.Var("x", R.Tensor((4, 8), "float32")), relax.Var("y", R.Tensor((4, 8), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, y))
        bb.emit_func_output(out)
    target = target_for(torch.device("cpu"))
    with target:
        return get_pipeline(target, GraphConfig())(bb.get())


@pytest.mark.parametrize("checks", [True, False])
def test_a_kernel_checks_its_arguments_only_when_asked(checks: bool) -> None:
    """The 4x8 add kernel called with 4x9 tensors (larger: no out-of-bounds access either way):
    refused with its checks, run without them."""
    executable = codegen.build_executable(_add_program(), target_for(torch.device("cpu")), kernel_checks=checks)
    kernel = executable.mod.imports[0].get_function("add")
    wide = tvm.runtime.tensor(np.ones((4, 9), "float32"))
    if checks:
        with pytest.raises(ValueError, match="Mismatched"):
            kernel(wide, wide, wide)
    else:
        kernel(wide, wide, wide)


def test_graphs_run_kernels_without_checks_and_saves_keep_them(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    built: list[bool] = []
    real = codegen.build_executable

    def recording(*args, kernel_checks: bool = True, **kwargs):
        built.append(kernel_checks)
        return real(*args, kernel_checks=kernel_checks, **kwargs)

    monkeypatch.setattr(codegen, "build_executable", recording)
    monkeypatch.setattr(artifact, "compiled_cache", lambda: None)  # compile, even if another test stored it
    graph = ModuleGraph(Fn(lambda x: torch.relu(x) * 2.0))
    x = torch.randn(4, 8)
    torch.testing.assert_close(graph(x), torch.relu(x) * 2.0)
    tvmgraph.save(graph, tmp_path / "saved")
    assert built == [False, True]


def test_the_environment_turns_the_checks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().kernel_checks is False
    monkeypatch.setenv("TVMGRAPH_KERNEL_CHECKS", "1")
    assert Settings().kernel_checks is True

"""Compile-only checks for targets this machine cannot run (CUDA through nvcc)."""

from __future__ import annotations

import shutil

import pytest
import torch
import tvm

from tests.conftest import ModuleGraph
from tests.models import SmallCNN


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_cnn_compiles_for_cuda_without_a_gpu() -> None:
    graph = ModuleGraph(SmallCNN().eval())
    lowered = graph.trace(torch.randn(2, 3, 16, 16)).lower()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    _, executable = lowered.build(target, graph.config)
    host = executable.mod.imports[0]
    kinds = [m.kind for m in host.imports]
    assert "cuda" in kinds
    source = host.imports[kinds.index("cuda")].inspect_source()
    assert "__global__" in source and "threadIdx.x" in source

"""Compile-only checks for targets this machine cannot run (CUDA through nvcc)."""

from __future__ import annotations

import shutil

import pytest
import torch
import tvm

from tests.conftest import ModuleGraph, TrainGraph, lower_train_step
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


def _zoo_training_step_for_cuda(name: str) -> tuple[dict[str, tvm.tirx.PrimFunc], tvm.runtime.Executable]:
    """The zoo model `name`'s training step built for sm_90: ({kernel name: PrimFunc}, executable)."""
    from tests.numeric.zoo import ZOO

    entry = ZOO[name]
    model = entry.make().train()
    graph = TrainGraph(model, entry.loss, entry.optimizer(model))
    lowered, options = lower_train_step(graph, *entry.batch(torch.Generator().manual_seed(0)))
    optimized, executable = lowered.build(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), options)
    kernels = {gv.name_hint: f for gv, f in optimized.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    return kernels, executable


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_a_tied_embedding_gpt_training_step_builds_for_cuda_with_every_kernel_on_the_gpu() -> None:
    """The embedding's gradient (take_backward) was host code in a CUDA build: the zoo's GPT
    segfaulted in its first step on an H200. Now every kernel that writes memory is bound to
    GPU threads (numbers against eager on a GPU: tests/gpu/test_cuda_zoo.py)."""
    from tvmgraph.schedules.apply_gpu import runs_on_host

    kernels, executable = _zoo_training_step_for_cuda("gpt_tied")
    assert any(name.startswith("take_backward") for name in kernels)
    assert [name for name, f in kernels.items() if runs_on_host(f)] == []
    host = executable.mod.imports[0]
    assert "cuda" in [m.kind for m in host.imports]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_an_embedding_trained_with_a_dynamic_batch_builds_for_cuda() -> None:
    """With a dynamic batch the count of token indices is symbolic: the GPU kernel of the
    embedding's gradient loops over it (TVM's legalization would be host code, which
    ApplyGPUSchedules refuses)."""
    from torch import nn

    from tvmgraph.schedules.apply_gpu import runs_on_host

    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 32), nn.Linear(32, 5)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(tokens).mean(1))

    model = Bag()
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.enable_dynamic_batch(True)
    lowered, options = lower_train_step(graph, torch.randint(0, 50, (4, 6)), torch.randint(0, 5, (4,)))
    optimized, _ = lowered.build(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), options)
    kernel = optimized["take_backward"]
    assert not runs_on_host(kernel) and "blockIdx.x" in kernel.script()
    # dy, the table, the indices, the output, and the symbolic count of tokens
    assert len(kernel.params) == 5


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic_batch", "static_batch"])
def test_a_max_pool_trained_builds_for_cuda(dynamic: bool) -> None:
    """dlight's reduction rules split the pool gradient's window argmax of a symbolic batch over
    threads in a way LowerCrossThreadReduction refuses at code generation; ApplyGPUSchedules
    now tries that lowering on each rule's schedule and gives the kernel to the next rule. With
    a static batch, the CPU's loop kernel of the gradient (max_pool_backward.window_loops,
    parallel loops no thread runs) is not used for CUDA."""
    from torch import nn


    if dynamic:
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 8 * 8, 5))
        x = torch.randn(4, 3, 16, 16)
    else:  # 1-D windows: the ones the CPU builds as loops
        model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.MaxPool1d(4), nn.Flatten(), nn.Linear(4 * 16, 5))
        x = torch.randn(4, 3, 64)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.enable_dynamic_batch(dynamic)
    lowered, options = lower_train_step(graph, x, torch.randint(0, 5, (4,)))
    _, executable = lowered.build(tvm.target.Target({"kind": "cuda", "arch": "sm_90"}), options)
    assert "cuda" in [m.kind for m in executable.mod.imports[0].imports]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_a_llama_training_step_builds_for_cuda_with_its_rotary_tables_folded() -> None:
    """FoldConstantTables computes the rotary cos/sin tables on the host while the graph is
    built for CUDA: no kernel computes a cos or a sin, and every kernel runs on the GPU."""
    from tvmgraph.schedules.apply_gpu import runs_on_host

    kernels, _ = _zoo_training_step_for_cuda("llama")
    assert not [name for name in kernels if "_cos" in name or "_sin" in name or name.startswith(("cos", "sin"))]
    assert [name for name, f in kernels.items() if runs_on_host(f)] == []

"""`relax.grad.take_backward` legalized as a parallel kernel (tvmgraph/take_backward.py), against
torch.autograd: repeated indices, every axis, and an embedding trained through a graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from tvm import relax
from tvm.relax.op import grad as relax_grad

import tvmgraph.pipeline  # noqa: F401  (registers the legalization)
from tests.conftest import SGDStep, assert_close
from tvmgraph.schedules.apply_gpu import ApplyGPUSchedules, runs_on_host
from tvmgraph.take_backward import MIN_CHUNK_COLUMNS, column_chunks
from tvmgraph.target import host_cpu

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": host_cpu()})


def take_backward_module(x_shape: tuple[int, ...], count: int, axis: int) -> tvm.IRModule:
    dy_shape = list(x_shape)
    dy_shape[axis] = count
    dy = relax.Var("dy", relax.TensorType(dy_shape, "float32"))
    x = relax.Var("x", relax.TensorType(x_shape, "float32"))
    idx = relax.Var("idx", relax.TensorType((count,), "int32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [dy, x, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax_grad.take_backward(dy, x, idx, axis))
        bb.emit_func_output(out)
    return relax.transform.LegalizeOps()(bb.get())


@pytest.mark.parametrize("x_shape, axis, indices", [
    ((4096, 256), 0, None),  # a GPT's tied embedding: 1024 random tokens
    ((10, 3), 0, [1, 1, 9, 0, 1]),  # narrower than a vector
    ((3, 10, 5), 1, [1, 1, 9, 0, 1, 3, 9]),  # leading and trailing axes
    ((2, 6, 40), 2, [1, 1, 39, 0, 1]),  # the last axis: one column per index
])
def test_take_backward_adds_repeated_indices_like_torch(x_shape: tuple, axis: int, indices: list | None) -> None:
    """dx[..., i, ...] = the sum of dy[..., l, ...] over the l with indices[l] = i, exactly as
    torch's index_select backward (the same additions in the same order)."""
    idx = torch.randint(0, x_shape[axis], (1024,), dtype=torch.int32) if indices is None else torch.tensor(
        indices, dtype=torch.int32)
    mod = take_backward_module(x_shape, len(idx), axis)
    dy_shape = list(x_shape)
    dy_shape[axis] = len(idx)
    dy, x = torch.randn(dy_shape), torch.randn(x_shape)
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(t.numpy()) for t in (dy, x, idx))).numpy()
    xr = x.clone().requires_grad_()
    torch.index_select(xr, axis, idx.long()).backward(dy)
    np.testing.assert_array_equal(got, xr.grad.numpy())


def test_an_embedding_gradient_runs_in_parallel_over_column_chunks() -> None:
    """TVM's own legalization was one serial loop nest (2.5 ms of a GPT's training step on one
    core, 0.29 ms after): the kernel is a parallel loop over (leading index, column chunk)."""
    mod = take_backward_module((4096, 256), 1024, 0)
    assert "T.parallel(" in mod["take_backward"].script()


def test_a_symbolic_count_of_indices_keeps_the_parallel_kernel() -> None:
    """A dynamic batch's embedding gradient takes n * seq indices, a symbolic count: the loop
    over them takes it as its extent (TVM's serial legalization ran instead), and each count
    gets torch's numbers exactly."""
    n = tvm.tirx.Var("n", "int64")
    dy = relax.Var("dy", relax.TensorType([n, 64], "float32"))
    x = relax.Var("x", relax.TensorType([100, 64], "float32"))
    idx = relax.Var("idx", relax.TensorType([n], "int32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [dy, x, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax_grad.take_backward(dy, x, idx, 0))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    assert "T.parallel(" in mod["take_backward"].script()
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    for count in (7, 300):
        indices = torch.randint(0, 100, (count,), dtype=torch.int32)
        grad, table = torch.randn(count, 64), torch.randn(100, 64, requires_grad=True)
        got = vm["main"](*(tvm.runtime.tensor(t.detach().numpy()) for t in (grad, table, indices))).numpy()
        torch.index_select(table, 0, indices.long()).backward(grad)
        np.testing.assert_array_equal(got, table.grad.numpy())


def test_a_gpu_target_gets_a_kernel_bound_to_gpu_threads() -> None:
    """The CPU kernel (and TVM's) is a bare loop nest, which no GPU rule can bind to threads:
    built for CUDA it ran on the host with device pointers (every zoo model with an embedding
    segfaulted in its first training step on an H200). For a GPU target each (leading index,
    column) is one GPU thread; its numbers against eager: tests/gpu/test_cuda_zoo.py."""
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}) as cuda:
        mod = take_backward_module((4096, 256), 1024, 0)
        scheduled = ApplyGPUSchedules()(mod)
    kernel = scheduled["take_backward"].with_attr("target", cuda)
    assert not runs_on_host(kernel)
    script = kernel.script()
    assert "T.parallel(" not in script and "blockIdx.x" in script and "threadIdx.x" in script


@pytest.mark.parametrize("leading, columns, threads, chunks", [
    (1, 256, 2, 2), (1, 256, 16, 16), (1, 16, 8, 1), (4, 256, 2, 1), (1, 5, 2, 1), (1, 40, 2, 2),
])
def test_columns_are_cut_into_chunks_for_every_thread(leading: int, columns: int, threads: int, chunks: int) -> None:
    assert column_chunks(leading, columns, threads) == chunks
    assert columns % chunks == 0 and (chunks == 1 or columns // chunks >= MIN_CHUNK_COLUMNS)


class TiedEmbeddingLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.embed(tokens) @ self.embed.weight.T  # the same table read by a product
        return nn.functional.cross_entropy(logits.reshape(-1, 50), target.reshape(-1))


def test_a_tied_embedding_trains_like_eager() -> None:
    """One SGD step (lr=1) of a graph whose embedding table is read by index and by a product:
    the table moves by minus the sum of take_backward's rows and the product's gradient."""
    torch.manual_seed(0)
    model = TiedEmbeddingLoss()
    eager = TiedEmbeddingLoss()
    eager.load_state_dict(model.state_dict())
    tokens, target = torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))
    SGDStep(model)(tokens, target)
    torch.optim.SGD(eager.parameters(), lr=1.0, momentum=0.9).zero_grad()
    eager(tokens, target).backward()
    with torch.no_grad():
        expected = eager.embed.weight - eager.embed.weight.grad
    assert_close(model.embed.weight.detach(), expected, atol=1e-5, rtol=1e-5)

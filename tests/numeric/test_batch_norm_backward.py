"""The training batch norm's backward pass as one kernel (tvmgraph/gradients/batch_norm_backward.py):
dx, dgamma and dbeta against torch.autograd at sizes the CPU schedule runs channel by channel,
with a static and a dynamic batch. (The op-level checks at small sizes, float64 and central
differences included, are test_gradients.py's batch_norm cases.)"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import tvm
from tvm import relax, te, tirx
from tvm.script import relax as R

from tests.numeric.grad_check import without_main
from tests.numeric.test_cpu_schedules import TARGET, finish, fuse, prim_funcs
from tvmgraph.gradients.batch_norm_backward import batch_norm_backward
from tvmgraph.schedules import ApplyCPUSchedules, ApplyGPUSchedules
from tvmgraph.schedules.reduction import CHANNELS_PER_THREAD


CHANNELS = CHANNELS_PER_THREAD * (os.cpu_count() or 1)


def _adjoint_module(shape: tuple) -> tvm.IRModule:
    """``main(x, g, b, m, v, w) = sum(batch_norm(x, g, b, m, v)[0] * w)`` and its adjoint with
    respect to x, g and b."""
    bb = relax.BlockBuilder()
    x, w = relax.Var("x", R.Tensor(shape, "float32")), relax.Var("w", R.Tensor(shape, "float32"))
    g, b, m, v = (relax.Var(name, R.Tensor((shape[1],), "float32")) for name in "gbmv")
    with bb.function("main", [x, g, b, m, v, w]):
        with bb.dataflow():
            y = bb.emit(relax.TupleGetItem(relax.op.nn.batch_norm(x, g, b, m, v, axis=1, training=True), 0))
            loss = bb.emit_output(relax.op.sum(relax.op.multiply(y, w)))
        bb.emit_func_output(loss)
    return without_main(relax.transform.Gradient("main", require_grads=[x, g, b])(bb.get()))


def _run(mod: tvm.IRModule, *inputs: torch.Tensor) -> list[torch.Tensor]:
    vm = relax.VirtualMachine(finish(mod), tvm.cpu())
    _, grads = vm["main_adjoint"](*[tvm.runtime.tensor(t.numpy()) for t in inputs])
    return [torch.from_numpy(grad.numpy()) for grad in grads]


def _inputs(shape: tuple) -> list[torch.Tensor]:
    channels = shape[1]
    return [torch.randn(*shape) * 2 + 1, torch.rand(channels) + 0.5, torch.randn(channels),
            torch.zeros(channels), torch.ones(channels), torch.randn(*shape)]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Within 1e-4, or 1e-5 of the largest value: dgamma and dbeta sum thousands of float32
    terms per channel (both TVM's kernels, old and new, and torch's float32 are 1e-6 of the
    largest off float64; a small element of a sum is further off relative to itself)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=max(1e-4, 1e-5 * float(w.abs().max())))


def _expected(x, g, b, m, v, w) -> list[torch.Tensor]:
    x, g, b = (t.clone().requires_grad_() for t in (x, g, b))
    y = torch.nn.functional.batch_norm(x, m.clone(), v.clone(), g, b, training=True)
    return list(torch.autograd.grad((y * w).sum(), [x, g, b]))


def test_batch_norm_backward_is_one_kernel_run_channel_by_channel() -> None:
    """The statistics, dx, dgamma and dbeta of one batch norm come from one kernel, under one
    parallel loop over the channels: x and dy are read from memory once (written with Relax
    ops, a dozen kernels each read or wrote a whole activation; the benchmark CNN's training
    step took 0.70 of its time after this on Zen 3)."""
    shape = (32, CHANNELS, 32, 32)  # a channel: 128 KiB
    inputs = _inputs(shape)
    with TARGET:
        scheduled = ApplyCPUSchedules()(fuse(_adjoint_module(shape)))
    _assert_close(_run(scheduled, *inputs), _expected(*inputs))
    # The forward batch norm, the loss (y * w summed), its gradient (w) and the backward pass.
    kernels = prim_funcs(scheduled)
    assert sorted(kernels) == ["batch_norm", "batch_norm_backward", "fused_multiply_sum", "multiply"], sorted(kernels)
    assert kernels["batch_norm_backward"].script().count("T.parallel(") == 1, kernels["batch_norm_backward"].script()


@pytest.mark.parametrize("batch", [6, 16])
def test_batch_norm_backward_with_a_dynamic_batch(batch: int) -> None:
    """The element count per channel is symbolic: the same kernel for every batch size."""
    n = tirx.Var("n", "int64")
    mod = _adjoint_module((n, CHANNELS, 8, 8))
    with TARGET:
        scheduled = ApplyCPUSchedules()(fuse(mod))
    inputs = _inputs((batch, CHANNELS, 8, 8))
    _assert_close(_run(scheduled, *inputs), _expected(*inputs))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_batch_norm_backward_compiles_for_cuda() -> None:
    """The GPU schedules take the kernel too (its numbers on a GPU: tests/gpu/test_cuda.py's
    CNN training with batch norm)."""
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    x, dy = te.placeholder((64, 16, 32, 32), name="x"), te.placeholder((64, 16, 32, 32), name="dy")
    gamma = te.placeholder((16,), name="gamma")
    func = te.create_prim_func([x, dy, gamma, *batch_norm_backward(x, dy, gamma, 1, 1e-5)])
    mod = ApplyGPUSchedules()(tvm.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("target", cuda)}))
    source = tvm.compile(mod, target=cuda).mod.imports[0].inspect_source()
    assert "__global__" in source

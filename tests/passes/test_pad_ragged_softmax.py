"""PadRaggedSoftmax: softmax over rows that no vector divides (a ViT's 65 tokens) becomes one
kernel over rows padded with -inf; torch's numbers, masked rows included."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax

from relay_passes.pad_ragged_softmax import PadRaggedSoftmax, padded_extent
from tvmgraph.schedules import ApplyCPUSchedules

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})  # 8 float lanes
HOST = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()})


def softmax_module(shape: tuple[int, ...], log: bool = False, axis: int = -1) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    op = relax.op.nn.log_softmax if log else relax.op.nn.softmax
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(op(x, axis=axis))
        bb.emit_func_output(y)
    return bb.get()


def padded(mod: tvm.IRModule, target: tvm.target.Target = AVX2) -> tvm.IRModule:
    with target:
        return PadRaggedSoftmax()(mod)


def test_rows_of_65_become_one_kernel_over_rows_of_72() -> None:
    """Before: R.nn.softmax(x, axis=-1) over (2, 65, 65). After: one call_tir whose PrimFunc
    pads each row with -inf to 72 (9 vectors of 8), takes the softmax, and keeps the first 65."""
    after = padded(softmax_module((2, 65, 65)))
    main = after["main"].script()
    assert "R.nn.softmax" not in main and "R.call_tir(softmax_padded, (x,)" in main, main
    kernel = after["softmax_padded"].script()
    assert "T.sblock_alloc_buffer((T.int64(2), T.int64(65), T.int64(72)))" in kernel, kernel
    assert 'T.if_then_else(T.int64(0) <= v_i2 and v_i2 < T.int64(65), x[v_i0, v_i1, v_i2], T.float32("-inf"))' in kernel, kernel


@pytest.mark.parametrize("shape, axis", [
    ((2, 65, 64), -1),   # a vector divides the rows
    ((2, 65, 13), -1),   # at most two vectors: the sums are short anyway
    ((2, 65, 65), 1),    # not the last axis
])
def test_other_softmaxes_are_left_alone(shape: tuple[int, ...], axis: int) -> None:
    before = softmax_module(shape, axis=axis)
    tvm.ir.assert_structural_equal(padded(before), before)


def test_gpu_targets_are_left_alone() -> None:
    before = softmax_module((2, 65, 65))
    tvm.ir.assert_structural_equal(padded(before, tvm.target.Target({"kind": "cuda", "arch": "sm_80"})), before)


def test_padded_extent_is_whole_vectors_of_the_target() -> None:
    assert [padded_extent(e, 8) for e in (65, 77, 197, 64, 16, 17)] == [72, 80, 200, None, None, 24]
    assert padded_extent(65, 16) == 80 and padded_extent(17, 16) is None


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_padded_softmax_matches_torch_masked_rows_included(log: bool) -> None:
    """Compiled with tvmgraph's CPU schedules on this host. Rows with -inf entries (an attention
    mask) keep torch's numbers; a row that is all -inf gives NaN, as torch's does."""
    x = torch.randn(3, 65, 77) * 4
    x[0, :, 70:] = float("-inf")
    x[1, 5, :] = float("-inf")
    mod = padded(softmax_module(tuple(x.shape), log=log), HOST)
    if padded_extent(77, _lanes()) is not None:
        assert "R.call_tir" in mod["main"].script()
    with HOST:
        mod = ApplyCPUSchedules()(relax.transform.LegalizeOps()(mod))
    if "R.call_tir" in mod["main"].script():
        # The padding is a vector fill and a copy of the row (schedules/reduction.py), not a
        # bounds test per element.
        kernel = mod["log_softmax_padded" if log else "softmax_padded"].script()
        assert "PadInput_pad_const" in kernel and "T.vectorized(" in kernel, kernel
    vm = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())
    out = torch.from_numpy(vm["main"](tvm.runtime.tensor(x.numpy())).numpy())
    expected = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.isnan(out[1, 5]).all() and not torch.isnan(out[1, 4]).any()


def _lanes() -> int:
    from tvmgraph.schedules.cpu_target import CPUTarget

    return CPUTarget.from_target(HOST).lanes("float32")


def test_rows_of_a_symbolic_count_are_padded_and_match_torch() -> None:
    """A dynamic batch's cross entropy over (batch * T, 20) logits: the pass took the row count
    as an int, raised, and the graph compiled without it. Rows of 20 padded to 24 (AVX2's 8
    lanes) for any count; the padded kernel run on this host."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 20), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.nn.log_softmax(x, axis=-1))
        bb.emit_func_output(y)
    mod = padded(bb.get())
    assert "R.call_tir(log_softmax_padded" in mod["main"].script()
    vm = relax.VirtualMachine(tvm.compile(relax.transform.LegalizeOps()(mod), target=HOST), tvm.cpu())
    for rows in (3, 10):
        x = torch.randn(rows, 20)
        out = torch.from_numpy(vm["main"](tvm.runtime.tensor(x.numpy())).numpy())
        torch.testing.assert_close(out, torch.log_softmax(x, -1), atol=1e-5, rtol=1e-5)

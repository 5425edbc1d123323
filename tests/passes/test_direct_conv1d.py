"""DirectConv1d: a conv1d becomes one kernel over rows padded to whole register tiles (its
strided input split into phases), tiled by tvmgraph/schedules/conv1d.py; torch's numbers."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax, tirx

from relay_passes.direct_conv1d import DirectConv1d
from tvmgraph.schedules import ApplyCPUSchedules
from tvmgraph.schedules.conv1d import BLOCK, padded_row
from tvmgraph.schedules.cpu_target import CPUTarget

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})  # 8 float lanes, 16 registers
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})  # 16 lanes, 32 registers
HOST = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()})


def conv1d_module(x_shape: tuple, w_shape: tuple, stride: int = 1, padding: int = 0, dilation: int = 1,
                  groups: int = 1, dtype: str = "float32", bias: bool = False) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    w = relax.Var("w", relax.TensorType(w_shape, dtype))
    b = relax.Var("b", relax.TensorType((w_shape[0], 1), dtype))
    with bb.function("main", [x, w, b] if bias else [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv1d(x, w, stride, padding, dilation, groups))
            if bias:
                y = bb.emit(relax.op.nn.relu(relax.op.add(y, b)))
            y = bb.emit_output(y)
        bb.emit_func_output(y)
    return bb.get()


def rewritten(mod: tvm.IRModule, target: tvm.target.Target = AVX2) -> tvm.IRModule:
    with target:
        return DirectConv1d()(mod)


def test_a_strided_conv1d_becomes_phases_a_padded_product_and_a_crop() -> None:
    """Before: R.nn.conv1d(x, w, strides=[4]) of (2, 1, 400) by (8, 1, 10): 98 columns. After: a
    call_tir of one PrimFunc: x in 4 phases of 122 samples (120 columns + the last tap's offset
    2), the product over 120 columns (5 tiles of 3 AVX2 vectors), tap k read from phase k % 4,
    k // 4 columns on, and the crop to 98; marked out-element-wise fusable so that FuseOps brings
    the bias and activation in."""
    after = rewritten(conv1d_module((2, 1, 400), (8, 1, 10), stride=4))
    main = after["main"].script()
    assert "R.nn.conv1d(" not in main and "R.call_tir(conv1d, (x, w)" in main, main
    kernel = after["conv1d"]
    text = kernel.script()
    for buffer in ("conv1d_phases = T.sblock_alloc_buffer((T.int64(2), T.int64(1), T.int64(4), T.int64(122)))",
                   f"{BLOCK} = T.sblock_alloc_buffer((T.int64(2), T.int64(8), T.int64(120)))"):
        assert buffer in text, text
    assert "conv1d_phases[v_n, v_rc, v_rk % T.int64(4), v_rk // T.int64(4) + v_col] * w[v_f, v_rc, v_rk]" in text, text
    assert "conv1d_crop: T.Buffer((T.int64(2), T.int64(8), T.int64(98))" in text, text
    assert int(kernel.attrs["op_pattern"]) == 4


def test_a_stride_1_conv1d_has_one_phase() -> None:
    """One phase: x with its zeros, 64 columns (4 tiles of 2 AVX2 vectors) + 2 taps."""
    text = rewritten(conv1d_module((2, 3, 50), (4, 3, 3), padding=1))["conv1d"].script()
    assert "conv1d_phases = T.sblock_alloc_buffer((T.int64(2), T.int64(3), T.int64(1), T.int64(66)))" in text, text
    assert "conv1d_crop: T.Buffer((T.int64(2), T.int64(4), T.int64(50))" in text, text


def test_a_grouped_dilated_conv1d_reads_its_groups_rows_at_its_taps() -> None:
    """groups 2, dilation 3: output channel f reads input channels (f // 3) * 2 + c (3 outputs,
    2 inputs per group), tap k at 3 k; the phases reach 6 columns past the rows."""
    text = rewritten(conv1d_module((2, 4, 50), (6, 2, 3), dilation=3, groups=2))["conv1d"].script()
    assert "conv1d_phases = T.sblock_alloc_buffer((T.int64(2), T.int64(4), T.int64(1), T.int64(54)))" in text, text
    assert "conv1d_phases[v_n, v_f // T.int64(3) * T.int64(2) + v_rc, T.int64(0), v_rk * T.int64(3) + v_col]" in text, text


def test_rows_are_padded_to_the_tile_that_wastes_least() -> None:
    """With 16 registers a tile is 3 vectors (4 x 3) or 2 (6 x 2, counted 10% slower); with 32,
    2 vectors of 16 or 1."""
    avx2, avx512 = CPUTarget.from_target(AVX2), CPUTarget.from_target(AVX512)
    assert [padded_row(avx2, n, "float32") for n in (1981, 493, 121, 24, 16, 1)] == [1992, 504, 128, 24, 16, 16]
    assert [padded_row(avx512, n, "float32") for n in (1981, 493, 121, 16)] == [1984, 512, 128, 16]


def test_a_16_bit_conv1d_is_left_alone() -> None:
    before = conv1d_module((2, 3, 50), (4, 3, 3), dtype="float16")
    tvm.ir.assert_structural_equal(rewritten(before), before)


def test_gpu_targets_are_left_alone() -> None:
    before = conv1d_module((2, 3, 50), (4, 3, 3))
    tvm.ir.assert_structural_equal(rewritten(before, tvm.target.Target({"kind": "cuda", "arch": "sm_80"})), before)


CASES = {
    # (batch, channels, width, filters, kernel, stride, padding)
    "m5-first-layer": (4, 1, 8000, 32, 80, 4, 0),
    "m5-second-layer": (4, 32, 495, 64, 3, 1, 0),
    "kernel-not-divided-by-stride": (3, 5, 101, 6, 5, 2, 2),
    "padding-wider-than-stride": (2, 4, 37, 12, 7, 3, 5),
    "fewer-columns-than-a-tile": (2, 3, 9, 7, 3, 1, 1),
}
# (batch, channels, width, filters, kernel, stride, padding, dilation, groups)
GROUPED_OR_DILATED = {
    "depthwise": (2, 8, 100, 8, 3, 1, 1, 1, 8),
    "depthwise-dilated-strided": (2, 6, 77, 12, 5, 2, 3, 2, 6),
    "tcn-dilated": (3, 5, 150, 7, 3, 1, 8, 4, 1),
    "groups-of-4": (2, 8, 60, 12, 4, 3, 0, 1, 2),
}


@pytest.mark.parametrize("case", [(*case, 1, 1) for case in CASES.values()] + list(GROUPED_OR_DILATED.values()),
                         ids=[*CASES.keys(), *GROUPED_OR_DILATED.keys()])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_direct_conv1d_matches_torch(case: tuple, dtype: str) -> None:
    """Compiled with tvmgraph's CPU schedules on this host (the Conv1d rule takes the kernel:
    parallel tiles, vectorized), with a bias and ReLU fused in."""
    n, c, width, f, k, stride, padding, dilation, groups = case
    mod = rewritten(conv1d_module((n, c, width), (f, c // groups, k), stride, padding, dilation, groups,
                                  dtype=dtype, bias=True), HOST)
    with HOST:
        mod = relax.transform.LegalizeOps()(mod)
        mod = tvm.transform.Sequential([relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
                                        relax.transform.FuseTIR()])(mod)
        mod = ApplyCPUSchedules()(mod)
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    (name,) = [name for name, func in kernels.items() if BLOCK in func.script()]
    assert "relu" in name, sorted(kernels)  # the epilogue is in the kernel
    text = kernels[name].script()
    assert "T.parallel(" in text and "T.vectorized(" in text and "T.unroll(" in text, text
    torch_dtype = getattr(torch, dtype)
    x, w, b = (torch.randn(*shape, dtype=torch_dtype) for shape in ((n, c, width), (f, c // groups, k), (f, 1)))
    vm = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())
    out = torch.from_numpy(vm["main"](*[tvm.runtime.tensor(t.numpy()) for t in (x, w, b)]).numpy())
    expected = torch.relu(torch.nn.functional.conv1d(x, w, stride=stride, padding=padding, dilation=dilation,
                                                     groups=groups) + b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, expected, **tol)


def test_a_symbolic_batch_is_rewritten_and_runs() -> None:
    batch = tirx.Var("n", "int64")
    mod = rewritten(conv1d_module((batch, 2, 60), (5, 2, 4), stride=2, padding=1), HOST)
    assert "R.call_tir" in mod["main"].script()
    with HOST:
        mod = ApplyCPUSchedules()(relax.transform.LegalizeOps()(mod))
    vm = relax.VirtualMachine(tvm.compile(mod, target=HOST), tvm.cpu())
    for n in (1, 3):
        x, w = torch.randn(n, 2, 60), torch.randn(5, 2, 4)
        out = torch.from_numpy(vm["main"](tvm.runtime.tensor(x.numpy()), tvm.runtime.tensor(w.numpy())).numpy())
        torch.testing.assert_close(out, torch.nn.functional.conv1d(x, w, stride=2, padding=1), atol=1e-4, rtol=1e-4)

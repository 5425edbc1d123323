"""SafeSoftmaxAsOneKernel: `where(empty rows, 0, softmax(x))` (torch's `_safe_softmax`) is one
kernel that reads the empty rows off the softmax's row max; torch's numbers on every kind of
row (all -inf, NaN, +inf, -FLT_MAX among -inf)."""

from __future__ import annotations

import math

import pytest
import torch
import tvm
from tvm import relax

import tvmgraph
from relay_passes.safe_softmax import SafeSoftmaxAsOneKernel

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})  # 8 float lanes
R = relax.op


def converter_module(shape: tuple[int, ...], masked_logits: bool = False, extra_read: bool = False) -> tvm.IRModule:
    """What tvmgraph's `_safe_softmax` converter emits for `_safe_softmax(x, -1)`."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            finite = bb.emit(R.astype(R.not_equal(x, relax.const(-math.inf, "float32")), "int32"))
            empty = bb.emit(R.equal(R.max(finite, axis=[-1], keepdims=True), relax.const(0, "int32")))
            logits = bb.emit(R.where(empty, relax.const(0.0, "float32"), x)) if masked_logits else x
            probs = bb.emit(R.nn.softmax(logits, axis=-1))
            y = bb.emit(R.where(empty, relax.const(0.0, "float32"), probs))
            out = bb.emit_output(relax.Tuple([y, probs]) if extra_read else y)
        bb.emit_func_output(out)
    return bb.get()


def fused(mod: tvm.IRModule, target: tvm.target.Target = AVX2) -> tvm.IRModule:
    with target:
        return SafeSoftmaxAsOneKernel()(mod)


@pytest.mark.parametrize("masked_logits", [False, True], ids=["softmax(x)", "softmax(where(empty, 0, x))"])
def test_the_empty_row_test_and_the_softmax_become_one_kernel(masked_logits: bool) -> None:
    """Before: not_equal, astype, max, equal, softmax, where (two kernels once fused). After: one
    call_tir whose PrimFunc pads the rows of 65 to 72 (whole AVX2 vectors) with -inf."""
    after = fused(converter_module((2, 65, 65), masked_logits))
    main = after["main"].script()
    assert "R.call_tir(safe_softmax, (x,)" in main, main
    for op in ("R.not_equal", "R.max", "R.nn.softmax", "R.where"):
        assert op not in main, main
    kernel = after["safe_softmax"].script()
    assert "T.sblock_alloc_buffer((T.int64(2), T.int64(65), T.int64(72)))" in kernel, kernel


def test_rows_a_vector_divides_are_not_padded() -> None:
    kernel = fused(converter_module((2, 4, 64)))["safe_softmax"].script()
    assert "T.int64(72)" not in kernel and "PadInput" not in kernel, kernel


def test_a_softmax_something_else_reads_is_left_alone() -> None:
    """A training step's softmax gradient reads the softmax: fusing would compute it twice."""
    before = converter_module((2, 65, 65), extra_read=True)
    tvm.ir.assert_structural_equal(fused(before), before)


def test_gpu_targets_are_left_alone() -> None:
    before = converter_module((2, 65, 65))
    tvm.ir.assert_structural_equal(fused(before, tvm.target.Target({"kind": "cuda", "arch": "sm_80"})), before)


class SafeSoftmax(torch.nn.Module):
    """Of a matmul's scores (the converter's first form) or of an input (its masked-logits form)."""

    def __init__(self, from_matmul: bool) -> None:
        super().__init__()
        self.from_matmul = from_matmul

    def forward(self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scores = (q @ k.transpose(-1, -2)) * 0.125 if self.from_matmul else x * 1.0
        return torch.ops.aten._safe_softmax(scores, -1)


@pytest.mark.parametrize("from_matmul", [True, False], ids=["scores", "other input"])
@pytest.mark.parametrize("tokens", [65, 64])
def test_matches_torch_on_every_kind_of_row(from_matmul: bool, tokens: int) -> None:
    """Compiled by a graph (the whole pipeline: PropagateNaN, the CPU schedules). Rows: all -inf
    (0), holding NaN or +inf (NaN), -FLT_MAX among -inf (a one-hot row), masked in part."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, tokens, 32), torch.randn(2, 3, tokens, 32)
    q[0, 0, 2, 0] = math.nan  # a NaN score row
    q[0, 1, 3, :] = math.inf  # +inf and -inf scores
    x = torch.randn(2, 3, tokens, tokens) * 4
    x[0, 0, 1, :] = -math.inf
    x[0, 0, 2, 5] = math.nan
    x[0, 1, 3, 7] = math.inf
    x[1, 2, 4, :] = -math.inf
    x[1, 2, 4, 9] = torch.finfo(torch.float32).min
    x[1, 0, :, tokens // 2:] = -math.inf
    model = SafeSoftmax(from_matmul)

    class G(tvmgraph.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def build(self, q, k, x):
            return self.model(q, k, x)

    graph = G()
    out = graph(q, k, x)
    expected = model(q, k, x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5, equal_nan=True)
    assert torch.isnan(out[0, 0, 2]).all() and torch.isnan(out[0, 1, 3]).all()
    if not from_matmul:
        assert (out[0, 0, 1] == 0).all() and out[1, 2, 4, 9] == 1 and out[1, 2, 4].sum() == 1
    kernels = [gv.name_hint for gv in graph.compiled.optimized.functions]
    assert any("safe_softmax" in name for name in kernels) and not any("not_equal" in name for name in kernels), kernels

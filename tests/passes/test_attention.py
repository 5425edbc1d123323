"""AttentionAsOneKernel: `softmax(q @ k.T [* scale]) @ v` is one CPU kernel (queries down the
vector lanes); torch's numbers for every form it takes and every kind of row, and the forms it
leaves alone."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import tvm
from tvm import relax
from torch.nn import functional as F

from relay_passes.attention import AttentionAsOneKernel
from tests.conftest import ModuleGraph

AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})  # 8 float lanes
R = relax.op
F32 = "float32"


def attention_module(batch=(2, 3), queries=13, keys=11, depth=7, features=5, safe=True, scale=0.25,
                     extra_read=False, mask=False) -> tvm.IRModule:
    """What the converter emits for attention over (batch..., tokens, depth) tensors: the scores
    of a bmm, a scale, torch's _safe_softmax (or softmax), a bmm with v."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((*batch, queries, depth), F32))
    k = relax.Var("k", relax.TensorType((*batch, keys, depth), F32))
    v = relax.Var("v", relax.TensorType((*batch, keys, features), F32))
    n = len(batch)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(R.permute_dims(k, [*range(n), n + 1, n]))
            s = bb.emit(R.matmul(q, kt))
            if scale is not None:
                s = bb.emit(R.multiply(s, relax.const(scale, F32)))
            if mask:
                s = bb.emit(R.add(s, relax.const(1.0, F32)))
            if safe:
                finite = bb.emit(R.astype(R.not_equal(s, relax.const(-math.inf, F32)), "int32"))
                empty = bb.emit(R.equal(R.max(finite, axis=[-1], keepdims=True), relax.const(0, "int32")))
                probs = bb.emit(R.nn.softmax(s, axis=-1))
                y = bb.emit(R.where(empty, relax.const(0.0, F32), probs))
            else:
                y = probs = bb.emit(R.nn.softmax(s, axis=-1))
            o = bb.emit(R.matmul(y, v))
            out = bb.emit_output(relax.Tuple([o, probs]) if extra_read else o)
        bb.emit_func_output(out)
    return bb.get()


def fused(mod: tvm.IRModule, target: tvm.target.Target = AVX2) -> tvm.IRModule:
    with target:
        return AttentionAsOneKernel()(mod)


@pytest.mark.parametrize("safe", [True, False], ids=["_safe_softmax", "softmax"])
def test_the_products_and_the_softmax_become_one_kernel(safe: bool) -> None:
    """Before: permute, matmul, multiply, the softmax (and its empty-row test), matmul. After:
    the batch dims flattened, one call_tir over 16 queries (13 padded to whole AVX2 vectors),
    its output cropped to 13 and given its batch dims back."""
    after = fused(attention_module(safe=safe))
    main = after["main"].script()
    assert "R.call_tir(attention, (" in main and "out_ty=R.Tensor((6, 16, 5)" in main, main
    assert "R.strided_slice(" in main and "R.Tensor((2, 3, 13, 5)" in main, main
    for op in ("R.matmul", "R.nn.softmax", "R.where", "R.multiply", "R.not_equal"):
        assert op not in main, main
    kernel = after["attention"]
    assert kernel.attrs["tvmgraph.attention"] and int(kernel.attrs["op_pattern"]) == 8
    assert ("T.Select(total" in kernel.script()) == safe  # 0 on empty rows only for _safe_softmax


def test_queries_a_vector_divides_are_not_cropped() -> None:
    main = fused(attention_module(batch=(4,), queries=16, keys=16))["main"].script()
    assert "R.call_tir(attention" in main and "R.strided_slice" not in main and "R.reshape" not in main, main


@pytest.mark.parametrize("case", ["softmax read again", "masked scores", "cuda", "long sequence"])
def test_what_the_kernel_cannot_replace_is_left_alone(case: str) -> None:
    """A training step's softmax gradient reads the softmax (fusing would compute it twice); an
    added mask stands between the product and the softmax; GPU targets have their own kernels;
    a batch's scores over 256 tokens (2 x 256 KiB) would not stay in L2."""
    tokens = 256 if case == "long sequence" else None
    before = attention_module(extra_read=case == "softmax read again", mask=case == "masked scores",
                              **({"queries": tokens, "keys": tokens} if tokens else {}))
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_80"}) if case == "cuda" else AVX2
    tvm.ir.assert_structural_equal(fused(before, target), before)


class Attention(torch.nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1)
        if self.form == "scaled":
            return torch.softmax(scores * (1 / math.sqrt(q.shape[-1])), -1) @ v
        if self.form == "divided":
            return torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1) @ v
        if self.form == "safe":
            return torch.ops.aten._safe_softmax(scores * 0.5, -1) @ v
        if self.form == "bmm":
            flat = torch.bmm(q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2))
            return torch.softmax(flat, -1) @ v.flatten(0, 1)
        return F.scaled_dot_product_attention(q, k, v)


def _compiled(model: torch.nn.Module, *args: torch.Tensor, caplog: pytest.LogCaptureFixture):
    graph = ModuleGraph(model)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(*args)
    return out, "AttentionAsOneKernel:" in caplog.text


@pytest.mark.parametrize("form", ["scaled", "divided", "safe", "bmm", "sdpa"])
@pytest.mark.parametrize("queries", [13, 32])
@pytest.mark.parametrize("features", [5, 16], ids=["features across vectors", "features along vectors"])
def test_matches_torch_on_every_kind_of_row(form: str, queries: int, features: int,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Through a whole graph (PropagateNaN, fast exp, the Attention schedule at -O3), with the
    weighted sum's features along the vector lanes (16: whole AVX2 and AVX-512 vectors) or its
    queries. Rows: a NaN query, an infinite one (NaN scores), one whose scores are all -inf (0
    for _safe_softmax, NaN for softmax), large scores (exp's range)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, queries, 7) * 3, torch.randn(2, 3, 11, 7), torch.randn(2, 3, 11, features)
    k[..., 0] = k[..., 0].abs() + 0.5
    q[0, 0, 1, 3] = math.nan
    q[0, 1, 2, 4] = math.inf
    q[1, 2, 3, 0] = -math.inf  # every score of this row is -inf
    q[1, 0, 4] *= 40
    model = Attention(form)
    out, fused_here = _compiled(model, q, k, v, caplog=caplog)
    if form == "sdpa":  # what torch.export decomposes it into (eager's own kernel: the same
        # numbers but on the row of -inf scores, which it leaves NaN)
        expected = torch.ops.aten._safe_softmax(q @ k.transpose(-2, -1) * (1 / math.sqrt(7)), -1) @ v
    else:
        expected = model(q, k, v)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5, equal_nan=True)
    assert fused_here, caplog.text
    out = out.reshape(2, 3, queries, features)
    assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(out[0, 1, 2]).all()
    if form in ("safe", "sdpa"):
        assert (out[1, 2, 3] == 0).all()
    else:
        assert torch.isnan(out[1, 2, 3]).all()


def test_a_causal_mask_is_left_to_the_other_kernels(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 8) for _ in range(3))

    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out, fused_here = _compiled(Causal(), q, k, v, caplog=caplog)
    torch.testing.assert_close(out, Causal()(q, k, v), atol=1e-6, rtol=1e-5)
    assert not fused_here


def test_a_transformer_layer_runs_its_attention_as_one_kernel(caplog: pytest.LogCaptureFixture) -> None:
    """nn.TransformerEncoderLayer in eval mode (65 tokens: no vector divides them): eager's
    numbers; its training step keeps the softmax the gradient reads."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True).eval()
    x = torch.randn(3, 65, 32)
    out, fused_here = _compiled(layer, x, caplog=caplog)
    with torch.no_grad():
        torch.testing.assert_close(out, layer(x), atol=2e-5, rtol=1e-5)
    assert fused_here, caplog.text

"""RecomputeAttention marks each attention core for recomputation in the backward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.recompute_attention import RecomputeAttention


@I.ir_module
class Attention:
    """softmax(q k * scale) v, then a loss: the shape of torch's math attention, shrunk."""

    @R.function
    def main(q: R.Tensor((2, 4, 3), "float32"), k: R.Tensor((2, 3, 4), "float32"),
             v: R.Tensor((2, 4, 3), "float32")):
        with R.dataflow():
            s = R.matmul(q, k)
            t = R.multiply(s, R.const(0.5, "float32"))
            p = R.nn.softmax(t, axis=-1)
            o = R.matmul(p, v)
            loss = R.sum(R.multiply(o, o))
            R.output(loss)
        return loss


def test_attention_core_is_wrapped_in_checkpoint_markers() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(q: R.Tensor((2, 4, 3), "float32"), k: R.Tensor((2, 3, 4), "float32"),
                 v: R.Tensor((2, 4, 3), "float32")):
            with R.dataflow():
                qc = R.grad.start_checkpoint(q)
                kc = R.grad.start_checkpoint(k)
                s = R.matmul(qc, kc)
                t = R.multiply(s, R.const(0.5, "float32"))
                p = R.nn.softmax(t, axis=-1)
                vc = R.grad.start_checkpoint(v)
                o = R.matmul(p, vc)
                oc = R.grad.end_checkpoint(o)
                lv = R.multiply(oc, oc)
                loss = R.sum(lv)
                R.output(loss)
            return loss

    tvm.ir.assert_structural_equal(RecomputeAttention()(Attention), Expected)


def test_probabilities_used_elsewhere_are_left_alone() -> None:
    """Attention weights returned too (need_weights=True) are kept anyway: nothing to gain."""

    @I.ir_module
    class Before:
        @R.function
        def main(q: R.Tensor((2, 4, 3), "float32"), k: R.Tensor((2, 3, 4), "float32"),
                 v: R.Tensor((2, 4, 3), "float32")):
            with R.dataflow():
                s = R.matmul(q, k)
                p = R.nn.softmax(s, axis=-1)
                o = R.matmul(p, v)
                R.output(o, p)
            return (o, p)

    tvm.ir.assert_structural_equal(RecomputeAttention()(Before), Before)


def test_turned_off_it_leaves_the_module_alone_and_it_reports() -> None:
    tvm.ir.assert_structural_equal(RecomputeAttention(enabled=False)(Attention), Attention)
    messages: list[str] = []
    RecomputeAttention(report=messages.append)(Attention)
    assert messages == ["RecomputeAttention: 1 attention(s) recomputed in the backward pass"]


@pytest.mark.parametrize("recompute", [True, False])
def test_gradients_match_torch(recompute: bool) -> None:
    """Through Relax autodiff and a CPU build, with and without the markers, against torch."""
    mod = RecomputeAttention(enabled=recompute)(Attention)
    mod = relax.transform.Gradient("main")(mod)
    if recompute:
        assert "_cp" in mod["main_adjoint"].script()  # the backward pass recomputes
    executable = tvm.compile(mod, tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype("float32") for s in ((2, 4, 3), (2, 3, 4), (2, 4, 3)))
    loss, grads = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in (q, k, v)))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    o = torch.softmax(tq @ tk * 0.5, dim=-1) @ tv
    expected = (o * o).sum()
    expected.backward()
    torch.testing.assert_close(torch.from_numpy(loss.numpy()), expected.detach(), rtol=1e-5, atol=1e-5)
    for got, t in zip(grads, (tq, tk, tv)):
        torch.testing.assert_close(torch.from_numpy(got.numpy()), t.grad, rtol=1e-5, atol=1e-5)

"""CheckpointModules wraps each call of a checkpointed module in Relax's checkpoint markers."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.checkpoint_modules import CheckpointModules


@I.ir_module
class TwoCalls:
    """One module (`a = x @ w; b = relu(a)`) called twice, the second call on the first's result."""

    @R.function
    def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")):
        with R.dataflow():
            a = R.matmul(x, w)
            b = R.nn.relu(a)
            c = R.matmul(b, w)
            d = R.nn.relu(c)
            e = R.multiply(d, b)
            loss = R.sum(e)
            R.output(loss)
        return loss


def test_each_call_is_wrapped_in_checkpoint_markers() -> None:
    """Each call starts from its own start_checkpoint of every tensor it reads (the weight too)
    and ends at an end_checkpoint of every result read outside it; inside, nothing changes."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4), "float32"), w: R.Tensor((4, 4), "float32")):
            with R.dataflow():
                x_start = R.grad.start_checkpoint(x)
                w_start = R.grad.start_checkpoint(w)
                a = R.matmul(x_start, w_start)
                b = R.nn.relu(a)
                b_end = R.grad.end_checkpoint(b)
                b_start = R.grad.start_checkpoint(b_end)
                w_start1 = R.grad.start_checkpoint(w)
                c = R.matmul(b_start, w_start1)
                d = R.nn.relu(c)
                d_end = R.grad.end_checkpoint(d)
                e = R.multiply(d_end, b_end)
                loss = R.sum(e)
                R.output(loss)
            return loss

    messages: list[str] = []
    after = CheckpointModules([["a", "b"], ["c", "d"]], report=messages.append)(TwoCalls)
    tvm.ir.assert_structural_equal(after, Expected)
    assert messages == ["CheckpointModules: 2 module call(s) recomputed in the backward pass"]


def test_no_region_leaves_the_module_alone() -> None:
    tvm.ir.assert_structural_equal(CheckpointModules([])(TwoCalls), TwoCalls)


def _gradients(mod: tvm.IRModule, x: np.ndarray, w: np.ndarray) -> tuple[tvm.IRModule, list[np.ndarray]]:
    grad_mod = relax.transform.Gradient("main", require_grads=list(mod["main"].params))(mod)
    exe = tvm.compile(grad_mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main_adjoint"](tvm.runtime.tensor(x), tvm.runtime.tensor(w))
    return grad_mod, [out[0].numpy(), *(g.numpy() for g in out[1])]


def test_gradient_recomputes_the_calls_and_gets_the_same_values() -> None:
    """After Gradient the backward pass recomputes what the second call computed (`c_cp`,
    `d_cp`) from what it keeps: the calls' inputs, `b` among them (the first call's result is the
    second's input). Loss and gradients are the same as without markers."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 4), dtype="float32"), rng.standard_normal((4, 4), dtype="float32")
    _, plain = _gradients(TwoCalls, x, w)
    marked_mod, marked = _gradients(CheckpointModules([["a", "b"], ["c", "d"]])(TwoCalls), x, w)
    recomputed = {b.var.name for block in marked_mod["main_adjoint"].body.blocks for b in block.bindings
                  if b.var.name.endswith("_cp")}
    assert recomputed == {"c_cp", "d_cp"}
    for got, want in zip(marked, plain):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_attention_inside_a_checkpointed_module_gets_no_markers_of_its_own() -> None:
    """RecomputeAttention (which runs next) leaves an attention in a checkpointed module alone:
    the module's recomputation covers it, and its own markers would keep q, k and v."""
    from relay_passes.recompute_attention import RecomputeAttention

    @I.ir_module
    class Attention:
        @R.function
        def main(x: R.Tensor((2, 4, 3), "float32"), k: R.Tensor((2, 3, 4), "float32")):
            with R.dataflow():
                q = R.multiply(x, x)
                s = R.matmul(q, k)
                p = R.nn.softmax(s, axis=-1)
                o = R.matmul(p, q)
                loss = R.sum(o)
                R.output(loss)
            return loss

    marked = CheckpointModules([["q", "s", "p", "o"]])(Attention)
    tvm.ir.assert_structural_equal(RecomputeAttention()(marked), marked)
    outside = RecomputeAttention()(Attention)  # outside a checkpointed module it marks the attention
    assert "start_checkpoint" in outside.script()

"""RecomputeLateReads: a recomputed (checkpointed) value that a gradient reads long after the
recomputation is recomputed again right before that gradient (before/after IR). The gradients
it changes are checked against torch in tests/numeric/test_activation_checkpointing.py."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.recompute_late_reads import RecomputeLateReads
from relay_passes.separate_backward import SeparateBackward


def late_reads(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[str]]:
    messages: list[str] = []
    return RecomputeLateReads(report=messages.append)(SeparateBackward()(mod)), messages


@I.ir_module
class Checkpointed:
    """The backward pass of a checkpointed `matmul -> gelu -> matmul`, as autodiff emits it: the
    whole call recomputed first (`*_cp`), then the gradients. `a_cp` is read by the recomputed
    second matmul and, after `y_adjoint`, by the second weight's gradient: it is live while
    `y_cp` and `y_adjoint` are, where the step peaks."""

    @R.function
    def main(x: R.Tensor((16, 16), "float32"), w1: R.Tensor((16, 16), "float32"),
             w2: R.Tensor((16, 16), "float32")):
        with R.dataflow():
            loss = R.sum(x)
            loss_adjoint = R.ones((), "float32")
            h_cp = R.matmul(x, w1)
            a_cp = R.nn.gelu(h_cp)
            y_cp = R.matmul(a_cp, w2)
            y_adjoint = R.multiply(R.broadcast_to(loss_adjoint, (16, 16)), y_cp)
            a_adjoint = R.matmul(y_adjoint, R.permute_dims(w2))
            w2_adjoint = R.matmul(R.permute_dims(a_cp), y_adjoint)
            h_adjoint = R.multiply(a_adjoint, R.sigmoid(h_cp))
            w1_adjoint = R.matmul(R.permute_dims(x), h_adjoint)
            R.output(loss, w1_adjoint, w2_adjoint)
        return (loss, w1_adjoint, w2_adjoint)


def test_a_late_read_value_is_recomputed_where_its_gradient_can_first_run() -> None:
    """gelu(h_cp) is redone right after `y_adjoint` (the weight gradient's other operand), in a
    block of its own, from h_cp, which the GELU gradient keeps live anyway; `a_cp` now dies at
    the recomputed matmul."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((16, 16), "float32"), w1: R.Tensor((16, 16), "float32"),
                 w2: R.Tensor((16, 16), "float32")):
            with R.dataflow():
                loss = R.sum(x)
                R.output(loss)
            R.tuple()
            with R.dataflow():
                loss_adjoint = R.ones((), "float32")
                h_cp = R.matmul(x, w1)
                a_cp = R.nn.gelu(h_cp)
                y_cp = R.matmul(a_cp, w2)
                y_adjoint = R.multiply(R.broadcast_to(loss_adjoint, (16, 16)), y_cp)
                R.output(h_cp, y_adjoint)
            R.tuple()
            with R.dataflow():
                a_cp_again = R.nn.gelu(h_cp)
                a_adjoint = R.matmul(y_adjoint, R.permute_dims(w2))
                w2_adjoint = R.matmul(R.permute_dims(a_cp_again), y_adjoint)
                h_adjoint = R.multiply(a_adjoint, R.sigmoid(h_cp))
                w1_adjoint = R.matmul(R.permute_dims(x), h_adjoint)
                R.output(w1_adjoint, w2_adjoint)
            return (loss, w1_adjoint, w2_adjoint)

    after, messages = late_reads(Checkpointed)
    tvm.ir.assert_structural_equal(after, Expected)
    assert [type(b).__name__ for b in after["main"].body.blocks] == [
        "DataflowBlock", "BindingBlock", "DataflowBlock", "BindingBlock", "DataflowBlock"]
    assert messages == ["RecomputeLateReads: checkpointed value recomputed where read late x1"]


def test_a_chain_is_recomputed_only_through_cheap_ops() -> None:
    """With a matmul in place of the GELU (`a_cp = h_cp @ w1`, not an attention's scores: no
    softmax reads it), recomputing `a_cp` would redo a matmul: the module is left alone."""

    @I.ir_module
    class MatmulChain:
        @R.function
        def main(x: R.Tensor((16, 16), "float32"), w1: R.Tensor((16, 16), "float32"),
                 w2: R.Tensor((16, 16), "float32")):
            with R.dataflow():
                loss = R.sum(x)
                loss_adjoint = R.ones((), "float32")
                h_cp = R.matmul(x, w1)
                a_cp = R.matmul(h_cp, w1)
                y_cp = R.matmul(a_cp, w2)
                y_adjoint = R.multiply(R.broadcast_to(loss_adjoint, (16, 16)), y_cp)
                a_adjoint = R.matmul(y_adjoint, R.permute_dims(w2))
                w2_adjoint = R.matmul(R.permute_dims(a_cp), y_adjoint)
                h_adjoint = R.matmul(a_adjoint, R.permute_dims(w1))
                w1_adjoint = R.add(R.matmul(R.permute_dims(x), h_adjoint),
                                   R.matmul(R.permute_dims(h_cp), a_adjoint))
                R.output(loss, w1_adjoint, w2_adjoint)
            return (loss, w1_adjoint, w2_adjoint)

    separated = SeparateBackward()(MatmulChain)
    after, messages = late_reads(MatmulChain)
    tvm.ir.assert_structural_equal(after, separated)
    assert messages == []


def test_attention_scores_are_recomputed_below_a_softmax() -> None:
    """An attention core and a feed-forward layer after it, recomputed in a checkpointed call:
    the probabilities `p_cp`, read by the recomputed `p_cp @ v` and, after the feed-forward
    gradients (the peak), by the attention's gradients, are redone from q and k (both live for
    their own gradients), scores matmul included."""

    @I.ir_module
    class Attention:
        @R.function
        def main(q: R.Tensor((2, 8, 4), "float32"), k: R.Tensor((2, 4, 8), "float32"),
                 v: R.Tensor((2, 8, 4), "float32"), w: R.Tensor((4, 64), "float32")):
            with R.dataflow():
                loss = R.sum(q)
                loss_adjoint = R.ones((), "float32")
                s_cp = R.matmul(q, k)
                p_cp = R.nn.softmax(s_cp, axis=-1)
                o_cp = R.matmul(p_cp, v)
                f_cp = R.matmul(o_cp, w)
                f_adjoint = R.multiply(R.broadcast_to(loss_adjoint, (2, 8, 64)), f_cp)
                w_adjoint = R.sum(R.matmul(R.permute_dims(o_cp, [0, 2, 1]), f_adjoint), axis=[0])
                o_adjoint = R.matmul(f_adjoint, R.permute_dims(w))
                v_adjoint = R.matmul(R.permute_dims(p_cp, [0, 2, 1]), o_adjoint)
                p_adjoint = R.matmul(o_adjoint, R.permute_dims(v, [0, 2, 1]))
                s_adjoint = R.multiply(p_cp, R.subtract(p_adjoint, R.sum(R.multiply(p_adjoint, p_cp), axis=[-1],
                                                                         keepdims=True)))
                q_adjoint = R.matmul(s_adjoint, R.permute_dims(k, [0, 2, 1]))
                k_adjoint = R.matmul(R.permute_dims(q, [0, 2, 1]), s_adjoint)
                R.output(loss, q_adjoint, k_adjoint, v_adjoint, w_adjoint)
            return (loss, q_adjoint, k_adjoint, v_adjoint, w_adjoint)

    after, messages = late_reads(Attention)
    assert messages == ["RecomputeLateReads: checkpointed value recomputed where read late x1"]
    *_, last = after["main"].body.blocks
    redone = [(b.var.name, b.value.op.name) for b in last.bindings
              if isinstance(b.value, relax.Call) and b.var.name.endswith("_again")]
    assert redone == [("s_cp_again", "relax.matmul"), ("p_cp_again", "relax.nn.softmax")]
    readers = [b.var.name for b in last.bindings if any(v.name == "p_cp" for v in relax.analysis.free_vars(b.value))]
    assert readers == []  # every late reader reads p_cp_again


def test_a_step_without_recomputed_values_is_left_alone() -> None:
    """A plain backward pass (nothing forward is recomputed) keeps its two blocks as they are."""

    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((16, 16), "float32"), w: R.Tensor((16, 16), "float32")):
            with R.dataflow():
                y = R.nn.gelu(R.matmul(x, w))
                loss = R.sum(y)
                loss_adjoint = R.ones((), "float32")
                y_adjoint = R.broadcast_to(loss_adjoint, (16, 16))
                w_adjoint = R.matmul(R.permute_dims(x), R.multiply(y_adjoint, R.sigmoid(y)))
                R.output(loss, w_adjoint)
            return (loss, w_adjoint)

    separated = SeparateBackward()(Plain)
    after, messages = late_reads(Plain)
    tvm.ir.assert_structural_equal(after, separated)
    assert messages == []

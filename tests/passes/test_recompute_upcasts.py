"""RecomputeUpcasts redoes in the backward pass the forward pass's float32 casts of 16-bit
tensors, and SeparateBackward puts the two passes in separate dataflow blocks (before/after IR;
the memory they save is measured in docs/benchmarks.md)."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.recompute_upcasts import RecomputeUpcasts
from relay_passes.separate_backward import SeparateBackward


@I.ir_module
class Step:
    @R.function
    def main(x: R.Tensor((4, 8), "bfloat16"), w: R.Tensor((8,), "float32")):
        with R.dataflow():
            y = R.astype(x, "float32")
            z = R.multiply(y, w)
            loss = R.sum(z)
            loss_adjoint = R.ones((), "float32")
            z_adjoint = R.broadcast_to(loss_adjoint, (4, 8))
            w_adjoint = R.sum(R.multiply(z_adjoint, y), axis=[0])
            R.output(loss, w_adjoint)
        return (loss, w_adjoint)


def test_upcast_read_by_the_backward_pass_is_redone_there() -> None:
    """y is read by the forward multiply and by the weight gradient: the gradient reads a new
    cast, made right before it, and y dies in the forward pass."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "bfloat16"), w: R.Tensor((8,), "float32")):
            with R.dataflow():
                y = R.astype(x, "float32")
                z = R.multiply(y, w)
                loss = R.sum(z)
                loss_adjoint = R.ones((), "float32")
                z_adjoint = R.broadcast_to(loss_adjoint, (4, 8))
                y_again = R.astype(x, "float32")
                w_adjoint = R.sum(R.multiply(z_adjoint, y_again), axis=[0])
                R.output(loss, w_adjoint)
            return (loss, w_adjoint)

    messages: list[str] = []
    tvm.ir.assert_structural_equal(RecomputeUpcasts(report=messages.append)(Step), Expected)
    assert messages == ["RecomputeUpcasts: float32 cast redone in the backward pass x1"]


def test_other_casts_and_inference_functions_are_left_alone() -> None:
    """A float32 -> float16 cast, a cast only the forward pass reads, and a function without a
    backward pass keep their form."""

    @I.ir_module
    class Other:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), h: R.Tensor((4, 8), "bfloat16")):
            with R.dataflow():
                down = R.astype(x, "float16")
                up = R.astype(h, "float32")
                loss = R.sum(R.add(R.astype(down, "float32"), up))
                loss_adjoint = R.ones((), "float32")
                x_adjoint = R.multiply(R.broadcast_to(loss_adjoint, (4, 8)), R.astype(down, "float32"))
                R.output(loss, x_adjoint)
            return (loss, x_adjoint)

        @R.function
        def infer(h: R.Tensor((4, 8), "bfloat16")):
            with R.dataflow():
                up = R.astype(h, "float32")
                out = R.add(up, up)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(RecomputeUpcasts()(Other), Other)


def test_backward_pass_gets_its_own_block() -> None:
    """The cut is at the first adjoint; the forward values the backward pass reads (y, loss is
    an output already) become block outputs."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "bfloat16"), w: R.Tensor((8,), "float32")):
            with R.dataflow():
                y = R.astype(x, "float32")
                z = R.multiply(y, w)
                loss = R.sum(z)
                R.output(y, loss)
            R.tuple()  # the boundary: Relax's normalizer merges adjacent dataflow blocks
            with R.dataflow():
                loss_adjoint = R.ones((), "float32")
                z_adjoint = R.broadcast_to(loss_adjoint, (4, 8))
                w_adjoint = R.sum(R.multiply(z_adjoint, y), axis=[0])
                R.output(w_adjoint)
            return (loss, w_adjoint)

    messages: list[str] = []
    after = SeparateBackward(report=messages.append)(Step)
    tvm.ir.assert_structural_equal(after, Expected)
    assert [type(b).__name__ for b in after["main"].body.blocks] == ["DataflowBlock", "BindingBlock", "DataflowBlock"]
    assert messages == ["SeparateBackward: forward and backward passes in separate blocks in main"]


def test_the_cut_holds_through_normalization_and_fusion() -> None:
    """Until FuseOps has run, the two passes stay in two dataflow blocks (without the boundary
    the normalizer merged them back at once, and the pass changed nothing), so that no fused
    kernel mixes the two passes' work."""
    mod = SeparateBackward()(Step)
    mod = relax.transform.Normalize()(mod)
    mod = relax.transform.LegalizeOps()(mod)
    mod = relax.transform.FuseOps()(relax.transform.AnnotateTIROpPattern()(mod))
    blocks = [b for b in mod["main"].body.blocks if isinstance(b, relax.DataflowBlock)]
    assert len(blocks) == 2


def test_a_function_without_a_backward_pass_keeps_one_block() -> None:
    @I.ir_module
    class Infer:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(SeparateBackward()(Infer), Infer)


def test_a_view_the_backward_pass_reads_is_made_again_there() -> None:
    """`r`, a reshape of the forward value `h`, is read by both passes: the backward pass reads
    its own reshape of `h`, so the forward block passes on `h` itself (a view read on both
    sides became a second output of a fused kernel: a copy)."""

    @I.ir_module
    class Viewed:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                h = R.exp(x)
                r = R.reshape(h, (8, 4))
                loss = R.sum(r)
                loss_adjoint = R.ones((), "float32")
                x_adjoint = R.reshape(R.multiply(R.broadcast_to(loss_adjoint, (8, 4)), r), (4, 8))
                R.output(loss, x_adjoint)
            return (loss, x_adjoint)

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                h = R.exp(x)
                r = R.reshape(h, (8, 4))
                loss = R.sum(r)
                R.output(h, loss)
            R.tuple()
            with R.dataflow():
                loss_adjoint = R.ones((), "float32")
                lv = R.broadcast_to(loss_adjoint, (8, 4))
                r_again = R.reshape(h, (8, 4))
                x_adjoint = R.reshape(R.multiply(lv, r_again), (4, 8))
                R.output(x_adjoint)
            return (loss, x_adjoint)

    tvm.ir.assert_structural_equal(SeparateBackward()(Viewed), Expected)


@I.ir_module
class ConvStep:
    """A training step whose backward pass scales a forward activation (as a batch norm's
    gradient does, `h * 2 / N`), with an eval-mode batch norm for InferenceBatchNormAsScale."""

    @R.function
    def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
             gamma: R.Tensor((4,), "float32"), beta: R.Tensor((4,), "float32"),
             mean: R.Tensor((4,), "float32"), var: R.Tensor((4,), "float32")):
        with R.dataflow():
            h = R.nn.conv2d(x, w, padding=[1, 1])
            bn = R.nn.batch_norm(h, gamma, beta, mean, var, axis=1, epsilon=1e-5, training=False)
            y = bn[0]
            loss = R.sum(y)
            loss_adjoint = R.ones((), "float32")
            y_adjoint = R.broadcast_to(loss_adjoint, (2, 4, 8, 8))
            h_scaled = R.multiply(h, R.const(0.25, "float32"))
            gamma_adjoint = R.sum(R.multiply(y_adjoint, h_scaled), axis=[0, 2, 3])
            R.output(loss, gamma_adjoint)
        return (loss, gamma_adjoint)


def test_the_cut_holds_through_the_pipeline_up_to_fusion() -> None:
    """Every pass between SeparateBackward and FuseOps keeps the boundary, those that drop unused
    bindings included (InferenceBatchNormAsScale's removal of unread bindings took the unread
    boundary with it: FuseEpilogue then took the backward pass's `h * 0.25` into the forward
    convolution as a second output, kept to the backward pass: a whole extra activation per
    batch norm, 90 of the benchmark CNN training step's 273 MiB)."""
    from tvmgraph.config import compile_options
    from tvmgraph.pipeline import get_pipeline

    cpu = tvm.target.Target({"kind": "llvm"})
    out = get_pipeline(cpu, compile_options(None), checks=False).until("FuseTIR")(ConvStep)
    blocks = [b for b in out["main"].body.blocks if isinstance(b, relax.DataflowBlock)]
    assert len(blocks) == 2
    forward_calls = [b.value for b in blocks[0].bindings if isinstance(b.value, relax.Call)]
    scaled_in_forward = [c for c in forward_calls if "0.25" in str(c)]
    assert not scaled_in_forward, scaled_in_forward


def test_a_conv_batch_norm_training_step_keeps_no_backward_work_in_its_forward_kernels() -> None:
    """Through tvmgraph's lowering and pipeline, a Conv-BN-ReLU6 block's training step: up to
    fusion the forward and backward passes stay two blocks and every fused forward kernel has
    one output (with the blocks merged, a batch norm's `h * 2 / N` was fused into the benchmark
    CNN's convolutions as second outputs and kept to the backward pass: 90 MiB), and the step
    equals eager torch."""
    import copy

    import torch
    from torch import nn

    from tests.conftest import TrainGraph, assert_close, lower_train_step
    from tvmgraph.pipeline import get_pipeline

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                          nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.ReLU6(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2,))  # 32 wide: direct convolutions
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    lowered, options = lower_train_step(graph, x, y)
    cpu = tvm.target.Target({"kind": "llvm"})
    fused = get_pipeline(cpu, options, checks=False).until("FuseTIR")(lowered.mod)
    blocks = [b for b in fused[lowered.entry].body.blocks if isinstance(b, relax.DataflowBlock)]
    assert len(blocks) == 2  # forward, backward (InferenceBatchNormAsScale's cleanup merged them)
    forward = blocks[0]
    kernels = [b.value.args[0].name_hint for b in forward.bindings  # calls of TIR kernels with
               if isinstance(b.value, relax.Call) and isinstance(b.var.ty, relax.TupleType)  # several
               and isinstance(b.value.args[0], tvm.ir.GlobalVar)]  # outputs
    several = [name for name in kernels if name.startswith("fused_")]  # a batch norm's own aside
    assert not several, several

    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(eager(x), y)
        loss.backward()
        optimizer.step()
        assert_close(graph(x, y), loss.detach(), atol=1e-5, rtol=1e-5)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_close(p, q, atol=1e-5, rtol=1e-4)

"""ShareTransposes: the same transpose of one tensor, repeated, is computed once; FuseEpilogue
then leaves it out of the matmul kernels (an RNN's recurrent weight, transposed once)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.fuse_epilogue import FuseEpilogue
from relay_passes.share_transposes import ShareTransposes
from tests.conftest import ModuleGraph
from tests.models import assert_rnn_trains_as_in_eager


@I.ir_module
class Steps:
    """Two time steps of `h @ W.T`, each with its own transpose (as torch.export writes them)."""

    @R.function
    def main(h: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            h1 = R.tanh(R.matmul(h, wt))
            wt2 = R.permute_dims(w, axes=[1, 0])
            h2 = R.tanh(R.matmul(h1, wt2))
            R.output(h2)
        return h2


def test_repeated_transposes_of_a_weight_become_one() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(h: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                h1 = R.tanh(R.matmul(h, wt))
                h2 = R.tanh(R.matmul(h1, wt))
                R.output(h2)
            return h2

    tvm.ir.assert_structural_equal(ShareTransposes()(Steps), Expected)


def test_fuse_epilogue_then_keeps_the_shared_transpose_out_of_the_products() -> None:
    """Before: both products call a kernel that transposes W itself. After: neither does; the
    one transpose stays a binding of its own."""

    def calls_that_transpose(mod: tvm.IRModule) -> int:
        return FuseEpilogue()(mod).script().count("= cls.fused_relax_permute_dims")

    assert calls_that_transpose(Steps) == 2
    assert calls_that_transpose(ShareTransposes()(Steps)) == 0
    assert "= R.permute_dims(w" in FuseEpilogue()(ShareTransposes()(Steps)).script()


def test_other_axes_other_tensors_and_block_outputs_stay() -> None:
    @I.ir_module
    class Distinct:
        @R.function
        def main(x: R.Tensor((2, 3, 4), "float32"), y: R.Tensor((2, 3, 4), "float32")):
            with R.dataflow():
                a = R.permute_dims(x, axes=[0, 2, 1])
                b = R.permute_dims(x, axes=[2, 1, 0])  # other axes
                c = R.permute_dims(y, axes=[0, 2, 1])  # another tensor
                d = R.add(R.sum(a), R.add(R.sum(b), R.sum(c)))
                e = R.permute_dims(x, axes=[0, 2, 1])  # a block output: kept as the user's result
                R.output(d, e)
            return (d, e)

    tvm.ir.assert_structural_equal(ShareTransposes()(Distinct), Distinct)


def test_the_same_transpose_in_another_dataflow_block_stays() -> None:
    """A dataflow variable is not visible outside its block: a training step's backward pass
    (its own block, SeparateBackward) transposes again."""
    h, w = relax.Var("h", relax.TensorType((4, 8), "float32")), relax.Var("w", relax.TensorType((8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [h, w]):
        with bb.dataflow():
            h1 = bb.emit_output(relax.op.matmul(h, bb.emit(relax.op.permute_dims(w, [1, 0]))))
        bb.emit(relax.Tuple([]))  # a binding block between the two, as SeparateBackward's boundary
        with bb.dataflow():
            h2 = bb.emit_output(relax.op.matmul(h1, bb.emit(relax.op.permute_dims(w, [1, 0]))))
        bb.emit_func_output(h2)
    before = bb.get()
    assert len(before["main"].body.blocks) == 3
    tvm.ir.assert_structural_equal(ShareTransposes()(before), before)


def test_reports_what_it_shared() -> None:
    said: list[str] = []
    ShareTransposes(said.append)(Steps)
    assert said == ["ShareTransposes: repeated transpose x1"]


def test_results_equal_the_repeated_transposes() -> None:
    rng = np.random.default_rng(0)
    h, w = rng.standard_normal((4, 8)).astype("float32"), rng.standard_normal((8, 8)).astype("float32")
    results = []
    for mod in (Steps, ShareTransposes()(Steps)):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(h), tvm.runtime.tensor(w)).numpy())
    np.testing.assert_array_equal(*results)


def test_an_lstm_and_a_gru_run_and_train_as_in_eager(caplog: pytest.LogCaptureFixture) -> None:
    """torch.export writes `h @ W_hh.T` with a transpose per time step (7 here): the pipeline
    shares them (debug(1) says so), inference equals eager's to float32 rounding, and three SGD
    steps train as eager does."""
    from examples.zoo import RNNClassifier

    torch.manual_seed(0)
    for cell in ("lstm", "gru"):
        model = RNNClassifier(cell, vocab=20, d=8, hidden=12, classes=3).eval()
        idx = torch.randint(0, 20, (4, 7))
        with torch.no_grad():
            expected = model(idx)
        graph = ModuleGraph(model)
        graph.debug(1)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tvmgraph"):
            got = graph(idx)
        assert "ShareTransposes: repeated transpose x6" in caplog.text
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        assert_rnn_trains_as_in_eager(cell)

"""SplitAsSlices: a split read element-wise becomes one strided slice per piece, which FuseOps
fuses into its readers (an LSTM's gates)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.split_as_slices import SplitAsSlices
from tests.models import assert_rnn_trains_as_in_eager


@I.ir_module
class Gates:
    """An LSTM cell's gate update: chunk(4) of the pre-activations, sigmoid/tanh of each."""

    @R.function
    def main(g: R.Tensor((2, 16), "float32"), c: R.Tensor((2, 4), "float32")):
        with R.dataflow():
            s = R.split(g, 4, axis=1)
            i = s[0]
            f = s[1]
            n = s[2]
            o = s[3]
            c2 = R.add(R.multiply(R.sigmoid(f), c), R.multiply(R.sigmoid(i), R.tanh(n)))
            h = R.multiply(R.sigmoid(o), R.tanh(c2))
            R.output(c2, h)
        return (c2, h)


def test_pieces_read_element_wise_are_slices() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(g: R.Tensor((2, 16), "float32"), c: R.Tensor((2, 4), "float32")):
            with R.dataflow():
                i = R.strided_slice(g, axes=[1], begin=[0], end=[4], assume_inbound=True)
                f = R.strided_slice(g, axes=[1], begin=[4], end=[8], assume_inbound=True)
                n = R.strided_slice(g, axes=[1], begin=[8], end=[12], assume_inbound=True)
                o = R.strided_slice(g, axes=[1], begin=[12], end=[16], assume_inbound=True)
                c2 = R.add(R.multiply(R.sigmoid(f), c), R.multiply(R.sigmoid(i), R.tanh(n)))
                h = R.multiply(R.sigmoid(o), R.tanh(c2))
                R.output(c2, h)
            return (c2, h)

    tvm.ir.assert_structural_equal(SplitAsSlices()(Gates), Expected)


def test_split_at_indices_slices_between_them() -> None:
    @I.ir_module
    class Before:
        @R.function
        def main(g: R.Tensor((2, 10), "float32")):
            with R.dataflow():
                s = R.split(g, [3, 7], axis=-1)
                a = R.exp(s[0])
                b = R.exp(s[2])
                R.output(a, b)
            return (a, b)

    out = SplitAsSlices()(Before)
    slices = [b.value for b in out["main"].body.blocks[0].bindings
              if isinstance(b.value, relax.Call) and b.value.op.name == "relax.strided_slice"]
    assert [(int(s.args[2][0]), int(s.args[3][0])) for s in slices] == [(0, 3), (7, 10)]
    assert not any(isinstance(b.value, relax.Call) and b.value.op.name == "relax.split"
                   for b in out["main"].body.blocks[0].bindings)


def test_a_piece_read_by_a_matmul_keeps_the_split() -> None:
    """An attention's q/k/v: each piece would become a copy of its own."""

    @I.ir_module
    class QKV:
        @R.function
        def main(x: R.Tensor((4, 12), "float32"), w: R.Tensor((4, 4), "float32")):
            with R.dataflow():
                s = R.split(x, 3, axis=1)
                q = s[0]
                k = s[1]
                a = R.matmul(q, w)
                b = R.sigmoid(k)
                R.output(a, b)
            return (a, b)

    tvm.ir.assert_structural_equal(SplitAsSlices()(QKV), QKV)


def test_a_piece_that_is_a_block_output_keeps_the_split() -> None:
    @I.ir_module
    class Output:
        @R.function
        def main(x: R.Tensor((4, 12), "float32")):
            with R.dataflow():
                s = R.split(x, 3, axis=1)
                q = s[0]
                k = R.sigmoid(s[1])
                R.output(q, k)
            return (q, k)

    tvm.ir.assert_structural_equal(SplitAsSlices()(Output), Output)


def _kernels(mod: tvm.IRModule) -> list[str]:
    T = relax.transform
    mod = T.FuseTIR()(T.FuseOps()(T.AnnotateTIROpPattern()(T.LegalizeOps()(mod))))
    return sorted(gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))


def test_the_cell_update_is_one_kernel_reading_the_gates() -> None:
    """Before: a split kernel copying the four pieces out, then the cell update and the output
    (the cell state has two readers, so it ends a kernel)."""
    assert len(_kernels(Gates)) == 3
    assert len(_kernels(SplitAsSlices()(Gates))) == 2


def test_results_equal_the_split() -> None:
    rng = np.random.default_rng(0)
    g, c = rng.standard_normal((2, 16)).astype("float32"), rng.standard_normal((2, 4)).astype("float32")
    results = []
    for mod in (Gates, SplitAsSlices()(Gates)):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        results.append([t.numpy() for t in vm["main"](tvm.runtime.tensor(g), tvm.runtime.tensor(c))])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_lstm_and_gru_train_as_in_eager() -> None:
    """The cells' chunks are splits read by sigmoid and tanh: three SGD steps against eager."""
    for cell in ("lstm", "gru"):
        assert_rnn_trains_as_in_eager(cell)

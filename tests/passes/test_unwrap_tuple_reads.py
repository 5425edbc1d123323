"""UnwrapTupleReads: a field read from a tuple literal is the field itself, so that FuseOps
keeps the binding it would lose (max_unpool's training graph failed to compile)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.unwrap_tuple_reads import UnwrapTupleReads
from tests.conftest import SGDStep


@I.ir_module
class IndexRead:
    """How LegalizeOps reads index_tensor's indices: through `(i,)[0]`."""

    @R.function
    def main(x: R.Tensor((6,), "float32"), j: R.Tensor((3,), "int64")):
        with R.dataflow():
            i = R.reshape(j, R.shape([3]))
            k = (i,)[0]
            y = R.take(x, k, axis=0)
            R.output(y)
        return y


def test_tuple_literal_read_becomes_the_field() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((6,), "float32"), j: R.Tensor((3,), "int64")):
            with R.dataflow():
                i = R.reshape(j, R.shape([3]))
                y = R.take(x, i, axis=0)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(UnwrapTupleReads()(IndexRead), Expected)


def test_a_read_of_a_variable_bound_to_a_tuple_literal_is_the_field() -> None:
    """How the group norm's converter binds torch's (out, mean, rstd) when nothing reads the
    statistics: `t = (y, y, y); z = t[0]`. The reader reads y, and the tuple, unread, goes."""

    @I.ir_module
    class GroupNormOutputs:
        @R.function
        def main(x: R.Tensor((6,), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                t = (y, y, y)
                z = t[0]
                o = R.sigmoid(z)
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((6,), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                o = R.sigmoid(y)
                R.output(o)
            return o

    tvm.ir.assert_structural_equal(UnwrapTupleReads()(GroupNormOutputs), Expected)


def test_a_read_of_a_kernels_results_stays() -> None:
    """A tuple a call returns (a kernel's results) is no literal: read as it is."""

    @I.ir_module
    class Results:
        @R.function
        def main(x: R.Tensor((6,), "float32")):
            with R.dataflow():
                t = R.split(x, 2)
                k = t[0]
                y = R.add(k, k)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(UnwrapTupleReads()(Results), Results)


def test_a_tuple_literal_nothing_reads_is_dropped() -> None:
    """How LegalizeOps leaves the gradient of a split: the concatenation reads the fields, the
    tuple it was given is read by nothing."""

    @I.ir_module
    class Before:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                x = R.sigmoid(a)
                y = R.multiply(a, b)
                t = (x, y)
                z = R.concat((x, y), axis=1)
                R.output(z)
            return z

    @I.ir_module
    class Expected:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                x = R.sigmoid(a)
                y = R.multiply(a, b)
                z = R.concat((x, y), axis=1)
                R.output(z)
            return z

    tvm.ir.assert_structural_equal(UnwrapTupleReads()(Before), Expected)


def test_a_tuple_literal_a_block_output_stays() -> None:
    @I.ir_module
    class Output:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                x = R.sigmoid(a)
                t = (x, b)
                R.output(t)
            return t

    tvm.ir.assert_structural_equal(UnwrapTupleReads()(Output), Output)


def test_the_fields_of_a_dropped_tuple_fuse_into_their_concatenation() -> None:
    """Legalized and fused: one kernel computes both fields and concatenates them (with the
    dead tuple left in, FuseOps kept three kernels)."""
    T = tvm.relax.transform

    @I.ir_module
    class Gradient:
        @R.function
        def main(a: R.Tensor((2, 3), "float32"), b: R.Tensor((2, 3), "float32")):
            with R.dataflow():
                x = R.sigmoid(a)
                y = R.multiply(a, b)
                t = (x, y)
                z = R.concat(t, axis=1)
                R.output(z)
            return z

    def kernels(mod):
        mod = T.AnnotateTIROpPattern()(mod)
        mod = T.FuseTIR()(T.FuseOps()(mod))
        return sum(1 for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))

    legalized = T.LegalizeOps()(Gradient)
    assert kernels(legalized) == 3
    assert kernels(UnwrapTupleReads()(legalized)) == 1


def test_max_unpool_trains_as_in_eager() -> None:
    """max_unpool2d scatters into zeros with index_put; its gradient reads the pooling indices
    (a kernel behind no_grad) with index_tensor. Before: autodiff reached the indices kernel,
    then FuseOps left an ill-formed module."""

    class Unpool(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return F.max_unpool2d(*F.max_pool2d(self.conv(x), 2, return_indices=True), 2).pow(2).sum()

    torch.manual_seed(0)
    model, x = Unpool(), torch.randn(2, 4, 6, 6)
    reference = Unpool()
    reference.load_state_dict(model.state_dict())
    reference(x).backward()
    before = [p.detach().clone() for p in model.parameters()]
    SGDStep(model)(x)
    for b, p, r in zip(before, model.parameters(), reference.parameters()):
        torch.testing.assert_close(b - p.detach(), r.grad, atol=1e-5, rtol=1e-4)

"""InferenceBatchNormAsScale: an eval-mode batch norm's output is `x * scale + shift`, which
FuseEpilogue then takes into the convolution before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.fuse_epilogue import FuseEpilogue
from relay_passes.inference_batch_norm import InferenceBatchNormAsScale


@I.ir_module
class ConvBatchNorm:
    @R.function
    def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
             gamma: R.Tensor((4,), "float32"), beta: R.Tensor((4,), "float32"),
             mean: R.Tensor((4,), "float32"), var: R.Tensor((4,), "float32")):
        with R.dataflow():
            c = R.nn.conv2d(x, w, padding=[1, 1])
            bn = R.nn.batch_norm(c, gamma, beta, mean, var, axis=1, epsilon=1e-5, training=False)
            y = bn[0]
            r = R.clip(y, R.prim_value(0), R.prim_value(6))
            R.output(r)
        return r


def test_an_eval_batch_norm_becomes_a_per_channel_multiply_add() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
                 gamma: R.Tensor((4,), "float32"), beta: R.Tensor((4,), "float32"),
                 mean: R.Tensor((4,), "float32"), var: R.Tensor((4,), "float32")):
            with R.dataflow():
                c = R.nn.conv2d(x, w, padding=[1, 1])
                inv = R.divide(R.const(1.0, "float32"), R.sqrt(R.add(var, R.const(1e-5, "float32"))))
                scale = R.multiply(gamma, inv)
                shift = R.add(beta, R.negative(R.multiply(mean, scale)))
                scale4 = R.reshape(scale, R.shape([1, 4, 1, 1]))
                shift4 = R.reshape(shift, R.shape([1, 4, 1, 1]))
                scaled = R.multiply(c, scale4)
                y = R.add(scaled, shift4)
                r = R.clip(y, R.prim_value(0), R.prim_value(6))
                R.output(r)
            return r

    tvm.ir.assert_structural_equal(InferenceBatchNormAsScale()(ConvBatchNorm), Expected)


def test_a_training_batch_norm_stays() -> None:
    @I.ir_module
    class Training:
        @R.function
        def main(x: R.Tensor((2, 4, 8, 8), "float32"), gamma: R.Tensor((4,), "float32"),
                 beta: R.Tensor((4,), "float32"), mean: R.Tensor((4,), "float32"),
                 var: R.Tensor((4,), "float32")):
            with R.dataflow():
                bn = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, training=True)
                y = bn[0]
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(InferenceBatchNormAsScale()(Training), Training)


def test_the_multiply_add_joins_the_convolutions_epilogue_and_matches_torch() -> None:
    """One group: conv2d, multiply, add, clip (ReLU6); the result equals torch's eval-mode
    conv -> BatchNorm2d -> ReLU6."""
    mod = FuseEpilogue()(InferenceBatchNormAsScale()(ConvBatchNorm))
    groups = [f for _, f in mod.functions_items() if isinstance(f, relax.Function) and "Composite" in (f.attrs or {})]
    assert len(groups) == 1
    ops = [b.value.op.name for b in groups[0].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops == ["relax.nn.conv2d", "relax.multiply", "relax.add", "relax.clip"], ops
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = torch.nn.functional.relu6(bn.eval()(conv(x)))
    target = tvm.target.Target({"kind": "llvm"})
    with target:
        built = relax.transform.LegalizeOps()(mod)
    vm = relax.VirtualMachine(tvm.compile(built, target=target), tvm.cpu())
    args = [x, conv.weight, bn.weight, bn.bias, bn.running_mean, bn.running_var]
    got = vm["main"](*[tvm.runtime.tensor(a.detach().numpy()) for a in args]).numpy()
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("multiplied", ["gate", "per_channel"])
def test_fuse_epilogue_takes_a_per_channel_multiply_only(multiplied: str) -> None:
    """A product of two activations (a gate) is not an epilogue."""
    shape = (2, 4, 8, 8) if multiplied == "gate" else (1, 4, 1, 1)

    @I.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
                 s: R.Tensor(shape, "float32")):
            with R.dataflow():
                c = R.nn.conv2d(x, w, padding=[1, 1])
                y = R.multiply(c, s)
                R.output(y)
            return y

    mod = FuseEpilogue()(Mod)
    groups = [f for _, f in mod.functions_items() if isinstance(f, relax.Function) and "Composite" in (f.attrs or {})]
    assert len(groups) == (0 if multiplied == "gate" else 1)

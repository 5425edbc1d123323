"""AccumulateFloat32: half-precision matmuls and sums accumulate in float32, rounded once."""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.accumulate_float32 import AccumulateFloat32


@I.ir_module
class Bfloat16Linear:
    """A bfloat16 linear layer and its bias gradient, as autocast and autodiff make them."""

    @R.function
    def main(x: R.Tensor((8, 64), "bfloat16"), w: R.Tensor((64, 16), "bfloat16"),
             dy: R.Tensor((8, 16), "bfloat16"), f: R.Tensor((8, 16), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            db = R.collapse_sum_to(dy, R.shape([16]))
            s = R.sum(f, axis=[0])
            R.output(y, db, s)
        return (y, db, s)


def test_half_reductions_accumulate_in_float32_and_float32_is_untouched() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((8, 64), "bfloat16"), w: R.Tensor((64, 16), "bfloat16"),
                 dy: R.Tensor((8, 16), "bfloat16"), f: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                lv = R.matmul(x, w, out_dtype="float32")
                y = R.astype(lv, "bfloat16")
                lv1 = R.astype(dy, "float32")
                lv2 = R.collapse_sum_to(lv1, R.shape([16]))
                db = R.astype(lv2, "bfloat16")
                s = R.sum(f, axis=[0])
                R.output(y, db, s)
            return (y, db, s)

    tvm.ir.assert_structural_equal(AccumulateFloat32()(Bfloat16Linear), Expected)


def test_reports_what_it_rewrote() -> None:
    messages: list[str] = []
    AccumulateFloat32(messages.append)(Bfloat16Linear)
    assert messages == ["AccumulateFloat32: collapse_sum_to x1, matmul x1"]


def test_matmul_rounds_once_like_torch() -> None:
    """The bfloat16 matmul equals torch's (float32 accumulator, one rounding) bit for bit on
    these integer-valued inputs, where a bfloat16 accumulator loses the low bits."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(1, 9, (8, 64)).astype("float32")).bfloat16()
    w = torch.from_numpy(rng.integers(1, 9, (64, 16)).astype("float32")).bfloat16()
    mod = AccumulateFloat32()(Bfloat16Linear)
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    dy, f = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8, 16)
    y = torch.from_dlpack(vm["main"](x, w, dy, f)[0])
    assert torch.equal(y, x @ w)


@I.ir_module
class Bfloat16Activations:
    @R.function
    def main(x: R.Tensor((4, 64), "bfloat16")):
        with R.dataflow():
            g = R.nn.gelu(x)
            e = R.exp(x)
            s = R.nn.softmax(x, axis=-1)
            R.output(g, e, s)
        return (g, e, s)


def test_activations_compute_in_float32() -> None:
    """gelu(x) -> astype(gelu(astype(x, float32)), bfloat16), and so on for exp and softmax."""
    after = AccumulateFloat32()(Bfloat16Activations)
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    assert [c.op.name.removeprefix("relax.") for c in calls] == [
        "astype", "nn.gelu", "astype", "astype", "exp", "astype", "astype", "nn.softmax", "astype"]
    assert [str(c.attrs.dtype) for c in calls if c.op.name == "relax.astype"] == ["float32", "bfloat16"] * 3


def test_activations_round_once_like_torch() -> None:
    """Within one bfloat16 step (2**-8 relative; 1e-4 absolute in gelu's tail, where TVM's and
    torch's erf differ) of torch's bfloat16 gelu, exp and softmax, which compute in float32."""
    x = (torch.randn(4, 64) * 3).bfloat16()
    mod = AccumulateFloat32()(Bfloat16Activations)
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = [torch.from_dlpack(t) for t in vm["main"](x)]
    expected = [torch.nn.functional.gelu(x), torch.exp(x), torch.softmax(x, dim=-1)]
    for name, g, e in zip(("gelu", "exp", "softmax"), got, expected):
        assert g.dtype == torch.bfloat16, name
        torch.testing.assert_close(g.float(), e.float(), rtol=2**-8, atol=1e-4, msg=name)

"""SimplifyBroadcastMatmul: matmuls read broadcast weights in place, forward and backward.

The modules are the shapes torch.export and autodiff produce for `nn.MultiheadAttention`'s
in-projection (x: (B, M, K) times a broadcast (K, N) weight), shrunk.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.simplify_broadcast_matmul import SimplifyBroadcastMatmul


@I.ir_module
class Forward:
    @R.function
    def main(x: R.Tensor((4, 2, 8), "float32"), w: R.Tensor((6, 8), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            xb = R.broadcast_to(x, R.shape([4, 2, 8]))
            wb = R.broadcast_to(wt, R.shape([4, 8, 6]))
            y = R.matmul(xb, wb, out_dtype="float32")
            R.output(y)
        return y


@I.ir_module
class Backward:
    @R.function
    def main(x: R.Tensor((4, 2, 8), "float32"), dy: R.Tensor((4, 2, 6), "float32"),
             w: R.Tensor((6, 8), "float32")):
        with R.dataflow():
            wt = R.permute_dims(w, axes=[1, 0])
            wb = R.broadcast_to(wt, R.shape([4, 8, 6]))
            wbt = R.permute_dims(wb, axes=[0, 2, 1])
            dx = R.matmul(dy, wbt)
            xt = R.permute_dims(x, axes=[0, 2, 1])
            dwb = R.matmul(xt, dy)
            dwt = R.collapse_sum_to(dwb, R.shape([8, 6]))
            dw = R.permute_dims(dwt, axes=[1, 0])
            R.output(dx, dw)
        return (dx, dw)


@I.ir_module
class OuterProduct:
    @R.function
    def main(dy: R.Tensor((1, 6), "float32"), x: R.Tensor((1, 8), "float32")):
        with R.dataflow():
            dyt = R.permute_dims(dy, axes=[1, 0])
            dw = R.matmul(dyt, x)
            R.output(dw)
        return dw


def test_broadcast_weight_is_read_in_place() -> None:
    """The (4, 8, 6) copy of the weight goes; matmul broadcasts the 2-D weight itself, and the
    identity broadcast of x is dropped."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 2, 8), "float32"), w: R.Tensor((6, 8), "float32")):
            with R.dataflow():
                wt = R.permute_dims(w, axes=[1, 0])
                y = R.matmul(x, wt, out_dtype="float32")
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(SimplifyBroadcastMatmul()(Forward), Expected)


def test_gradient_of_broadcast_weight_is_one_matmul() -> None:
    """dx multiplies by w itself (the transposes of the broadcast cancel); the weight gradient
    is one (8, 8) x (8, 6) product over batch and rows together, not 4 products summed."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 2, 8), "float32"), dy: R.Tensor((4, 2, 6), "float32"),
                 w: R.Tensor((6, 8), "float32")):
            with R.dataflow():
                dx = R.matmul(dy, w)
                rows = R.reshape(x, R.shape([8, 8]))
                rows_t = R.permute_dims(rows, axes=[1, 0])
                dy_rows = R.reshape(dy, R.shape([8, 6]))
                dwt = R.matmul(rows_t, dy_rows)
                dw = R.permute_dims(dwt, axes=[1, 0])
                R.output(dx, dw)
            return (dx, dw)

    tvm.ir.assert_structural_equal(SimplifyBroadcastMatmul()(Backward), Expected)


def test_product_over_one_term_is_a_broadcast_multiply() -> None:
    """dy.T @ x at batch 1 (K = 1) is an outer product: an element-wise kernel, not a matmul."""

    @I.ir_module
    class Expected:
        @R.function
        def main(dy: R.Tensor((1, 6), "float32"), x: R.Tensor((1, 8), "float32")):
            with R.dataflow():
                dyt = R.permute_dims(dy, axes=[1, 0])
                dw = R.multiply(dyt, x)
                R.output(dw)
            return dw

    tvm.ir.assert_structural_equal(SimplifyBroadcastMatmul()(OuterProduct), Expected)


def test_broadcast_that_stretches_an_axis_is_left_alone() -> None:
    """broadcast_to((1, 8, 6) -> (4, 8, 6)) is not only added leading axes: unchanged."""

    @I.ir_module
    class Stretch:
        @R.function
        def main(x: R.Tensor((4, 2, 8), "float32"), w: R.Tensor((1, 8, 6), "float32")):
            with R.dataflow():
                wb = R.broadcast_to(w, R.shape([4, 8, 6]))
                y = R.matmul(x, wb)
                R.output(y)
            return y

    tvm.ir.assert_structural_equal(SimplifyBroadcastMatmul()(Stretch), Stretch)


def test_a_broadcast_whose_operand_would_no_longer_multiply_is_left_alone() -> None:
    """The gradient of `(W @ x).sum()`: ones broadcast from a scalar to (3, 5), times x.T. Without
    the broadcast the product has a 0-d operand, which Relax refuses: the pass itself raised
    (AttributeError on tvm.error.TVMError, which TVM 0.27 lacks) and the pipeline dropped it."""

    @I.ir_module
    class ScalarOnes:
        @R.function
        def main(x: R.Tensor((4, 5), "float32")):
            with R.dataflow():
                ones = R.broadcast_to(R.const(1.0, "float32"), R.shape([3, 5]))
                dw = R.matmul(ones, R.permute_dims(x, axes=[1, 0]))
                R.output(dw)
            return dw

    tvm.ir.assert_structural_equal(SimplifyBroadcastMatmul()(ScalarOnes), ScalarOnes)


def test_reports_what_it_rewrote() -> None:
    messages: list[str] = []
    SimplifyBroadcastMatmul(messages.append)(Forward)
    assert messages == ["SimplifyBroadcastMatmul: identity broadcast x1, matmul of broadcast x1"]


def _run(mod: tvm.IRModule, *args: np.ndarray) -> list[np.ndarray]:
    exe = tvm.compile(mod, target="llvm")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in args])
    return [o.numpy() for o in (out if isinstance(out, tvm.ir.Array) else [out])]


@pytest.mark.parametrize("mod", [Forward, Backward, OuterProduct],
                         ids=["forward", "backward", "outer"])
def test_rewritten_module_computes_what_torch_computes(mod: tvm.IRModule) -> None:
    """Before and after the pass, the module equals torch's expand + bmm and its autograd."""
    rng = np.random.default_rng(0)
    params = mod["main"].params
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in params]
    t = [torch.from_numpy(a) for a in args]
    if mod is Forward:
        x, w = t
        expected = [torch.bmm(x, w.T.expand(4, 8, 6))]
    elif mod is Backward:
        x, dy, w = t
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.bmm(xr, wr.T.expand(4, 8, 6)).backward(dy)
        expected = [xr.grad, wr.grad]
    else:
        dy, x = t
        expected = [dy.T @ x]
    for module in (mod, SimplifyBroadcastMatmul()(mod)):
        for got, want in zip(_run(module, *args), expected):
            np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-5)


# `Backward` under AMP: autocast's bfloat16 weight and gradients.
BackwardBfloat16 = tvm.script.from_source(Backward.script().replace('"float32"', '"bfloat16"'))


def test_the_pipeline_simplifies_before_accumulate_float32_casts_hide_the_pattern() -> None:
    """In tvmgraph's pipeline the bfloat16 weight gradient is one 2-D product too, accumulated in
    float32: AccumulateFloat32 runs after this pass (its casts between the matmul and the
    collapse_sum_to left an AMP transformer a 100 MB batch of weight copies per step)."""
    from tvmgraph.config import compile_options
    from tvmgraph.pipeline import get_pipeline

    cpu = tvm.target.Target({"kind": "llvm"})
    out = get_pipeline(cpu, compile_options(None), checks=False).until("FuseEpilogue")(BackwardBfloat16)
    calls = [b.value for blk in out["main"].body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]
    names = [c.op.name for c in calls if isinstance(c.op, tvm.ir.Op)]
    assert "relax.collapse_sum_to" not in names and "relax.broadcast_to" not in names
    matmuls = [c for c in calls if getattr(c.op, "name", "") == "relax.matmul"]
    assert len(matmuls) == 2 and all(len(c.ty.shape) <= 3 and c.attrs.out_dtype == "float32" for c in matmuls)
    assert [len(c.ty.shape) for c in matmuls] == [3, 2]

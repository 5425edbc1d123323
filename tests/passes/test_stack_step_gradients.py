"""StackStepGradients: a gradient summed over an unrolled loop's steps is one product over the
stacked steps (a recurrent weight) or one concatenation (a tensor read a step at a time)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.stack_step_gradients import StackStepGradients
from tests.models import assert_rnn_trains_as_in_eager


def _steps_module(steps: int, depth: int = 2):
    """dW = sum_t A_t^T B_t and dx = sum_t pad_t(d_t), as autodiff accumulates them."""
    a = [relax.Var(f"a{t}", relax.TensorType((depth, 3), "float32")) for t in range(steps)]
    b = [relax.Var(f"b{t}", relax.TensorType((depth, 4), "float32")) for t in range(steps)]
    d = [relax.Var(f"d{t}", relax.TensorType((1, 2, 3), "float32")) for t in range(steps)]
    bb = relax.BlockBuilder()
    with bb.function("main", [*a, *b, *d]):
        with bb.dataflow():
            dw = dx = None
            for t in range(steps):
                term = bb.emit(relax.op.matmul(bb.emit(relax.op.permute_dims(a[t], [1, 0])), b[t]))
                dw = term if dw is None else bb.emit(relax.op.add(dw, term))
                piece = bb.emit(relax.op.nn.pad(d[t], [t, steps - 1 - t, 0, 0, 0, 0]))
                dx = piece if dx is None else bb.emit(relax.op.add(dx, piece))
            out = bb.emit_output(relax.Tuple([dw, dx]))
        bb.emit_func_output(out)
    return bb.get()


def test_per_step_products_and_pieces_are_stacked() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(a0: R.Tensor((2, 3), "float32"), a1: R.Tensor((2, 3), "float32"), a2: R.Tensor((2, 3), "float32"),
                 a3: R.Tensor((2, 3), "float32"), b0: R.Tensor((2, 4), "float32"), b1: R.Tensor((2, 4), "float32"),
                 b2: R.Tensor((2, 4), "float32"), b3: R.Tensor((2, 4), "float32"),
                 d0: R.Tensor((1, 2, 3), "float32"), d1: R.Tensor((1, 2, 3), "float32"),
                 d2: R.Tensor((1, 2, 3), "float32"), d3: R.Tensor((1, 2, 3), "float32")):
            with R.dataflow():
                lv = R.matmul(R.permute_dims(R.concat((a0, a1, a2, a3), axis=0), axes=[1, 0]),
                              R.concat((b0, b1, b2, b3), axis=0))
                lv1 = R.concat((d0, d1, d2, d3), axis=0)
                gv = (lv, lv1)
                R.output(gv)
            return gv

    after = StackStepGradients()(_steps_module(4))
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(after), relax.transform.Normalize()(Expected))


def test_fewer_steps_stay() -> None:
    mod = _steps_module(3)
    tvm.ir.assert_structural_equal(StackStepGradients()(mod), mod)


def test_deep_products_stay_and_their_pieces_stack() -> None:
    """Products of depth 65 run well alone (and stacked, every A_t and B_t would stay alive)."""
    out = StackStepGradients()(_steps_module(4, depth=65))
    ops = [b.value.op.name for b in out["main"].body.blocks[0].bindings if isinstance(b.value, relax.Call)]
    assert ops.count("relax.matmul") == 4 and ops.count("relax.concat") == 1 and "relax.nn.pad" not in ops


def test_overlapping_pieces_stay() -> None:
    d = [relax.Var(f"d{t}", relax.TensorType((2, 3), "float32")) for t in range(4)]
    bb = relax.BlockBuilder()
    with bb.function("main", d):
        with bb.dataflow():
            total = None
            for t in range(4):
                piece = bb.emit(relax.op.nn.pad(d[t], [t // 2, 1 - t // 2, 0, 0]))  # rows 0-1 twice, 1-2 twice
                total = piece if total is None else bb.emit(relax.op.add(total, piece))
            out = bb.emit_output(total)
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(StackStepGradients()(mod), mod)


def test_reports_what_it_stacked() -> None:
    messages: list[str] = []
    StackStepGradients(messages.append)(_steps_module(5))
    assert messages == ["StackStepGradients: padded steps concatenated x5, products stacked x5"]


def test_results_equal_the_sums() -> None:
    mod = _steps_module(6)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(d) for d in p.ty.shape]).astype("float32") for p in mod["main"].params]
    results = []
    for m in (mod, StackStepGradients()(mod)):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        results.append([t.numpy() for t in vm["main"](*(tvm.runtime.tensor(x) for x in args))])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_two_layer_gru_trains_as_in_eager(monkeypatch) -> None:
    """Both layers' recurrent weights and the steps of both layers' inputs are stacked."""
    import relay_passes.stack_step_gradients as stack

    stacked: dict[str, int] = {}
    monkeypatch.setattr(stack, "report_counts", lambda report, name, counts: stacked.update(counts))
    assert_rnn_trains_as_in_eager("gru", layers=2)
    assert stacked == {"products stacked": 14, "padded steps concatenated": 14}  # 7 steps, 2 layers

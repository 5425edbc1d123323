"""Max pooling's gradient for non-overlapping windows (tvmgraph/max_pool_backward.py): the
same numbers as TVM's own legalization (TOPI's pool_grad) and as torch, ties and trailing
elements included; overlapping or padded windows keep TVM's."""

from __future__ import annotations

import threading

import pytest
import torch
import tvm
from tvm import relax
from tvm.relax.transform.legalize_ops.grad import _grad_max_pool2d_backward
from tvm.script import relax as R

from tests.conftest import SGDStep
from tvmgraph import max_pool_backward  # noqa: F401  (registers the legalization)
from tvmgraph.schedules import ApplyCPUSchedules
from tvmgraph.schedules.minus_infinity_pool import MinusInfinityPool
from tvmgraph.schedules.propagate_nan import PropagateNaN, propagate_nan

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()})


def pool_grad_module(dy_shape: tuple, x_shape: tuple, kernel: tuple, stride: tuple, padding: tuple) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    dy, x = relax.Var("dy", R.Tensor(dy_shape, "float32")), relax.Var("x", R.Tensor(x_shape, "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.grad.max_pool2d_backward(dy, x, kernel, stride, padding, (1, 1))))
        bb.emit_func_output(out)
    return bb.get()


def run(mod: tvm.IRModule, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`mod` with tvmgraph's CPU schedules, -inf poolings and NaN-propagating extrema, as a graph compiles it (a
    tuple (argmax) reducer once came out wrong under them: converters_nn._pool_indices), run on
    `dy` and `x`."""
    with TARGET:
        mod = PropagateNaN()(MinusInfinityPool()(ApplyCPUSchedules()(mod)))
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    return torch.from_numpy(vm["main"](tvm.runtime.tensor(dy.numpy()), tvm.runtime.tensor(x.numpy())).numpy())


def tvm_legalized(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` legalized with TVM's own max_pool2d_backward (TOPI's pool_grad)."""
    return relax.transform.LegalizeOps({"relax.grad.max_pool2d_backward": _grad_max_pool2d_backward})(mod)


# id: (x shape, kernel): trailing elements past the last whole window (1981 = 4 * 495 + 1)
CASES = {
    "1d-k4-ragged": ((2, 3, 1, 1981), (1, 4)),
    "2d-k2": ((2, 3, 8, 6), (2, 2)),
    "2d-k3-ragged": ((1, 2, 7, 11), (3, 3)),
    "1d-k4-parallel-rows": ((16, 32, 1, 1981), (1, 4)),  # enough work for the parallel schedule
    # 16 windows a vector (float32): whole vectors, then windows one at a time
    "2d-k2-vectors": ((2, 4, 6, 70), (2, 2)),
    "2d-k3-vectors-ragged": ((1, 2, 8, 100), (3, 3)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_non_overlapping_windows_give_tvms_and_torchs_gradient(case: tuple) -> None:
    """Before/after: one kernel of loops over the windows, an argmax kept per window (no sum
    over windows, no TE stages); its dx equals TOPI's bit for bit and torch's, with ties (zeros
    after a ReLU: the first one gets the gradient, as in torch) and the elements past the last
    window 0."""
    x_shape, kernel = case
    torch.manual_seed(0)
    x = torch.relu(torch.randn(x_shape)).round(decimals=1)  # many exact ties
    y = torch.nn.functional.max_pool2d(x.requires_grad_(), kernel)
    dy = torch.randn(y.shape)
    y.backward(dy)
    mod = pool_grad_module(tuple(dy.shape), x_shape, kernel, kernel, (0, 0, 0, 0))
    ours = relax.transform.LegalizeOps()(mod)
    text = ours["max_pool2d_backward"].script()
    assert "T.parallel" in text and "T.sblock" not in text and "T_pool_grad" not in text, text
    got = run(ours, dy, x.detach())
    assert torch.equal(got, run(tvm_legalized(mod), dy, x.detach()))
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("stride, padding", [((1, 1), (0, 0, 0, 0)), ((2, 2), (1, 1, 1, 1))],
                         ids=["overlapping", "padded"])
def test_overlapping_or_padded_windows_keep_tvms_legalization(stride: tuple, padding: tuple) -> None:
    mod = pool_grad_module((1, 2, 4, 4) if stride == (2, 2) else (1, 2, 5, 5), (1, 2, 6, 6), (2, 2), stride, padding)
    tvm.ir.assert_structural_equal(relax.transform.LegalizeOps()(mod), tvm_legalized(mod))


def test_a_symbolic_batch_keeps_the_te_kernel() -> None:
    """A dynamic batch: the TE form (window argmax, then a select), whose loops the schedules
    bound at run time; the same numbers as torch."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    dy, x = relax.Var("dy", R.Tensor((n, 3, 4, 5), "float32")), relax.Var("x", R.Tensor((n, 3, 8, 10), "float32"))
    with bb.function("main", [dy, x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.grad.max_pool2d_backward(dy, x, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1))))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    assert 'T.sblock("window_argmax")' in mod["max_pool2d_backward"].script()
    torch.manual_seed(0)
    x_value = torch.relu(torch.randn(2, 3, 8, 10)).requires_grad_()
    y = torch.nn.functional.max_pool2d(x_value, 2)
    dy_value = torch.randn(y.shape)
    y.backward(dy_value)
    assert torch.equal(run(mod, dy_value, x_value.detach()), x_value.grad)


def test_float64_windows_give_torchs_gradient() -> None:
    """float64: 8 windows a vector; the same numbers as torch."""
    torch.manual_seed(0)
    x = torch.relu(torch.randn(2, 3, 4, 43, dtype=torch.float64)).round(decimals=1).requires_grad_()
    y = torch.nn.functional.max_pool2d(x, (2, 2))
    dy = torch.randn(y.shape, dtype=torch.float64)
    y.backward(dy)
    bb = relax.BlockBuilder()
    dy_var, x_var = relax.Var("dy", R.Tensor(tuple(dy.shape), "float64")), relax.Var("x", R.Tensor(tuple(x.shape), "float64"))
    with bb.function("main", [dy_var, x_var]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.grad.max_pool2d_backward(dy_var, x_var, (2, 2), (2, 2), (0, 0, 0, 0), (1, 1))))
        bb.emit_func_output(out)
    assert torch.equal(run(relax.transform.LegalizeOps()(bb.get()), dy, x.detach()), x.grad)


def test_a_3x3_windows_kernel_builds_after_propagate_nan() -> None:
    """Regression: with the running maximum in let bindings, PropagateNaN's Select (which reads
    the previous maximum twice) made TVM's simplifier substitute a 2^9-fold expression for a 3x3
    window, and the build never finished (a trained `F.max_pool2d(x, 3)` hung). The maximum now
    lives in a local buffer; the build takes well under a second."""
    func = propagate_nan(max_pool_backward.window_loops((1, 2, 3, 6), (3, 3), "float32"))
    mod = tvm.IRModule({"max_pool2d_backward": func.with_attr("global_symbol", "max_pool2d_backward")})
    built = []
    worker = threading.Thread(target=lambda: built.append(tvm.tirx.build(mod, target=TARGET)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert built, "window_loops for a 3x3 window did not build within 120 s"


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_a_trained_3x3_pooling_matches_eager(ceil_mode: bool) -> None:
    """The hang's graph (a parameter max pooled over 3x3 windows, ceil mode with whole windows,
    indices returned): the step's loss and the updated parameter as in eager."""
    torch.manual_seed(0)

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = torch.nn.Parameter(torch.randn(1, 2, 3, 6))

        def forward(self, w: torch.Tensor) -> torch.Tensor:
            out, _ = torch.nn.functional.max_pool2d(self.x, 3, ceil_mode=ceil_mode, return_indices=True)
            return (out * w).sum()

    model, w = Pooled(), torch.randn(1, 2, 1, 2)
    reference = Pooled()
    reference.load_state_dict(model.state_dict())
    loss = SGDStep(model)(w)
    expected = reference(w)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(model.x.detach(), reference.x.detach() - reference.x.grad)


@pytest.mark.parametrize("plane", [(9, 11), (1, 100)], ids=["2d", "1d"])
def test_a_large_window_over_the_whole_plane_is_a_max_a_first_offset_and_a_select(plane: tuple) -> None:
    """Before/after: a window over a plane of more than MAX_UNROLLED_TAPS elements becomes three
    kernels (no unrolled taps); dx goes to the first maximum of each plane as in torch, a NaN's
    gradient to the NaN, a plane of -inf's to its first element."""
    torch.manual_seed(0)
    x = torch.randint(0, 3, (2, 3, *plane)).float()  # many exact ties
    x[1, 2, 0, 1] = float("nan")
    x[0, 1] = float("-inf")  # a plane of -inf: its first element gets the gradient
    xg = x.clone().requires_grad_()
    y = torch.nn.functional.max_pool2d(xg, plane)
    dy = torch.randn(y.shape)
    y.backward(dy)
    mod = pool_grad_module(tuple(dy.shape), tuple(x.shape), plane, plane, (0, 0, 0, 0))
    ours = relax.transform.LegalizeOps()(mod)
    names = {gv.name_hint for gv in ours.get_global_vars()}
    assert {"max_pool_plane_max", "max_pool_first_maximum", "max_pool2d_backward"} <= names, names
    assert "T.parallel" not in ours["max_pool2d_backward"].script()  # the TE form, not the loops
    assert torch.equal(run(ours, dy, x), xg.grad)


def test_a_small_window_over_the_whole_plane_keeps_the_window_loops() -> None:
    mod = pool_grad_module((2, 3, 1, 1), (2, 3, 7, 7), (7, 7), (7, 7), (0, 0, 0, 0))
    ours = relax.transform.LegalizeOps()(mod)
    assert "max_pool_first_maximum" not in {gv.name_hint for gv in ours.get_global_vars()}
    assert "T.parallel" in ours["max_pool2d_backward"].script()

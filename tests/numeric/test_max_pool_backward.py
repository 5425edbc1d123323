"""Max pooling's gradient for non-overlapping windows (tvmgraph/max_pool_backward.py): the
same numbers as TVM's own legalization (TOPI's pool_grad) and as torch, ties and trailing
elements included; overlapping or padded windows keep TVM's."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax
from tvm.relax.transform.legalize_ops.grad import _grad_max_pool2d_backward
from tvm.script import relax as R

from tvmgraph import max_pool_backward  # noqa: F401  (registers the legalization)
from tvmgraph.schedules import ApplyCPUSchedules

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
    """`mod` with tvmgraph's CPU schedules, as a graph compiles it (a tuple (argmax) reducer once
    came out wrong under them: converters_nn._pool_indices), run on `dy` and `x`."""
    with TARGET:
        mod = ApplyCPUSchedules()(mod)
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
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_non_overlapping_windows_give_tvms_and_torchs_gradient(case: tuple) -> None:
    """Before/after: one kernel with a window argmax and a select (no sum over windows); its dx
    equals TOPI's bit for bit and torch's, with ties (zeros after a ReLU: the first one gets
    the gradient, as in torch) and the elements past the last window 0."""
    x_shape, kernel = case
    torch.manual_seed(0)
    x = torch.relu(torch.randn(x_shape)).round(decimals=1)  # many exact ties
    y = torch.nn.functional.max_pool2d(x.requires_grad_(), kernel)
    dy = torch.randn(y.shape)
    y.backward(dy)
    mod = pool_grad_module(tuple(dy.shape), x_shape, kernel, kernel, (0, 0, 0, 0))
    ours = relax.transform.LegalizeOps()(mod)
    text = ours["max_pool2d_backward"].script()
    assert 'T.sblock("window_argmax")' in text and "T_pool_grad" not in text, text
    got = run(ours, dy, x.detach())
    assert torch.equal(got, run(tvm_legalized(mod), dy, x.detach()))
    assert torch.equal(got, x.grad)


@pytest.mark.parametrize("stride, padding", [((1, 1), (0, 0, 0, 0)), ((2, 2), (1, 1, 1, 1))],
                         ids=["overlapping", "padded"])
def test_overlapping_or_padded_windows_keep_tvms_legalization(stride: tuple, padding: tuple) -> None:
    mod = pool_grad_module((1, 2, 4, 4) if stride == (2, 2) else (1, 2, 5, 5), (1, 2, 6, 6), (2, 2), stride, padding)
    tvm.ir.assert_structural_equal(relax.transform.LegalizeOps()(mod), tvm_legalized(mod))

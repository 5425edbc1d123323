"""GroupNormByParts: a group norm's forward pass as a mean, a variance and element-wise ops."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import tvm
from torch import nn
from torch.nn import functional as F
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.group_norm_by_parts import GroupNormByParts
from tests.conftest import ModuleGraph, assert_close


def _group_norm(shape: tuple[int, ...], groups: int, dtype: str = "float32", axes: list[int] | None = None,
                channel_axis: int = 1) -> tvm.IRModule:
    x = relax.Var("x", relax.TensorType(shape, dtype))
    gamma = relax.Var("gamma", relax.TensorType((shape[channel_axis],), dtype))
    beta = relax.Var("beta", relax.TensorType((shape[channel_axis],), dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, gamma, beta]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.group_norm(
                x, gamma, beta, groups, channel_axis, axes if axes is not None else list(range(2, len(shape)))))
        bb.emit_func_output(out)
    return bb.get()


def test_a_group_norm_becomes_its_parts() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4, 3, 3), "float32"), gamma: R.Tensor((4,), "float32"),
                 beta: R.Tensor((4,), "float32")):
            with R.dataflow():
                g = R.reshape(x, R.shape([2, 2, 18]))
                m = R.mean(g, axis=[2], keepdims=True)
                r = R.rsqrt(R.add(R.variance(g, axis=[2], keepdims=True), R.const(1e-5, "float32")))
                n = R.reshape(R.multiply(R.subtract(g, m), r), R.shape([2, 4, 3, 3]))
                gv = R.add(R.multiply(n, R.reshape(gamma, R.shape([1, 4, 1, 1]))),
                           R.reshape(beta, R.shape([1, 4, 1, 1])))
                R.output(gv)
            return gv

    after = GroupNormByParts()(_group_norm((2, 4, 3, 3), 2))
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(after), relax.transform.Normalize()(Expected))


@pytest.mark.parametrize("kind", ["float16", "channels-last"])
def test_other_group_norms_stay(kind: str) -> None:
    """float16 (AccumulateFloat32 and the converters keep 16-bit norms in float32 themselves) and
    channels on another axis are left to TOPI."""
    mod = (_group_norm((2, 4, 3, 3), 2, "float16") if kind == "float16"
           else _group_norm((2, 3, 3, 4), 2, axes=[1, 2], channel_axis=3))
    said: list[str] = []
    tvm.ir.assert_structural_equal(GroupNormByParts(said.append)(mod), mod)
    assert said == []


@pytest.mark.parametrize("shape, groups", [((4, 32, 16, 16), 4), ((2, 6, 10), 3), ((2, 8, 3, 4, 5), 2)])
def test_results_equal_torch(shape: tuple[int, ...], groups: int) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 1).astype("float32")
    gamma, beta = rng.standard_normal(shape[1]).astype("float32"), rng.standard_normal(shape[1]).astype("float32")
    expected = F.group_norm(torch.from_numpy(x), groups, torch.from_numpy(gamma), torch.from_numpy(beta)).numpy()
    said: list[str] = []
    mod = GroupNormByParts(said.append)(_group_norm(shape, groups))
    assert said == ["GroupNormByParts: group_norm as mean, variance and one element-wise kernel x1"]
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    got = vm["main"](*(tvm.runtime.tensor(a) for a in (x, gamma, beta))).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_a_group_norm_cnn_infers_as_in_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Through the pipeline (the pass on the CPU, debug(1) says so), with affine parameters not
    at their defaults."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                          nn.Conv2d(16, 8, 3, padding=1), nn.GroupNorm(2, 8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        x = torch.randn(2, 3, 12, 12)
        expected = model(x)
    graph = ModuleGraph(model)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        got = graph(x)
    assert "GroupNormByParts: group_norm as mean, variance and one element-wise kernel x2" in caplog.text
    assert_close(got, expected, atol=1e-5, rtol=1e-5)

"""BilinearUpsampleByTwo: a bilinear NCHW resize2d to twice the height and width (half-pixel
centres, torch's align_corners=False) is one kernel of fixed taps on the CPU; the kernel
(tvmgraph/schedules/bilinear_upsample.py) against torch; whole graphs against eager."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from torch import nn
from tvm import relax

from relay_passes.bilinear_upsample import BilinearUpsampleByTwo
from tests.conftest import ModuleGraph, TrainGraph, assert_steps_match_eager
from tvmgraph.schedules.apply import OPT_LEVEL_ATTR, ApplyCPUSchedules
from tvmgraph.schedules.bilinear_upsample import ATTRIBUTE, BilinearUpsample, bilinear_upsample_kernel

HOST = tvm.target.Target({"kind": "llvm"})

RESIZE = """
@I.ir_module
class Module:
    @R.function
    def main(x: R.Tensor({shape}, "{dtype}")):
        with R.dataflow():
            y = R.image.resize2d(x, R.shape({size}), roi=[0.0, 0.0, 0.0, 0.0], layout="{layout}",
                                 method="{method}", coordinate_transformation_mode="{mode}",
                                 rounding_method="round", cubic_alpha=-0.75, cubic_exclude=0,
                                 extrapolation_value=0.0)
            z = R.multiply(y, R.const(2.0, "{dtype}"))
            R.output(z)
        return z
"""


def resize(shape=(2, 3, 5, 7), size=(10, 14), dtype="float32", layout="NCHW", method="linear",
           mode="half_pixel") -> tvm.IRModule:
    """`resize2d(x) * 2` as the torch converter writes `F.interpolate` (with a consumer, so that
    the call is not the function's output itself)."""
    shape = "({})".format(", ".join(map(str, shape)))
    return tvm.script.from_source(RESIZE.format(shape=shape, size=list(size), dtype=dtype, layout=layout,
                                                method=method, mode=mode))


def rewritten(mod: tvm.IRModule) -> tvm.IRModule:
    with HOST:
        return BilinearUpsampleByTwo()(mod)


def _ops(mod: tvm.IRModule) -> list[str]:
    return [b.value.op.name for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def test_the_resize_becomes_one_call_of_the_kernel() -> None:
    out = rewritten(resize())
    assert _ops(out) == ["relax.call_tir", "relax.multiply"]
    call = out["main"].body.blocks[0].bindings[0].value
    kernel = out[call.args[0]]
    assert kernel.attrs[ATTRIBUTE]
    assert [int(d) for d in call.ty.shape.values] == [2, 3, 10, 14]
    assert call.args[1].fields[0].same_as(out["main"].params[0])


@pytest.mark.parametrize("case", ["align_corners", "scale 3", "height only", "nearest", "cubic", "NHWC",
                                  "float16", "symbolic width"])
def test_other_resizes_stay(case: str) -> None:
    mod = {
        "align_corners": lambda: resize(mode="align_corners"),
        "scale 3": lambda: resize(size=(15, 21)),
        "height only": lambda: resize(size=(10, 7)),
        "nearest": lambda: resize(method="nearest_neighbor"),
        "cubic": lambda: resize(method="cubic"),
        "NHWC": lambda: resize(shape=(2, 5, 7, 3), layout="NHWC"),
        "float16": lambda: resize(dtype="float16"),
        "symbolic width": lambda: resize(shape=(2, 3, 5, '"w"')),
    }[case]()
    tvm.ir.assert_structural_equal(rewritten(mod), mod)


def test_a_symbolic_batch_is_the_kernels_own_variable() -> None:
    out = rewritten(resize(shape=('"n"', 3, 5, 7)))
    call = out["main"].body.blocks[0].bindings[0].value
    n = out["main"].params[0].ty.shape.values[0]
    assert call.ty.shape.values[0].same_as(n)
    x_buffer = out[call.args[0]].params[0].ty
    assert isinstance(x_buffer.shape[0], tvm.tirx.Var) and not x_buffer.shape[0].same_as(n)


def test_results_equal_topis_resize() -> None:
    mod = resize()
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 7)).astype("float32")
    results = []
    for m in (mod, rewritten(mod)):
        with HOST:
            m = ApplyCPUSchedules()(relax.transform.LegalizeOps()(m))
        vm = relax.VirtualMachine(tvm.compile(m, target=HOST), tvm.cpu())
        results.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(results[1], results[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape,dtype,symbolic", [((4, 32, 32, 32), "float32", False), ((1, 3, 7, 5), "float32", False),
                                                  ((1, 1, 1, 1), "float32", False), ((2, 2, 1, 9), "float32", False),
                                                  ((1, 2, 6, 33), "float64", False), ((3, 2, 4, 17), "float32", True)])
def test_the_kernel_equals_torch(shape: tuple, dtype: str, symbolic: bool) -> None:
    """Scheduled by its rule (at LLVM -O3): borders, planes of one row or one pixel, widths that
    no vector divides, float64, a symbolic batch."""
    kernel = bilinear_upsample_kernel(None if symbolic else shape[0], *shape[1:], dtype)
    mod = tvm.IRModule({"up": kernel.with_attr("global_symbol", "up")})
    with HOST:
        mod = ApplyCPUSchedules(BilinearUpsample())(mod)
    assert mod["up"].attrs["tirx.is_scheduled"]
    assert int(mod["up"].attrs[OPT_LEVEL_ATTR]) == 3
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=getattr(torch, dtype))
    out = tvm.runtime.tensor(np.zeros((*shape[:2], 2 * shape[2], 2 * shape[3]), dtype))
    tvm.compile(mod, target=HOST)["up"](tvm.runtime.tensor(x.numpy()), out)
    expected = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    tolerance = 1e-6 if dtype == "float32" else 1e-14
    torch.testing.assert_close(torch.from_numpy(out.numpy()), expected, atol=tolerance, rtol=tolerance)


def test_the_rule_schedules_only_its_kernels() -> None:
    with HOST:
        other = relax.transform.LegalizeOps()(resize())
    for gv, func in other.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert BilinearUpsample().apply(func, HOST, False) is None


class Decoder(nn.Module):
    """A U-Net decoder step: upsample (F.interpolate or nn.Upsample), concatenate, convolve."""

    def __init__(self, module: bool = False, align_corners: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(6, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=align_corners) if module else None

    def forward(self, x, skip):
        h = F.silu(x)
        up = self.up(h) if self.up is not None else F.interpolate(h, scale_factor=2, mode="bilinear")
        return self.conv(torch.cat([up, skip], 1))


@pytest.mark.parametrize("module,align_corners", [(False, False), (True, False), (True, True)],
                         ids=["F.interpolate", "nn.Upsample", "align_corners"])
def test_decoders_equal_eager(module: bool, align_corners: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Through a whole inference graph, and debug(1) reports the kernel where it applies."""
    torch.manual_seed(0)
    model = Decoder(module, align_corners).eval()
    x, skip = torch.randn(2, 3, 9, 8), torch.randn(2, 3, 18, 16)
    with torch.no_grad():
        expected = model(x, skip)
    graph = ModuleGraph(model)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        got = graph(x, skip)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    assert ("BilinearUpsampleByTwo: bilinear upsampling" in caplog.text) == (not align_corners)


def test_a_training_step_equals_eager(caplog: pytest.LogCaptureFixture) -> None:
    """The forward resize is the kernel; its gradient (resize2d's own) and the update match eager."""

    class Net(nn.Module):  # a U-Net's level: down by a strided conv, up, concatenated with its input
        def __init__(self):
            super().__init__()
            self.down = nn.Conv2d(3, 3, 3, stride=2, padding=1)
            self.decoder = Decoder()

        def forward(self, x):
            return self.decoder(self.down(x), x)

    torch.manual_seed(0)
    model, reference = Net(), Net()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(2, 3, 12, 16), torch.randn(2, 4, 12, 16)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        assert_steps_match_eager(graph, model, reference, nn.functional.mse_loss, x, y)
    assert "BilinearUpsampleByTwo" in caplog.text


def test_a_dynamic_batch_equals_eager(caplog: pytest.LogCaptureFixture) -> None:
    """One compiled program for batches 2 and 5 (enable_dynamic_batch), each as eager's."""
    torch.manual_seed(0)
    model = Decoder().eval()
    graph = ModuleGraph(model)
    graph.config.enable_dynamic_batch(True)
    graph.debug(1)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        for batch in (2, 5):
            x, skip = torch.randn(batch, 3, 5, 6), torch.randn(batch, 3, 10, 12)
            with torch.no_grad():
                expected = model(x, skip)
            torch.testing.assert_close(graph(x, skip), expected, atol=2e-6, rtol=1e-5)
    assert caplog.text.count("BilinearUpsampleByTwo: bilinear upsampling") == 1

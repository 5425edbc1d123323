"""SimplifyPower: MSELoss's square and its autodiff form become multiplies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.simplify_power import SimplifyPower


@I.ir_module
class MSEGradient:
    """What autodiff makes of `mean((a - b) ** 2)`: the power, and 2 * d ** (2 - 1) * dy."""

    @R.function
    def main(d: R.Tensor((4, 8), "float32"), dy: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            sq = R.power(d, R.const(2.0, "float32"))
            e = R.subtract(R.const(2.0, "float32"), R.const(1.0, "float32"))
            p = R.power(d, e)
            g = R.multiply(R.multiply(dy, R.const(2.0, "float32")), p)
            c = R.power(d, R.const(3.0, "float32"))
            R.output(sq, g, c)
        return (sq, g, c)


def test_square_is_a_multiply_and_constant_exponents_fold() -> None:
    """d ** 2 -> d * d; 2 - 1 folds to 1 and d ** 1 is d; d ** 3 -> d * d * d."""

    @I.ir_module
    class Expected:
        @R.function
        def main(d: R.Tensor((4, 8), "float32"), dy: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                sq = R.multiply(d, d)
                lv = R.multiply(dy, R.const(2.0, "float32"))
                g = R.multiply(lv, d)
                c = R.multiply(R.multiply(d, d), d)
                R.output(sq, g, c)
            return (sq, g, c)

    tvm.ir.assert_structural_equal(SimplifyPower()(MSEGradient), Expected)


def test_reports_what_it_rewrote() -> None:
    messages: list[str] = []
    SimplifyPower(messages.append)(MSEGradient)
    assert messages == ["SimplifyPower: constant folded x1, x ** 1 x1, x ** 2 x1, x ** 3 x1"]


def test_results_equal_torch_bit_for_bit() -> None:
    """x * x is what torch computes for x ** 2 (both correctly rounded)."""
    rng = np.random.default_rng(0)
    d, dy = (rng.standard_normal((4, 8)).astype("float32") for _ in range(2))
    td, tdy = torch.from_numpy(d), torch.from_numpy(dy)
    expected = [td ** 2, tdy * 2.0 * td, td ** 3]
    for module in (MSEGradient, SimplifyPower()(MSEGradient)):
        vm = relax.VirtualMachine(tvm.compile(module, target="llvm"), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(d), tvm.runtime.tensor(dy))
        for got, want in zip(out, expected):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=0)


def test_torchs_special_exponents_give_torchs_numbers_bit_for_bit() -> None:
    """torch's pow kernel computes x ** 0.5, -0.5, -1, -2 and 3 as sqrt, 1 / sqrt, 1 / x,
    1 / (x * x) and x * x * x; through libm's pow the graph gave inf at -inf for 0.5 (eager:
    NaN) and +0.0 at -0.0, and a libm call per element. 2.5 keeps the power."""
    from tests.conftest import Fn, ModuleGraph

    x = torch.cat([torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, -2.0]),
                   torch.randn(64) * 10])

    def fn(x):
        return x ** 0.5, x ** -0.5, x ** -1, x ** -2, x ** 3, torch.pow(x, 2.5), x.abs().pow(0.5)

    want = list(fn(x))
    # torch's AVX2 kernels round a square root off by one ulp at times (5 of these 71 on Zen 3);
    # the graph's is correctly rounded (vsqrtps): the square roots are compared with float64's
    # rounded to float32, which AVX-512's torch gives too.
    exact = fn(x.double())
    for i in (0, 6):
        torch.testing.assert_close(want[i], exact[i].float(), equal_nan=True, rtol=2.4e-7, atol=0)
        want[i] = exact[i].float()
    for got, expected in zip(ModuleGraph(Fn(fn))(x), want):
        torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_powers_compile_and_match_eager(dtype: torch.dtype) -> None:
    """TVM's power legalization refused bfloat16 (`power only applies to float`): every bfloat16
    `x ** e` failed to compile; AccumulateFloat32 computes it in float32, rounded once, as torch.
    The one-operation forms (x * x, sqrt, 1 / x) are exact in 16 bits too; the others within one
    16-bit rounding of eager's."""
    from tests.conftest import Fn, ModuleGraph

    x = torch.cat([torch.tensor([float("inf"), float("nan"), 0.0, 2.0, 1e-3]), torch.rand(32) * 8]).to(dtype)

    def fn(x):
        return x ** 2, x ** 0.5, x ** -1, x ** 3, x ** -0.5, x ** 2.5, torch.pow(x, x.clamp(max=3))

    for i, (got, want) in enumerate(zip(ModuleGraph(Fn(fn))(x), fn(x))):
        exact = i < 3 and not (i == 1 and dtype == torch.float16)
        torch.testing.assert_close(got, want, equal_nan=True, **({"rtol": 0, "atol": 0} if exact else {}))

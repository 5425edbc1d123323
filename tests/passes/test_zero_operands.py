"""ZeroOperands: `x * 0`, `x / 0` and `0 / x` keep IEEE's inf and NaN, as eager's do."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.zero_operands import ZeroOperands
from tests.conftest import Fn, ModuleGraph


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4,), "float32")):
        with R.dataflow():
            product = R.multiply(x, R.const(0.0, "float32"))
            quotient = R.divide(R.const(0.0, "float32"), x)
            kept = R.multiply(x, R.const(2.0, "float32"))
            R.output(product, quotient, kept)
        return (product, quotient, kept)


def test_products_and_quotients_of_a_constant_zero_become_selects() -> None:
    """x * 0 -> NaN where x is not finite, else 0; 0 / x -> NaN where x is 0 or NaN, else 0;
    x * 2 stays."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            with R.dataflow():
                product = R.where(R.isfinite(x), R.const(0.0, "float32"), R.const(float("nan"), "float32"))
                quotient = R.where(R.logical_or(R.equal(x, R.const(0.0, "float32")), R.isnan(x)),
                                   R.const(float("nan"), "float32"), R.const(0.0, "float32"))
                kept = R.multiply(x, R.const(2.0, "float32"))
                R.output(product, quotient, kept)
            return (product, quotient, kept)

    tvm.ir.assert_structural_equal(ZeroOperands()(Before), Expected)


@pytest.mark.parametrize("name, fn", [
    ("x * 0.0", lambda x: x * 0.0),
    ("0.0 * x", lambda x: 0.0 * x),
    ("a loss term switched off", lambda x: x[0] * 0.0 + x[3:].abs().mean()),
    ("0.0 / x", lambda x: 0.0 / x),
    ("zeros / x", lambda x: torch.zeros(6) / x),
    ("x / 0.0", lambda x: x / 0.0),
    ("x / -0.0", lambda x: x / -0.0),
    ("x / zeros", lambda x: x / torch.zeros(2, 6)),
    ("x // 0.0", lambda x: torch.floor_divide(x, 0.0)),
    # a divisor TIR folds to zero stopped the compile too (`Divide by zero`)
    ("x / (ones - 1)", lambda x: x / (torch.ones(6) - 1.0)),
    ("x / (ones * 0 + zeros)", lambda x: x / (torch.ones(6) * 0.0 + torch.zeros(6))),
    ("x % 0.0", lambda x: torch.remainder(x, 0.0)),
    ("x % zeros", lambda x: torch.remainder(x, torch.zeros(6))),
    ("fmod(x, 0.0)", lambda x: torch.fmod(x, 0.0)),
    ("x / (ones - 0.5) (kept)", lambda x: x / (torch.ones(6) - 0.5)),
    ("x * 2 (kept)", lambda x: x * 2.0),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_with_inf_and_nan_match_eager(name: str, fn, dtype: torch.dtype) -> None:
    """Before: x * 0.0 and 0.0 / x were 0 everywhere (TVM folds the constant), x / 0.0, x % 0.0
    and x / (torch.ones(n) - 1) did not compile (`Divide by zero`). bfloat16's tests run in float32 (TVM legalizes no bfloat16
    isnan)."""
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 2.0, -3.0]).to(dtype)
    got, want = ModuleGraph(Fn(fn))(x), fn(x)
    torch.testing.assert_close(got, want, equal_nan=True)

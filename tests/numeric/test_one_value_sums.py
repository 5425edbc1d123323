"""tvmgraph/one_value_sums.py: a sum, mean or variance to one value kept as ones is a 0-d
reduction (the schedules chunk it), reshaped; torch's numbers on data with a large mean."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import relax

import tvmgraph
from tests.numeric.test_cpu_schedules import unary_module
from tvmgraph.one_value_sums import cut, to_one_value

HOST = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()})


def legalized(build, shape: tuple) -> str:
    """The TIR of `main(x) = build(x)` (x: float32 of `shape`) after LegalizeOps."""
    with HOST:
        mod = relax.transform.LegalizeOps()(unary_module(shape, build))
    return "".join(f.script() for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


def test_which_reductions_leave_one_value() -> None:
    shape = [tvm.tirx.IntImm("int64", d) for d in (1, 1000, 1)]
    assert to_one_value(shape, None) and to_one_value(shape, [1]) and to_one_value(shape, [0, 1])
    assert not to_one_value(shape, [0]) and not to_one_value(shape, [2])


@pytest.mark.parametrize("op,shape,axis", [("mean", (1000, 1000), None), ("sum", (1, 4096), [1]),
                                           ("variance", (1000, 1000), None)],
                         ids=["mean-keepdims", "sum-of-a-batch-of-one", "variance"])
def test_the_reduction_is_to_a_0d_buffer(op: str, shape: tuple, axis: list | None) -> None:
    """Before: TVM's `x_red` buffer was (1, 1) (the kept ones; the variance's mean whatever its
    keepdims), a row to the schedules. After: `()`, then a reshape to the kept shape."""
    text = legalized(lambda x: getattr(relax.op, op)(x, axis, keepdims=True), shape)
    kept = ", ".join(["T.int64(1)"] * len(shape))
    assert "total = T.sblock_alloc_buffer(())" in text and "T_reshape" in text, text
    assert f"T.sblock_alloc_buffer(({kept}))" not in text, text


@pytest.mark.parametrize("shape,expected", [((3999971,), (0, 3997696)), ((1000003, 4), (0, 999424)),
                                            ((3, 999983), (1, 999424)), ((7919, 7919), (0, 7916)),
                                            ((1000, 1000), None), ((1, 1000000), None), ((4000,), None)])
def test_a_length_without_a_chunk_divisor_is_cut_after_whole_chunks(shape: tuple, expected) -> None:
    """Before: a prime length (or 2 x a prime) had no divisor for the schedules' chunks and was
    summed in one chain per lane. The cut axis is the one the chunks split, at a multiple of a
    power of two of a chunk's size; lengths that divide, and short sums, stay whole."""
    assert cut([tvm.tirx.IntImm("int64", d) for d in shape]) == expected


class Statistics(tvmgraph.nn.Graph):
    def build(self, x):
        return (x.mean((0, 1), keepdim=True), x.sum((0, 1), keepdim=True), x.var(), x.std(), x.var((0, 1), keepdim=True),
                x.reshape(1, -1).sum(1), torch.var_mean(x))


def test_sums_of_a_prime_count_of_values_with_a_large_mean_match_torch() -> None:
    """1000003 values of 1e3 + randn (prime). Before: sum 8.9e-3 off, var 79 (float64: 1.0)."""
    torch.manual_seed(0)
    x = torch.randn(1000003) + 1e3
    got = Statistics()(x.reshape(1000003, 1))
    exact = Statistics.build(None, x.reshape(1000003, 1).double())
    for g, e in zip(got[:4], exact[:4]):
        torch.testing.assert_close(g.double(), e, rtol=2e-3, atol=0)


def test_statistics_of_a_million_values_with_a_large_mean_match_torch() -> None:
    """1e6 float32 values of 1e4 + U(0, 1). Before: mean(keepdim) 9994.30 (float64 10000.50),
    var 38.5 (0.0833), the sum of a (1, N) view 1.3% off. Tolerance: 1e-6 of the float64 sums
    and means, 2e-3 of the variance (its mean's rounding, squared; eager's own error is 1e-6)."""
    torch.manual_seed(0)
    x = torch.rand(1000, 1000) + 1e4
    got = Statistics()(x)
    exact = Statistics.build(None, x.double())
    flat = lambda outs: [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]  # noqa: E731
    for name, g, e in zip(["mean", "sum", "var", "std", "var-keepdim", "sum-of-a-view", "var_mean.var", "var_mean.mean"],
                          flat(got), flat(exact)):
        assert g.shape == e.shape, name
        rtol = 1e-6 if name in ("mean", "sum", "sum-of-a-view", "var_mean.mean") else 2e-3
        torch.testing.assert_close(g.double(), e, rtol=rtol, atol=0, msg=name)


def test_sums_of_nothing_are_eagers_zero_and_nan() -> None:
    """A (0, 3) tensor: the 0-d kernel over an empty range never initialized its sum (4e9 came
    back for x.sum()); empty reductions keep the fallbacks' 0 and NaN."""
    class Empty(tvmgraph.nn.Graph):
        def build(self, x):
            return x.sum(), x.mean(), x.sum((0, 1), keepdim=True), x.mean((0, 1), keepdim=True)

    x = torch.randn(0, 3)
    for got, want in zip(Empty()(x), Empty.build(None, x)):
        torch.testing.assert_close(got, want, equal_nan=True)

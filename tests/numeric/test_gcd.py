"""torch.gcd and torch.lcm against eager (tvmgraph/converters_gcd.py): signs, zeros, the
worst case of Euclid's loop (consecutive Fibonacci numbers), broadcasting, every integer dtype.
Compared exactly."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import Fn, ModuleGraph


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    info = torch.iinfo(dtype)
    fib = [1, 2]
    while fib[-1] + fib[-2] <= info.max:
        fib.append(fib[-1] + fib[-2])
    low = 0 if info.min == 0 else -info.max  # abs(min) is undefined in C (converters_gcd.py)
    a = [0, 0, 12, -12, 7, info.max, low, fib[-1], fib[-2], 1]
    b = [0, 5, -18, -18, 0, 3, 6, fib[-2], fib[-1], info.max]
    g = torch.Generator().manual_seed(0)
    a = torch.cat([torch.tensor(a, dtype=dtype), torch.randint(low, info.max, (22,), generator=g, dtype=dtype)])
    b = torch.cat([torch.tensor(b, dtype=dtype), torch.randint(low // 1000, info.max // 1000 + 1, (22,),
                                                               generator=g, dtype=dtype)])
    return a, b


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_gcd_and_lcm_match_eager(dtype: torch.dtype) -> None:
    a, b = _operands(dtype)

    def gcd_lcm(a, b):
        return torch.gcd(a, b), torch.lcm(a, b), torch.gcd(a.view(4, 8), b[:8]), a.lcm(b[:1])

    out = ModuleGraph(Fn(gcd_lcm))(a, b)
    for got, expected in zip(out, gcd_lcm(a, b), strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected), (got, expected)

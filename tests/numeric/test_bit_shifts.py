"""Bit shifts against torch eager (tvmgraph/converters_shift.py): every amount, in range or not
(LLVM leaves those undefined; torch gives 0, or the sign for a right shift), every integer
dtype, tensor and scalar operands. Integer results compared exactly."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import Fn, ModuleGraph

AMOUNTS = [-1, 0, 1, 3, 7, 8, 15, 31, 32, 63, 64, 70]


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_shifts_match_eager_for_every_amount(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    x = torch.tensor([info.min, -5, -1, 0, 1, 5, 77, info.max] * 2, dtype=dtype)[: 12]
    amount = torch.tensor(AMOUNTS).clamp(info.min, info.max).to(dtype)

    def shifts(x, amount):
        return x << amount, x >> amount, x << 2, x >> 1, torch.bitwise_left_shift(3, amount), x.__rshift__(70)

    out = ModuleGraph(Fn(shifts))(x, amount)
    for got, expected in zip(out, shifts(x, amount)):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected), (got, expected)

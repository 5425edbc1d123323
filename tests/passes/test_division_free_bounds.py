"""DivisionFreeBounds: a padded tile's bounds test `x // c < n` becomes `x < c * n`.

Before/after TIR of the store a matmul over a dynamic batch ends with, the comparisons left
alone, and the built kernel's results against numpy for batches that do and do not fill the
last tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.script import tirx as T

from tvmgraph.schedules.division_free_bounds import DivisionFreeBounds, division_free_bounds

TARGET = tvm.target.Target({"kind": "llvm"})


@T.prim_func(private=True, s_tir=True)
def padded_store(var_x: T.handle, var_y: T.handle):
    """A (n, 64) result written from a tile padded to multiples of 48 rows of J = n * 64."""
    n = T.int64()
    x = T.match_buffer(var_x, (n * T.int64(64),))
    y = T.match_buffer(var_y, (n, T.int64(64)))
    for jo in range((n * T.int64(64) + T.int64(47)) // T.int64(48)):
        for ji in T.vectorized(T.int64(16)):
            for jj in range(T.int64(3)):
                with T.sblock("y"):
                    vj = T.axis.spatial((n * T.int64(64) + T.int64(47)) // T.int64(48) * T.int64(48),
                                        jo * T.int64(48) + jj * T.int64(16) + ji)
                    T.where((jo * T.int64(48) + jj * T.int64(16) + ji) // T.int64(64) < n)
                    y[vj // T.int64(64), vj % T.int64(64)] = x[vj] * T.float32(2)


@T.prim_func(private=True, s_tir=True)
def padded_store_expected(var_x: T.handle, var_y: T.handle):
    n = T.int64()
    x = T.match_buffer(var_x, (n * T.int64(64),))
    y = T.match_buffer(var_y, (n, T.int64(64)))
    for jo in range((n * T.int64(64) + T.int64(47)) // T.int64(48)):
        for ji in T.vectorized(T.int64(16)):
            for jj in range(T.int64(3)):
                with T.sblock("y"):
                    vj = T.axis.spatial((n * T.int64(64) + T.int64(47)) // T.int64(48) * T.int64(48),
                                        jo * T.int64(48) + jj * T.int64(16) + ji)
                    T.where(jo * T.int64(48) + jj * T.int64(16) + ji < T.int64(64) * n)
                    y[vj // T.int64(64), vj % T.int64(64)] = x[vj] * T.float32(2)


def test_bounds_test_loses_its_division() -> None:
    tvm.ir.assert_structural_equal(division_free_bounds(padded_store), padded_store_expected)


@T.prim_func(private=True)
def other_comparisons(a: T.Buffer((8,), "int64"), n: T.int64, out: T.Buffer((8,), "int64")):
    for i in range(T.int64(8)):
        # a symbolic divisor, a negative one, a division on the right: none is rewritten
        out[i] = T.Select(a[i] // n < T.int64(3), T.int64(1), T.int64(0)) + T.Select(
            a[i] // T.int64(-2) < n, T.int64(1), T.int64(0)) + T.Select(n < a[i] // T.int64(4), T.int64(1), T.int64(0))


def test_other_comparisons_are_left_alone() -> None:
    tvm.ir.assert_structural_equal(division_free_bounds(other_comparisons), other_comparisons)


@T.prim_func(private=True)
def at_least(a: T.Buffer((16,), "int64"), n: T.int64, out: T.Buffer((16,), "int64")):
    for i in range(T.int64(16)):
        out[i] = T.Select(a[i] // T.int64(4) >= n, T.int64(1), T.int64(0))


@pytest.mark.parametrize("n", [1, 2, 3, 5])  # n * 64 rows are whole 48-row tiles only for n = 3
def test_built_kernel_writes_every_element_of_the_result(n: int) -> None:
    """Every element of y is written (y starts at -1), from its own x, for batches that do and
    do not fill the last tile."""
    lib = tvm.compile(DivisionFreeBounds()(tvm.IRModule({"main": padded_store.with_attr("global_symbol", "main")})),
                      target=TARGET)
    x = np.arange(n * 64, dtype="float32")
    y = tvm.runtime.tensor(np.full((n, 64), -1.0, dtype="float32"))
    lib["main"](tvm.runtime.tensor(x), y)
    np.testing.assert_array_equal(y.numpy().reshape(-1), x * 2)


@pytest.mark.parametrize("n", [-3, 0, 2, 7])
def test_greater_or_equal_is_rewritten_exactly(n: int) -> None:
    """`a // 4 >= n` and `a >= 4 * n` agree for negative and positive a and n."""
    after = division_free_bounds(at_least)
    assert "//" not in after.script()
    mod = tvm.IRModule({"before": at_least.with_attr("global_symbol", "before"),
                        "after": after.with_attr("global_symbol", "after")})
    lib = tvm.compile(mod, target=TARGET)
    a = np.arange(-30, 34, 4, dtype="int64") + np.array([0, 1, 2, 3] * 4, dtype="int64")
    outs = []
    for name in ("before", "after"):
        out = tvm.runtime.tensor(np.zeros(16, dtype="int64"))
        lib[name](tvm.runtime.tensor(a), n, out)
        outs.append(out.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[1], (a // 4 >= n).astype("int64"))

"""BoolOrder: max, min and comparisons of booleans become logic, which LLVM builds (before/after
TIR, the builds, and the bool ops of a graph against eager); other dtypes are left alone."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm.script import tirx as T

from tests.conftest import Fn, ModuleGraph
from tvmgraph.schedules.bool_order import BoolOrder, bool_order

TARGET = tvm.target.Target({"kind": "llvm"})


@T.prim_func(private=True, s_tir=True)
def ordered(a: T.Buffer((8,), "bool"), b: T.Buffer((8,), "bool"), y: T.Buffer((8, 4), "bool")):
    """clamp_max, clamp_min, a < b, a == b of two bool tensors, as TOPI writes them."""
    for i in range(8):
        with T.sblock("y"):
            v = T.axis.spatial(8, i)
            y[v, 0] = T.min(a[v], b[v])
            y[v, 1] = T.max(a[v], b[v])
            y[v, 2] = a[v] < b[v]
            y[v, 3] = a[v] == b[v]


@T.prim_func(private=True, s_tir=True)
def as_logic(a: T.Buffer((8,), "bool"), b: T.Buffer((8,), "bool"), y: T.Buffer((8, 4), "bool")):
    for i in range(8):
        with T.sblock("y"):
            v = T.axis.spatial(8, i)
            y[v, 0] = a[v] and b[v]
            y[v, 1] = a[v] or b[v]
            y[v, 2] = not a[v] and b[v]
            y[v, 3] = not (a[v] and not b[v] or not a[v] and b[v])


@T.prim_func(private=True, s_tir=True)
def floats(a: T.Buffer((8,), "float32"), y: T.Buffer((8,), "bool")):
    for i in range(8):
        with T.sblock("y"):
            v = T.axis.spatial(8, i)
            y[v] = T.max(a[v], T.float32(0.0)) < T.float32(1.0)


def _build(func):
    return tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)


def test_bool_max_min_and_comparisons_become_logic_and_build() -> None:
    with pytest.raises(Exception, match=r"kDLFloat|FCmp"):
        _build(ordered)
    after = bool_order(ordered)
    tvm.ir.assert_structural_equal(after, as_logic)
    built = _build(after)
    a, b = torch.tensor([0, 0, 1, 1] * 2, dtype=torch.bool), torch.tensor([0, 1, 0, 1] * 2, dtype=torch.bool)
    y = torch.zeros(8, 4, dtype=torch.bool)
    built(*(tvm.runtime.from_dlpack(t) for t in (a, b, y)))
    assert torch.equal(y, torch.stack([a & b, a | b, a < b, a == b], 1))


def test_other_dtypes_are_left_alone() -> None:
    tvm.ir.assert_structural_equal(BoolOrder()(tvm.IRModule({"main": floats}))["main"], floats)


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
def test_bool_tensor_ops_match_eager() -> None:
    """They failed to compile (the bool OpInfo sweep)."""

    def fn(a, b):
        return (torch.clamp_max(a, b), torch.clamp_min(a, b), torch.heaviside(a, b), torch.maximum(a, b),
                a < b, a >= b, a == b, torch.index_reduce(a, 0, torch.tensor([0, 2, 2]), b[:3], "amax"))

    torch.manual_seed(0)
    a, b = torch.rand(5, 6) > 0.5, torch.rand(5, 6) > 0.5
    for got, want in zip(ModuleGraph(Fn(fn))(a, b), fn(a, b)):
        assert got.dtype == torch.bool and torch.equal(got, want)

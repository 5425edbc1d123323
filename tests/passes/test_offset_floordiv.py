"""OffsetFloorDiv: `(x + k) // d` without the offset inside the division (before/after TIR), the
TVM simplification it steers around, and the kernels that came out wrong against eager."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm import tirx
from tvm.script import tirx as T

from tests.conftest import Fn, ModuleGraph, SGDStep, assert_close
from tvmgraph.schedules.offset_floordiv import OffsetFloorDiv, offset_floordiv


def _value(expr: tirx.PrimExpr, var: tirx.Var, at: int) -> int:
    return int(tvm.sym.Analyzer().simplify(tirx.Let(var, tirx.const(at, var.ty.dtype), expr)))


def test_tvm_iter_map_simplify_is_wrong_on_an_offset_floordiv_of_a_floormod() -> None:
    """What FlattenBuffer does to every flattened index. If this starts to fail, TVM fixed it
    and OffsetFloorDiv can go."""
    f = tirx.Var("f", "int64")
    index = f // 8 * 4 + (f % 8 + 1) // 2  # src[f // 8, (f % 8 + 1) // 2] of a [6, 4] src
    domain = {f: tvm.ir.Range(tirx.const(0, "int64"), tirx.const(16, "int64"))}
    simplified = tvm.sym.iter_map_simplify([index], domain)[0]
    assert _value(index, f, 0) == 0 and _value(simplified, f, 0) == -4
    rewritten = offset_floordiv(tirx.PrimFunc([], tirx.Evaluate(index))).body.value
    kept = tvm.sym.iter_map_simplify([rewritten], domain)[0]
    assert [_value(kept, f, i) for i in range(16)] == [_value(index, f, i) for i in range(16)]


@T.prim_func(private=True, s_tir=True)
def scatter(x: T.Buffer((6, 8), "float32"), src: T.Buffer((6, 4), "float32"), y: T.Buffer((6, 8), "float32")):
    """torch.slice_scatter(x, src, 1, 0, 7, 2) as TOPI writes it, with the loops fused."""
    for f in range(48):
        with T.sblock("y"):
            i = T.axis.spatial(6, f // 8)
            j = T.axis.spatial(8, f % 8)
            y[i, j] = T.Select(j < 7 and j % 2 == 0, src[i, (j + 1) // 2], x[i, j])


@T.prim_func(private=True, s_tir=True)
def scatter_rewritten(x: T.Buffer((6, 8), "float32"), src: T.Buffer((6, 4), "float32"),
                      y: T.Buffer((6, 8), "float32")):
    for f in range(48):
        with T.sblock("y"):
            i = T.axis.spatial(6, f // 8)
            j = T.axis.spatial(8, f % 8)
            T.reads(src[i, j // 2 + T.Select(j % 2 >= 1, 1, 0)], x[i, j])
            T.writes(y[i, j])
            y[i, j] = T.Select(j < 7 and j % 2 == 0, src[i, j // 2 + T.Select(j % 2 >= 1, 1, 0)], x[i, j])


def test_the_offset_leaves_the_division_and_the_kernel_builds_right() -> None:
    after = OffsetFloorDiv()(tvm.IRModule({"main": scatter}))["main"]
    tvm.ir.assert_structural_equal(after, scatter_rewritten)
    x, src = torch.zeros(6, 8), torch.arange(24.0).reshape(6, 4) + 1
    expected = torch.slice_scatter(x, src, 1, 0, 7, 2)
    for func, right in ((scatter, False), (after, True)):
        y = torch.zeros(6, 8)
        built = tvm.tirx.build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
        built(*(tvm.runtime.from_dlpack(t) for t in (x, src, y)))
        assert torch.equal(y, expected) == right


def test_divisions_that_cannot_meet_a_floormod_are_left_alone() -> None:
    """No offset, an offset that is a multiple, or no `%` in reach (a strided convolution's
    gradient has hundreds of `(x + 1) // 2` of plain iterators)."""
    f = tirx.Var("f", "int64")
    for expr in (f // 2, (f % 8 + 4) // 2, (f + 1) // 2, (f * 2 + 1) // 4):
        body = tirx.Evaluate(expr)
        assert offset_floordiv(tirx.PrimFunc([], body)).body.same_as(body)


@pytest.mark.parametrize("fn", [
    pytest.param(lambda t: torch.slice_scatter(torch.zeros(6, 8), t[:, :4] * 2, 1, 0, 7, 2), id="slice_scatter-step"),
    pytest.param(lambda t: t[:, ::2] * 2 + t[:, 1::2], id="strided-slices"),
])
def test_strided_slices_and_their_gradients_match_eager(fn) -> None:
    """`t[:, ::2]`'s gradient (a slice_scatter with a step) had its rows shifted by one, the first
    read from outside the tensor: a rotary embedding trained wrong (x[..., ::2], x[..., 1::2])."""
    x = torch.randn(6, 8)
    assert_close(ModuleGraph(Fn(fn))(x), fn(x))
    leaf = x.clone().requires_grad_()
    w = torch.randn_like(fn(x))
    (fn(leaf) * w).sum().backward()

    class Op(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.x = torch.nn.Parameter(x.clone())

        def forward(self, weight):
            return (fn(self.x) * weight).sum()

    model = Op()
    SGDStep(model)(w)
    assert_close(x - model.x.detach(), leaf.grad)

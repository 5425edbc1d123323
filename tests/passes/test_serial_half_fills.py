"""SerialHalfFills: a vectorized bfloat16 fill runs serial, so that TVM's bfloat16 legalization
builds it; a computed bfloat16 store stays vectorized (before/after TIR, and the builds)."""

from __future__ import annotations

import pytest
import torch
import tvm
from tvm.script import tirx as T

from tvmgraph.schedules.serial_half_fills import SerialHalfFills, serial_half_fills

TARGET = tvm.target.Target({"kind": "llvm"})


@T.prim_func(private=True, s_tir=True)
def fill(y: T.Buffer((T.int64(48),), "bfloat16")):
    """An LSTM's zero initial state under AMP, as the elementwise schedule vectorizes it."""
    for io in range(T.int64(3)):
        for ii in T.vectorized(T.int64(16)):
            with T.sblock("fill"):
                v = T.axis.spatial(T.int64(48), io * T.int64(16) + ii)
                y[v] = T.Cast("bfloat16", T.float32(0.0))


@T.prim_func(private=True, s_tir=True)
def fill_serial(y: T.Buffer((T.int64(48),), "bfloat16")):
    for io in range(T.int64(3)):
        for ii in range(T.int64(16)):
            with T.sblock("fill"):
                v = T.axis.spatial(T.int64(48), io * T.int64(16) + ii)
                y[v] = T.Cast("bfloat16", T.float32(0.0))


@T.prim_func(private=True, s_tir=True)
def cast(x: T.Buffer((T.int64(48),), "float32"), y: T.Buffer((T.int64(48),), "bfloat16")):
    for io in range(T.int64(3)):
        for ii in T.vectorized(T.int64(16)):
            with T.sblock("cast"):
                v = T.axis.spatial(T.int64(48), io * T.int64(16) + ii)
                y[v] = T.Cast("bfloat16", x[v])


def test_a_vectorized_bfloat16_fill_runs_serial_and_builds() -> None:
    with pytest.raises(Exception, match="dtype mismatch on BufferStore"):
        tvm.tirx.build(tvm.IRModule({"main": fill.with_attr("global_symbol", "main")}), target=TARGET)
    after = serial_half_fills(fill)
    tvm.ir.assert_structural_equal(after, fill_serial)
    built = tvm.tirx.build(tvm.IRModule({"main": after.with_attr("global_symbol", "main")}), target=TARGET)
    y = torch.full((48,), 7.0, dtype=torch.bfloat16)
    built(tvm.runtime.from_dlpack(y))
    assert not y.any()


def test_a_computed_bfloat16_store_stays_vectorized() -> None:
    after = SerialHalfFills()(tvm.IRModule({"main": cast}))["main"]
    tvm.ir.assert_structural_equal(after, cast)

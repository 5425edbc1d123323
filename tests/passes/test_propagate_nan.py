"""PropagateNaN: float max/min keep a NaN operand, in element-wise kernels and reductions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from tvmgraph.schedules.bitwise_isnan import BitwiseIsNaN
from tvmgraph.schedules.propagate_nan import PropagateNaN, has_one_instruction_maximum


def _legalized(*ops, dtype: str = "float32") -> tvm.IRModule:
    """A module whose kernels are TVM's own legalization of `ops(x, y, i)`: x, y [4, 8] of
    `dtype`, i [4, 8] int32."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), dtype))
    y = relax.Var("y", relax.TensorType((4, 8), dtype))
    i = relax.Var("i", relax.TensorType((4, 8), "int32"))
    with bb.function("main", [x, y, i]):
        with bb.dataflow():
            outs = [bb.emit(op(x, y, i)) for op in ops]
            gv = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(gv)
    return relax.transform.LegalizeOps()(bb.get())


def _kernels(mod: tvm.IRModule) -> dict[str, str]:
    return {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


_OPS = (lambda x, y, i: relax.op.nn.relu(x), lambda x, y, i: relax.op.minimum(x, y),
        lambda x, y, i: relax.op.max(x, axis=1))


def test_float32_max_and_min_become_selects_that_keep_nan() -> None:
    """x86: relu, an element-wise minimum and a max reduction: the same kernels, each max/min a
    select that keeps the first operand's NaN (the compare is false), and tests the second's
    unless it is a constant (relu's 0)."""
    before, after = _kernels(_legalized(*_OPS)), _kernels(PropagateNaN()(_legalized(*_OPS)))
    rewrites = {
        "relu": ("T.max(x[v_i0, v_i1], T.float32(0.0))",
                 "T.Select(x[v_i0, v_i1] < T.float32(0.0), T.float32(0.0), x[v_i0, v_i1])"),
        "minimum": ("T.min(x[v_ax0, v_ax1], y[v_ax0, v_ax1])",
                    "T.Select(T.isnan(y[v_ax0, v_ax1]), y[v_ax0, v_ax1], "
                    "T.Select(x[v_ax0, v_ax1] > y[v_ax0, v_ax1], y[v_ax0, v_ax1], x[v_ax0, v_ax1]))"),
        "max": ("T.max(x_red[v_ax0], x[v_ax0, v_k1])",
                "T.Select(T.isnan(x[v_ax0, v_k1]), x[v_ax0, v_k1], "
                "T.Select(x_red[v_ax0] < x[v_ax0, v_k1], x[v_ax0, v_k1], x_red[v_ax0]))"),
    }
    for name, (old, new) in rewrites.items():
        assert before[name].count(old) == 1, name
        assert after[name] == before[name].replace(old, new), name


def test_float32_max_and_min_become_llvm_maximum_and_minimum_on_aarch64() -> None:
    """AArch64 computes IEEE 754-2019's maximum/minimum in one instruction (fmax/fmin)."""
    before = _kernels(_legalized(*_OPS))
    after = _kernels(PropagateNaN(ieee_intrinsics=True)(_legalized(*_OPS)))
    old = "T.max(x[v_i0, v_i1], T.float32(0.0))"
    new = 'T.call_llvm_pure_intrin("float32", "llvm.maximum", x[v_i0, v_i1], T.float32(0.0))'
    assert after["relu"] == before["relu"].replace(old, new)
    assert after["minimum"].count('"llvm.minimum"') == 1 and after["max"].count('"llvm.maximum"') == 1
    aarch64 = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})
    assert has_one_instruction_maximum(aarch64)
    assert not has_one_instruction_maximum(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))


def test_half_floats_get_selects_that_skip_constants() -> None:
    """bfloat16 (widened by TVM only later): a select on isnan of the float32 value, none for
    relu's constant 0."""
    ops = (lambda x, y, i: relax.op.nn.relu(x), lambda x, y, i: relax.op.maximum(x, y))
    before = _kernels(_legalized(*ops, dtype="bfloat16"))
    after = _kernels(PropagateNaN()(_legalized(*ops, dtype="bfloat16")))
    old = "T.max(x[v_i0, v_i1], T.bfloat16(0.0))"
    new = f"T.Select(T.isnan(T.Cast(\"float32\", x[v_i0, v_i1])), x[v_i0, v_i1], {old})"
    assert after["relu"] == before["relu"].replace(old, new)
    assert after["maximum"].count("T.isnan(") == 2 and after["maximum"].count("T.Select(") == 2


def test_integer_max_and_kernels_without_one_are_untouched() -> None:
    ops = (lambda x, y, i: relax.op.maximum(i, i), lambda x, y, i: relax.op.add(x, y))
    mod = _legalized(*ops)
    out = PropagateNaN()(mod)
    for gv, func in mod.functions_items():
        assert out[gv.name_hint].same_as(func), gv.name_hint


@pytest.mark.parametrize("ieee_intrinsics", [False, True], ids=["selects", "llvm.maximum"])
def test_built_kernels_propagate_nan_like_numpy(ieee_intrinsics: bool) -> None:
    """Built for the CPU (with BitwiseIsNaN after, as in the pipeline): relu(NaN), a minimum with
    NaN on either side and max over a row holding NaN, first or later, are NaN (0 and 2 before);
    -inf and +inf stay what numpy gives."""
    mod = _legalized(*_OPS)
    mod = BitwiseIsNaN()(PropagateNaN(ieee_intrinsics)(mod))
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.arange(32, dtype="float32").reshape(4, 8) - 16
    y = -x
    x[1, 3] = math.nan
    x[2, 0] = math.nan  # the row's first element: NaN must stay through later larger ones
    x[3, 2], x[3, 5] = math.inf, -math.inf
    y[0, 4] = math.nan
    ints = tvm.runtime.tensor(np.zeros((4, 8), dtype="int32"))
    relu, minimum, row_max = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y), ints)
    np.testing.assert_array_equal(relu.numpy(), np.maximum(x, 0))  # numpy's maximum keeps NaN
    np.testing.assert_array_equal(minimum.numpy(), np.minimum(x, y))
    np.testing.assert_array_equal(row_max.numpy(), np.max(x, axis=1))


def test_float_not_equal_is_true_for_nan_like_numpy() -> None:
    """Before/after: TVM's float `!=` is LLVM's ordered compare, false for NaN; after the pass
    `x != y` also tests each operand for NaN (a constant is not tested), and built for the CPU
    it gives numpy's `!=`; an integer `!=` is untouched."""
    ops = (lambda x, y, i: relax.op.not_equal(x, y), lambda x, y, i: relax.op.not_equal(x, relax.const(0.0, "float32")),
           lambda x, y, i: relax.op.not_equal(i, i))
    mod = _legalized(*ops)
    before, after = _kernels(mod), _kernels(PropagateNaN()(mod))
    assert "T.isnan(x[v_ax0, v_ax1]) or T.isnan(y[v_ax0, v_ax1])" in after["not_equal"], after["not_equal"]
    assert after["not_equal1"].count("T.isnan") == 1, after["not_equal1"]
    assert after["not_equal2"] == before["not_equal2"]
    ex = tvm.compile(BitwiseIsNaN()(PropagateNaN()(mod)), target=tvm.target.Target({"kind": "llvm"}))
    x = np.zeros((4, 8), dtype="float32")
    y = np.ones((4, 8), dtype="float32")
    x[0, :3], y[0, 1:4] = math.nan, math.nan
    x[1, 0] = y[1, 0] = 1.0
    x[2, 0] = y[2, 0] = math.inf
    ints = tvm.runtime.tensor(np.zeros((4, 8), dtype="int32"))
    ne, ne_zero, _ = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(y), ints)
    np.testing.assert_array_equal(ne.numpy(), x != y)
    np.testing.assert_array_equal(ne_zero.numpy(), x != 0)

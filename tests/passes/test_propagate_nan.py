"""PropagateNaN: float max/min keep a NaN operand, in element-wise kernels and reductions."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, tirx

from tvmgraph.schedules.propagate_nan import PropagateNaN


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


def test_float32_max_and_min_become_llvm_maximum_and_minimum() -> None:
    """relu, an element-wise minimum and a max reduction: the same kernels, each max/min an
    IEEE maximum/minimum (NaN if either operand is)."""
    ops = (lambda x, y, i: relax.op.nn.relu(x), lambda x, y, i: relax.op.minimum(x, y),
           lambda x, y, i: relax.op.max(x, axis=1))
    before, after = _kernels(_legalized(*ops)), _kernels(PropagateNaN()(_legalized(*ops)))
    rewrites = {
        "relu": ("T.max(x[v_i0, v_i1], T.float32(0.0))",
                 'T.call_llvm_pure_intrin("float32", "llvm.maximum", x[v_i0, v_i1], T.float32(0.0))'),
        "minimum": ("T.min(x[v_ax0, v_ax1], y[v_ax0, v_ax1])",
                    'T.call_llvm_pure_intrin("float32", "llvm.minimum", x[v_ax0, v_ax1], y[v_ax0, v_ax1])'),
        "max": ("T.max(x_red[v_ax0], x[v_ax0, v_k1])",
                'T.call_llvm_pure_intrin("float32", "llvm.maximum", x_red[v_ax0], x[v_ax0, v_k1])'),
    }
    for name, (old, new) in rewrites.items():
        assert before[name].count(old) == 1, name
        assert after[name] == before[name].replace(old, new), name


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


def test_built_kernels_propagate_nan_like_numpy() -> None:
    """Built for the CPU: relu(NaN) and max over a row holding NaN are NaN (0 and 2 before)."""
    mod = PropagateNaN()(_legalized(lambda x, y, i: relax.op.nn.relu(x), lambda x, y, i: relax.op.max(x, axis=1)))
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = np.arange(32, dtype="float32").reshape(4, 8) - 16
    x[1, 3] = math.nan
    ints = tvm.runtime.tensor(np.zeros((4, 8), dtype="int32"))
    relu, row_max = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(x), ints)
    np.testing.assert_array_equal(relu.numpy(), np.maximum(x, 0))  # numpy's maximum keeps NaN
    np.testing.assert_array_equal(row_max.numpy(), np.max(x, axis=1))

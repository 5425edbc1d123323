"""BitwiseIsNaN: isnan (and the isinf/isfinite built on it) as an integer test of the bits,
which vectorizes; the same answers as numpy for every kind of float value."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import tvm
from tvm import relax, te, tirx

from tvmgraph.schedules.bitwise_isnan import BitwiseIsNaN

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")(),
                            "opt-level": 1})  # tvmgraph's level, where TVM's isnan stays scalar


def _as_int8(test, x: te.Tensor):
    return lambda i: test(x[i]).astype("int8")


def _checks(dtype: str) -> tvm.IRModule:
    """isnan, isinf and isfinite of x [64] as int8, in one kernel each, vectorized by 16."""
    x = te.placeholder((64,), dtype, name="x")
    funcs = {}
    for name, test in (("isnan", tirx.isnan), ("isinf", tirx.isinf), ("isfinite", tirx.isfinite)):
        y = te.compute((64,), _as_int8(test, x), name="y")
        sch = tvm.s_tir.Schedule(te.create_prim_func([x, y]))
        (loop,) = sch.get_loops(sch.get_sblock("y"))
        sch.vectorize(sch.split(loop, [None, 16])[1])
        funcs[name] = sch.mod["main"].with_attr("global_symbol", name)
    return tvm.IRModule(funcs)


def test_isnan_becomes_a_test_of_the_bits() -> None:
    """Before: T.isnan(x[i]). After: (reinterpret<int32>(x[i]) & 0x7fffffff) > 0x7f800000."""
    before = _checks("float32")
    after = BitwiseIsNaN()(before)
    old = "T.isnan(x[v_i])"
    new = 'T.reinterpret("int32", x[v_i]) & 2147483647 > 2139095040'
    for name in ("isnan", "isinf", "isfinite"):
        text = before[name].script()
        assert old in text, name
        assert after[name].script() == text.replace(old, new), name


def test_other_kernels_are_untouched() -> None:
    a = te.placeholder((8,), "float32", name="a")
    mod = tvm.IRModule({"main": te.create_prim_func([a, te.compute((8,), lambda i: a[i] * 2, name="b")])})
    assert BitwiseIsNaN()(mod).same_as(mod)


@pytest.mark.parametrize("dtype", ["float32", "float64"])  # TVM's isnan takes no 16-bit float
def test_built_checks_agree_with_numpy(dtype: str) -> None:
    """NaNs of either sign and payload, infinities, the largest finite value, subnormals, zeros."""
    np_dtype = np.dtype(dtype)
    info = np.finfo(np_dtype)
    specials = [np.nan, -np.nan, np.inf, -np.inf, float(info.max), -float(info.max), float(info.smallest_subnormal),
                0.0, -0.0, 1.0, -2.5]
    values = np.resize(np.array(specials, dtype=np_dtype), 64)
    bits = values.view(f"uint{values.itemsize * 8}")
    bits[1] |= 1  # a NaN with another payload
    lib = tvm.compile(BitwiseIsNaN()(_checks(dtype)), target=TARGET)
    expected = {"isnan": np.isnan(values), "isinf": np.isinf(values), "isfinite": np.isfinite(values)}
    for name, want in expected.items():
        out = tvm.runtime.empty((64,), "int8")
        lib[name](tvm.runtime.tensor(values), out)
        np.testing.assert_array_equal(out.numpy().astype(bool), want, err_msg=name)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 assembly")
def test_the_checks_compile_to_vector_code() -> None:
    """TVM's isnan compiles to one scalar compare per lane (ucomiss); the bitwise test to vector
    instructions, with no scalar compare left."""
    before = tvm.compile(_checks("float32"), target=TARGET).mod.inspect_source("asm")
    after = tvm.compile(BitwiseIsNaN()(_checks("float32")), target=TARGET).mod.inspect_source("asm")
    assert before.count("ucomiss") >= 16
    assert after.count("ucomiss") == 0

"""SafeIntegerDivision: an integer division by a zero read from a tensor gives 0, no SIGFPE."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import tvm
from tvm import relax, tirx

from tvmgraph.schedules.safe_integer_division import SafeIntegerDivision


def _legalized(*ops) -> tvm.IRModule:
    """TVM's own legalization of `ops(a, b)`: a, b [8] int64."""
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((8,), "int64"))
    b = relax.Var("b", relax.TensorType((8,), "int64"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            gv = bb.emit_output(relax.Tuple([bb.emit(op(a, b)) for op in ops]))
        bb.emit_func_output(gv)
    return relax.transform.LegalizeOps()(bb.get())


def _kernels(mod: tvm.IRModule) -> dict[str, str]:
    return {gv.name_hint: f.script() for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


_OPS = (lambda a, b: relax.op.floor_divide(a, b), lambda a, b: relax.op.floor_mod(a, b),
        lambda a, b: relax.op.floor_divide(a, relax.const(3, "int64")))


def test_a_divisor_read_from_a_buffer_is_guarded_a_constant_is_not() -> None:
    """Before/after: the divisor `b[i]` becomes `select(b[i] == 0 | b[i] == -1, 1, b[i])`, the
    result 0 where it is 0 (and the remainder where it is -1), the quotient by -1 `~a + 1` as
    unsigned (wrapping); `a // 3` is unchanged."""
    before, after = _kernels(_legalized(*_OPS)), _kernels(SafeIntegerDivision()(_legalized(*_OPS)))
    zero_or_minus_one = "(b[v_ax0] == T.int64(0)) | (b[v_ax0] == T.int64(-1))"
    rewrites = {
        "floor_divide": ("a[v_ax0] // b[v_ax0]",
                         "T.Select(b[v_ax0] == T.int64(0), T.int64(0), T.Select(b[v_ax0] == T.int64(-1), "
                         "T.Cast(\"int64\", ~T.Cast(\"uint64\", a[v_ax0]) + T.uint64(1)), "
                         f"a[v_ax0] // T.Select({zero_or_minus_one}, T.int64(1), b[v_ax0])))"),
        "floor_mod": ("a[v_ax0] % b[v_ax0]",
                      f"T.Select({zero_or_minus_one}, T.int64(0), "
                      f"a[v_ax0] % T.Select({zero_or_minus_one}, T.int64(1), b[v_ax0]))"),
    }
    for name, (old, new) in rewrites.items():
        assert before[name].count(old) == 1, before[name]
        assert after[name] == before[name].replace(old, new), after[name]
    assert after["floor_divide1"] == before["floor_divide1"]


def test_built_kernels_divide_as_before_and_give_zero_for_a_zero_divisor() -> None:
    """Built for the CPU: numpy's floor division and remainder, 0 where b is 0 (a SIGFPE before)."""
    ex = tvm.compile(SafeIntegerDivision()(_legalized(*_OPS[:2])), target=tvm.target.Target({"kind": "llvm"}))
    a = np.array([7, -7, 3, 9, 0, -1, 5, 8], dtype="int64")
    b = np.array([2, 0, 1, -2, 0, 3, -4, 8], dtype="int64")
    quotient, remainder = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b))
    safe = np.where(b == 0, 1, b)
    np.testing.assert_array_equal(quotient.numpy(), np.where(b == 0, 0, np.floor_divide(a, safe)))
    np.testing.assert_array_equal(remainder.numpy(), np.where(b == 0, 0, np.remainder(a, safe)))


def test_a_graph_dividing_integers_by_zero_returns_instead_of_killing_the_process() -> None:
    """x86's idiv traps on a zero divisor: the graph's call died of SIGFPE (eager raises
    ZeroDivisionError). Run in a subprocess, so that a crash fails this test only."""
    script = textwrap.dedent("""
        import torch
        from tests.conftest import Fn, ModuleGraph
        a, b = torch.tensor([7, -7, 3, 9]), torch.tensor([2, 0, 1, -2])
        fn = lambda a, b: (a // b, a % b, torch.fmod(a, b), a.int() // b.int())
        got = ModuleGraph(Fn(fn))(a, b)
        print([t.tolist() for t in got])
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[[3, 0, 3, -5], [1, 0, 0, -1], [1, 0, 0, 1], [3, 0, 3, -5]]"


def test_the_minimum_divided_by_minus_one_wraps_as_torch_instead_of_killing_the_process() -> None:
    """INT_MIN // -1 overflows x86's idiv, which traps: the process died of SIGFPE (eager wraps:
    -128 // -1 is -128 in int8, the remainder 0). In a subprocess, so that a crash fails this
    test only; every signed width, floor division, remainder and fmod (eager's int32 truncating
    division dies of SIGFPE itself there)."""
    script = textwrap.dedent("""
        import torch
        from tests.conftest import Fn, ModuleGraph
        fn = lambda a, b: (a // b, a % b, torch.fmod(a, b))
        for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
            a = torch.tensor([torch.iinfo(dtype).min, 7, -7, torch.iinfo(dtype).max], dtype=dtype)
            b = torch.tensor([-1, -1, 2, -1], dtype=dtype)
            for got, want in zip(ModuleGraph(Fn(fn))(a, b), fn(a, b)):
                assert torch.equal(got, want), (dtype, got, want)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "ok"

"""CompressMemory packs a function's intermediate tensors into one arena, in place where it can.

Modules are in the form CompressMemory sees in the pipeline (after CallTIRRewrite): explicit
`R.builtin.alloc_tensor`s passed to TIR kernels. The planner is also tested by its invariant:
no two tensors live at the same time share a byte, on random lifetimes and on a real program.
"""

from __future__ import annotations

import random

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relay_passes.compress_memory import (ALIGN, CompressMemory, FunctionPlan, Tensor, analyze,
                                          check_plan, inplace_safe, pack)

N = 262144  # float32 elements in 1 MiB


@I.ir_module
class ExpTwice:
    """exp(exp(x)) summed: the second exp reads the first result for the last time."""

    @T.prim_func(private=True, s_tir=True)
    def exp(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32")):
        for i in range(N):
            with T.sblock("y"):
                vi = T.axis.spatial(N, i)
                y[vi] = T.exp(x[vi])

    @T.prim_func(private=True)
    def total(x: T.Buffer((N,), "float32"), y: T.Buffer((), "float32")):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((N,), "float32")) -> R.Tensor((), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = ExpTwice
        a = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.exp(x, a)
        b = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.exp(a, b)
        c = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.total(b, c)
        return c


def test_elementwise_result_takes_the_memory_of_its_dying_input() -> None:
    """b is written over a (same offset of one 1 MiB arena); c is returned, so it keeps its own
    allocation. StaticPlanBlockMemory needs two storages (2 MiB)."""

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def exp(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32")):
            for i in range(N):
                with T.sblock("y"):
                    vi = T.axis.spatial(N, i)
                    y[vi] = T.exp(x[vi])

        @T.prim_func(private=True)
        def total(x: T.Buffer((N,), "float32"), y: T.Buffer((), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((N,), "float32")) -> R.Tensor((), "float32"):
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            arena = R.memory.alloc_storage(R.shape([4 * N]), R.prim_value(0), R.str("global"), R.dtype("uint8"))
            a = R.memory.alloc_tensor(arena, R.prim_value(0), R.shape([N]), R.dtype("float32"), R.prim_value(0))
            cls.exp(x, a)
            b = R.memory.alloc_tensor(arena, R.prim_value(0), R.shape([N]), R.dtype("float32"), R.prim_value(0))
            cls.exp(a, b)
            c = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.total(b, c)
            return c

    messages: list[str] = []
    tvm.ir.assert_structural_equal(CompressMemory(report=messages.append)(ExpTwice), Expected)
    assert messages == ["CompressMemory: memory planned: main 2.0 MiB -> 1.0 MiB "
                        "(2 tensors in 1 arena(s), 1 in place)"]


def test_two_dead_halves_make_room_for_a_whole() -> None:
    """a1 and a2 (512 KiB each) die before b (1 MiB) is written: b goes where both were.
    StaticPlanBlockMemory can reuse only one of them (enlarged): 1.5 MiB; the arena: 1 MiB and
    one aligned scalar. Offsets other than 0 go through ensure_zero_offset (kernels need
    byte_offset 0)."""

    @I.ir_module
    class Before:
        @T.prim_func(private=True)
        def fill(x: T.Buffer((N // 2,), "float32"), y: T.Buffer((N // 2,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def dot(a: T.Buffer((N // 2,), "float32"), b: T.Buffer((N // 2,), "float32"), s: T.Buffer((), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def spread(s: T.Buffer((), "float32"), y: T.Buffer((N,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def total(x: T.Buffer((N,), "float32"), y: T.Buffer((), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((N // 2,), "float32")) -> R.Tensor((), "float32"):
            R.func_attr({"relax.force_pure": True})
            cls = Before
            a1 = R.builtin.alloc_tensor(R.shape([N // 2]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.fill(x, a1)
            a2 = R.builtin.alloc_tensor(R.shape([N // 2]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.fill(x, a2)
            s = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.dot(a1, a2, s)
            b = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.spread(s, b)
            c = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.total(b, c)
            return c

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def fill(x: T.Buffer((N // 2,), "float32"), y: T.Buffer((N // 2,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def dot(a: T.Buffer((N // 2,), "float32"), b: T.Buffer((N // 2,), "float32"), s: T.Buffer((), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def spread(s: T.Buffer((), "float32"), y: T.Buffer((N,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def total(x: T.Buffer((N,), "float32"), y: T.Buffer((), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((N // 2,), "float32")) -> R.Tensor((), "float32"):
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            arena = R.memory.alloc_storage(R.shape([4 * N + ALIGN]), R.prim_value(0), R.str("global"),
                                           R.dtype("uint8"))
            a1 = R.memory.alloc_tensor(arena, R.prim_value(0), R.shape([N // 2]), R.dtype("float32"), R.prim_value(0))
            cls.fill(x, a1)
            a2_at = R.memory.alloc_tensor(arena, R.prim_value(2 * N), R.shape([N // 2]), R.dtype("float32"),
                                          R.prim_value(0))
            a2 = R.memory.ensure_zero_offset(a2_at)
            cls.fill(x, a2)
            s_at = R.memory.alloc_tensor(arena, R.prim_value(4 * N), R.shape([]), R.dtype("float32"), R.prim_value(0))
            s = R.memory.ensure_zero_offset(s_at)
            cls.dot(a1, a2, s)
            b = R.memory.alloc_tensor(arena, R.prim_value(0), R.shape([N]), R.dtype("float32"), R.prim_value(0))
            cls.spread(s, b)
            c = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.total(b, c)
            return c

    messages: list[str] = []
    tvm.ir.assert_structural_equal(CompressMemory(report=messages.append)(Before), Expected)
    assert messages == ["CompressMemory: memory planned: main 1.5 MiB -> 1.0 MiB "
                        "(4 tensors in 1 arena(s), 0 in place)"]


@I.ir_module
class HandedToPackedFunction:
    """a goes to a packed function (which may keep it), b to a kernel only."""

    @T.prim_func(private=True)
    def fill(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32")):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((N,), "float32")) -> R.Tensor((N,), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = HandedToPackedFunction
        a = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.fill(x, a)
        _ = R.call_packed("tvmgraph.test.keep", a, ty_args=R.Tuple())
        b = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.fill(x, b)
        c = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.fill(b, c)
        return c


def test_what_escapes_is_left_to_static_plan_and_no_gain_keeps_the_function() -> None:
    """a (passed to a packed function) and c (returned) escape; b alone is planned, in 1 MiB,
    which is no better than StaticPlanBlockMemory: the function is kept as it was."""
    plan = analyze(HandedToPackedFunction, HandedToPackedFunction["main"])
    assert [t.var.name for t in plan.tensors.values()] == ["b"]
    messages: list[str] = []
    out = CompressMemory(report=messages.append)(HandedToPackedFunction)
    tvm.ir.assert_structural_equal(out, HandedToPackedFunction)
    assert messages == ["CompressMemory: memory planned: main 1.0 MiB kept (arena: 1.0 MiB)"]


@I.ir_module
class TwoResults:
    """A kernel with two results (a fused linear + GELU's pre-activation and output): `act` is
    read for the last time by the first `scale`, `pre` by the last one."""

    @T.prim_func(private=True)
    def pair(x: T.Buffer((N,), "float32"), pre: T.Buffer((N,), "float32"), act: T.Buffer((N,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def scale(x: T.Buffer((N,), "float32"), y: T.Buffer((N,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def total(x: T.Buffer((N,), "float32"), y: T.Buffer((), "float32")):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((N,), "float32")) -> R.Tensor((), "float32"):
        R.func_attr({"relax.force_pure": True})
        cls = TwoResults
        a = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        b = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.pair(x, a, b)
        both = (a, b)
        pre = both[0]
        act = both[1]
        c = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.scale(act, c)
        d = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.scale(c, d)
        e = R.builtin.alloc_tensor(R.shape([N]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.scale(pre, e)
        s = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.total(e, s)
        return s


def test_each_result_of_a_kernel_lives_until_its_own_last_reader() -> None:
    """Reading `pre` (field 0) late keeps `a` alive, not `b`: `b` dies at its reader `scale(act)`,
    so `d` can take its memory. (Read through the tuple as a whole, both would live to the end:
    four tensors live at once instead of three.)"""
    plan = analyze(TwoResults, TwoResults["main"], inplace=False)
    by_name = {t.var.name: t for t in plan.tensors.values()}
    positions = {b.var.name: i for i, b in enumerate(TwoResults["main"].body.blocks[0].bindings)}
    assert by_name["b"].end == positions["c"] + 1  # its only reader, the call after c's allocation
    assert by_name["a"].end == positions["e"] + 1
    pack(plan)
    assert check_plan(plan) == []
    assert sum(plan.arena_bytes.values()) == 3 * 4 * N  # s is returned: not planned


@I.ir_module
class DynamicExpTwice:
    """ExpTwice with a dynamic batch: (n, 16) tensors, whose bytes are 64 per row."""

    @T.prim_func(private=True, s_tir=True)
    def exp(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 16))
        y = T.match_buffer(var_y, (n, 16))
        for i, j in T.grid(n, 16):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = T.exp(x[vi, vj])

    @T.prim_func(private=True)
    def square(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 16))
        y = T.match_buffer(var_y, (n, 16))
        T.evaluate(0)

    @T.prim_func(private=True)
    def total(var_x: T.handle, var_y: T.handle, s: T.Buffer((), "float32")):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 16))
        y = T.match_buffer(var_y, (n, 16))
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor(("n", 16), "float32")) -> R.Tensor((), "float32"):
        n = T.int64()
        R.func_attr({"relax.force_pure": True})
        cls = DynamicExpTwice
        a = R.builtin.alloc_tensor(R.shape([n, 16]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.exp(x, a)
        b = R.builtin.alloc_tensor(R.shape([n, 16]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.square(a, b)
        c = R.builtin.alloc_tensor(R.shape([n, 16]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.exp(a, c)
        s = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
        cls.total(b, c, s)
        return s


def test_a_dynamic_batch_gets_an_arena_of_n_rows() -> None:
    """a, b and c are (n, 16): an arena of 3 x 64 bytes per row (c written over a, which dies
    there; b is live across), sized and offset by n at run time. StaticPlanBlockMemory gives
    each its own storage; compared at n = 64 the arena is smaller."""

    @I.ir_module
    class Expected:
        @T.prim_func(private=True, s_tir=True)
        def exp(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 16))
            y = T.match_buffer(var_y, (n, 16))
            for i, j in T.grid(n, 16):
                with T.sblock("y"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    y[vi, vj] = T.exp(x[vi, vj])

        @T.prim_func(private=True)
        def square(var_x: T.handle, var_y: T.handle):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 16))
            y = T.match_buffer(var_y, (n, 16))
            T.evaluate(0)

        @T.prim_func(private=True)
        def total(var_x: T.handle, var_y: T.handle, s: T.Buffer((), "float32")):
            n = T.int64()
            x = T.match_buffer(var_x, (n, 16))
            y = T.match_buffer(var_y, (n, 16))
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor(("n", 16), "float32")) -> R.Tensor((), "float32"):
            n = T.int64()
            R.func_attr({"relax.force_pure": True})
            cls = Expected
            arena = R.memory.alloc_storage(R.shape([n * 128]), R.prim_value(0), R.str("global"), R.dtype("uint8"))
            a = R.memory.alloc_tensor(arena, R.prim_value(0), R.shape([n, 16]), R.dtype("float32"), R.prim_value(0))
            cls.exp(x, a)
            b_at = R.memory.alloc_tensor(arena, R.prim_value(n * 64), R.shape([n, 16]), R.dtype("float32"),
                                         R.prim_value(0))
            b = R.memory.ensure_zero_offset(b_at)
            cls.square(a, b)
            c = R.memory.alloc_tensor(arena, R.prim_value(0), R.shape([n, 16]), R.dtype("float32"), R.prim_value(0))
            cls.exp(a, c)
            s = R.builtin.alloc_tensor(R.shape([]), R.dtype("float32"), R.prim_value(0), R.str("global"))
            cls.total(b, c, s)
            return s

    messages: list[str] = []
    tvm.ir.assert_structural_equal(CompressMemory(report=messages.append)(DynamicExpTwice), Expected)
    assert messages == ["CompressMemory: memory planned: main 12.0 KiB -> 8.0 KiB at 64 rows "
                        "(3 tensors in 1 arena(s), 1 in place; arenas 128 B x n)"]


def test_kill_switch_and_in_place_switch() -> None:
    """Disabled, the pass returns its input; with inplace=False, b gets its own megabyte."""
    assert CompressMemory(enabled=False)(ExpTwice).same_as(ExpTwice)
    messages: list[str] = []
    CompressMemory(report=messages.append, inplace=False)(ExpTwice)
    assert messages == ["CompressMemory: memory planned: main 2.0 MiB kept (arena: 2.0 MiB)"]


def test_gpu_targets_keep_static_plan() -> None:
    """Under a CUDA target (RewriteCUDAGraph runs next) the module is returned unchanged."""
    messages: list[str] = []
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
        out = CompressMemory(report=messages.append)(ExpTwice)
    assert out.same_as(ExpTwice)
    assert messages == ["CompressMemory: skipped on cuda (StaticPlanBlockMemory plans)"]


# ---- which kernels may write a result over an input ----

@I.ir_module
class Kernels:
    @T.prim_func(private=True, s_tir=True)
    def scale_add(x: T.Buffer((4, 8), "float32"), bias: T.Buffer((8,), "float32"), y: T.Buffer((4, 8), "float32")):
        for i, j in T.grid(4, 8):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vi, vj] * T.float32(2) + bias[vj]

    @T.prim_func(private=True, s_tir=True)
    def fused_vectorized(x: T.Buffer((4, 32), "float32"), y: T.Buffer((4, 32), "float32")):
        for ij_0 in T.parallel(8):
            for ij_1 in T.vectorized(16):
                with T.sblock("y"):
                    vi = T.axis.spatial(4, (ij_0 * 16 + ij_1) // 32)
                    vj = T.axis.spatial(32, (ij_0 * 16 + ij_1) % 32)
                    y[vi, vj] = T.max(x[vi, vj], T.float32(0))

    @T.prim_func(private=True, s_tir=True)
    def transpose(x: T.Buffer((8, 8), "float32"), y: T.Buffer((8, 8), "float32")):
        for i, j in T.grid(8, 8):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vj, vi]

    @T.prim_func(private=True, s_tir=True)
    def shift(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        for i in range(7):
            with T.sblock("y"):
                vi = T.axis.spatial(7, i)
                y[vi] = x[vi + 1]

    @T.prim_func(private=True, s_tir=True)
    def two_readers(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32"), z: T.Buffer((8,), "float32")):
        for i in range(8):
            with T.sblock("y"):
                vi = T.axis.spatial(8, i)
                y[vi] = x[vi] + T.float32(1)
        for i in range(8):
            with T.sblock("z"):
                vi = T.axis.spatial(8, i)
                z[vi] = x[vi] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def repeated(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        for k, i in T.grid(2, 8):
            with T.sblock("y"):
                vi = T.axis.spatial(8, i)
                y[vi] = x[vi] + T.float32(1)

    @T.prim_func(private=True, s_tir=True)
    def scale_reshaped(x: T.Buffer((4, 8), "float32"), y: T.Buffer((32,), "float32")):
        for i in range(32):
            with T.sblock("y"):
                vi = T.axis.spatial(32, i)
                y[vi] = x[vi // 8, vi % 8] * T.float32(2)

    @T.prim_func(private=True, s_tir=True)
    def transpose_reshaped(x: T.Buffer((4, 8), "float32"), y: T.Buffer((8, 4), "float32")):
        for i, j in T.grid(8, 4):
            with T.sblock("y"):
                vi, vj = T.axis.remap("SS", [i, j])
                y[vi, vj] = x[vj, vi]

    @T.prim_func(private=True, s_tir=True)
    def row_sum(x: T.Buffer((8, 8), "float32"), y: T.Buffer((8, 8), "float32")):
        for i, j, k in T.grid(8, 8, 8):
            with T.sblock("y"):
                vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                with T.init():
                    y[vi, vj] = T.float32(0)
                y[vi, vj] = y[vi, vj] + x[vi, vk]


@pytest.mark.parametrize("kernel, src, dst, safe", [
    ("scale_add", 0, 2, True),        # element-wise in x; bias is read at another index
    ("scale_add", 1, 2, False),       # bias has another shape
    ("fused_vectorized", 0, 1, True), # split, fused, parallel, vectorized: still one index each
    ("scale_reshaped", 0, 1, True),   # y is x reshaped: y[i] is x[i // 8, i % 8], the same element
    ("transpose_reshaped", 0, 1, False),  # same size, but y[i, j] is x[j, i], another element
    ("transpose", 0, 1, False),       # y[i, j] reads x[j, i], which a later index overwrote
    ("shift", 0, 1, False),           # y[i] reads x[i + 1]
    ("two_readers", 0, 1, False),     # the second block reads x after y has overwritten it
    ("repeated", 0, 1, False),        # every index runs twice: the second run reads y
    ("row_sum", 0, 1, False),         # a reduction
], ids=lambda v: str(v))
def test_inplace_safe(kernel: str, src: int, dst: int, safe: bool) -> None:
    """Only a block that reads the input and writes the result at the same element of their
    memory (the same index, or the same row-major offset of a reshape), once per index, may
    share memory between them."""
    assert inplace_safe(Kernels[kernel], src, dst) is safe


def test_packing_tries_several_orders_and_keeps_the_smallest_arena() -> None:
    """Four tensors (first use, last use, units of 64 bytes): at most 5 units live at once.
    Biggest first puts d and a (3 units each, never live together) at 0, b above a at 3, and c,
    live with both d and b, at 5: a 7-unit arena. In order of first use they fit in 5, which
    `pack` keeps."""
    from relay_passes import compress_memory

    unit = ALIGN
    specs = {"a": (3, 6, 3 * unit), "b": (2, 3, 2 * unit), "c": (0, 2, 2 * unit), "d": (1, 1, 3 * unit)}

    def plan_with(orders) -> int:
        tensors = [Tensor(relax.Var(name, relax.TensorType((1,), "float32")), start, end, nbytes, (0, "global"))
                   for name, (start, end, nbytes) in specs.items()]
        plan = FunctionPlan({t.var: t for t in tensors})
        saved = compress_memory._PACKING_ORDERS
        compress_memory._PACKING_ORDERS = orders
        try:
            pack(plan)
        finally:
            compress_memory._PACKING_ORDERS = saved
        assert check_plan(plan) == []
        return plan.arena_bytes[(0, "global")]

    assert plan_with(compress_memory._PACKING_ORDERS[:1]) == 7 * unit
    assert plan_with(compress_memory._PACKING_ORDERS) == 5 * unit


# ---- the planner's invariant ----

@pytest.mark.parametrize("seed", range(10))
def test_random_lifetimes_never_share_a_byte(seed: int) -> None:
    """Packing random lifetimes gives no overlap, an arena at least as big as the most bytes
    live at once, and at most the sum of all tensors."""
    rng = random.Random(seed)
    plan = FunctionPlan()
    for i in range(300):
        start = rng.randrange(1000)
        var = relax.Var(f"t{i}", relax.TensorType((1,), "float32"))
        plan.tensors[var] = Tensor(var, start, start + rng.randrange(100), rng.choice([4, 100, 4096, 65536, 1 << 20]),
                                   (0, "global"))
    pack(plan)
    assert check_plan(plan) == []
    live = max(sum(t.nbytes for t in plan.tensors.values() if t.start <= p <= t.end) for p in range(1100))
    (arena,) = plan.arena_bytes.values()
    assert live <= arena <= sum(t.nbytes for t in plan.tensors.values())
    assert all(t.offset % ALIGN == 0 for t in plan.tensors.values())


def test_a_training_step_plan_never_shares_a_byte() -> None:
    """The MLP training step at the point CompressMemory runs: every planned tensor's lifetime
    and bytes, checked pairwise. Greedy by size is no optimal packing: the arena is within 25%
    of the most bytes live at once (on the benchmark programs, within 1%)."""
    from tests.passes.test_numeric import training_step_module

    mod = training_step_module()
    plan = analyze(mod, mod["train_step"])
    pack(plan)
    assert len(plan.tensors) > 10 and plan.inplace >= 0
    assert check_plan(plan) == []
    ends = max(t.end for t in plan.tensors.values())
    live = max(sum(t.nbytes for t in plan.tensors.values() if t.start <= p <= t.end and t.group is None)
               for p in range(ends + 1))
    (arena,) = plan.arena_bytes.values()
    assert live <= arena <= 1.25 * live

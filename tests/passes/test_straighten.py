"""StraightenBindings reorders dataflow bindings to lower the peak of live tensors.

Structural tests use stub kernels (T.evaluate(0)): only the order of the bindings matters. The
scheduler is also tested by its invariants on random blocks: the order is topological, in-place
calls stay after the readers of what they overwrite, and the modelled peak never grows.
"""

from __future__ import annotations

import random

import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relay_passes.straighten import BlockModel, StraightenBindings, straighten


@I.ir_module
class LateReductions:
    """A backward pass as autodiff emits it: the reductions of g and h come last, so both stay
    live through the whole chain (peak: g, h and k, 12 KiB)."""

    @T.prim_func(private=True)
    def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def reduce(x: T.Buffer((1024,), "float32"), y: T.Buffer((), "float32")):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((1024,), "float32")):
        cls = LateReductions
        with R.dataflow():
            g = R.call_tir(cls.step, (x,), out_ty=R.Tensor((1024,), "float32"))
            h = R.call_tir(cls.step, (g,), out_ty=R.Tensor((1024,), "float32"))
            k = R.call_tir(cls.step, (h,), out_ty=R.Tensor((1024,), "float32"))
            s = R.call_tir(cls.reduce, (g,), out_ty=R.Tensor((), "float32"))
            t = R.call_tir(cls.reduce, (h,), out_ty=R.Tensor((), "float32"))
            out = (k, s, t)
            R.output(out)
        return out


def test_reduction_runs_as_soon_as_it_frees_its_input() -> None:
    """Once h has read g, the reduction of g is g's last reader and runs at once; the chain
    continues in program order (peak: two of g, h, k, 8 KiB)."""

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def reduce(x: T.Buffer((1024,), "float32"), y: T.Buffer((), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((1024,), "float32")):
            cls = Expected
            with R.dataflow():
                g = R.call_tir(cls.step, (x,), out_ty=R.Tensor((1024,), "float32"))
                h = R.call_tir(cls.step, (g,), out_ty=R.Tensor((1024,), "float32"))
                s = R.call_tir(cls.reduce, (g,), out_ty=R.Tensor((), "float32"))
                k = R.call_tir(cls.step, (h,), out_ty=R.Tensor((1024,), "float32"))
                t = R.call_tir(cls.reduce, (h,), out_ty=R.Tensor((), "float32"))
                out = (k, s, t)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(StraightenBindings()(LateReductions), Expected)


@I.ir_module
class TwoResultBackward:
    """A fused linear + GELU returns its pre-activation `pre` and output `act` (one kernel, two
    results); `y` is the next layer's forward. In autodiff's order the backward computes the
    upstream gradient `g` and the GELU gradient `k` (reads `pre`) before the weight gradient `w`
    that reads `act` for the last time: `act` stays live through both (peak 16 KiB)."""

    @T.prim_func(private=True)
    def pair(x: T.Buffer((1024,), "float32"), pre: T.Buffer((1024,), "float32"), act: T.Buffer((1024,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def step2(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32"), z: T.Buffer((1024,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def reduce(x: T.Buffer((1024,), "float32"), y: T.Buffer((), "float32")):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((1024,), "float32")):
        cls = TwoResultBackward
        with R.dataflow():
            both = R.call_tir(cls.pair, (x,), out_ty=[R.Tensor((1024,), "float32"), R.Tensor((1024,), "float32")])
            pre = both[0]
            act = both[1]
            y = R.call_tir(cls.step, (act,), out_ty=R.Tensor((1024,), "float32"))
            g = R.call_tir(cls.step, (y,), out_ty=R.Tensor((1024,), "float32"))
            k = R.call_tir(cls.step2, (pre, g), out_ty=R.Tensor((1024,), "float32"))
            w = R.call_tir(cls.reduce, (act,), out_ty=R.Tensor((), "float32"))
            out = (k, w)
            R.output(out)
        return out


def test_each_result_of_a_kernel_dies_at_its_own_last_reader() -> None:
    """`act` and `pre` are separate tensors: once `y` has read `act`, the weight gradient `w` is
    its last reader and frees it, so it runs first (peak 12 KiB). Counted as one tensor with
    `pre`, `w` would free nothing and the order would stay."""
    bindings = list(TwoResultBackward["main"].body.blocks[0].bindings)
    model = BlockModel(bindings)
    order = straighten(model)
    names = [bindings[i].var.name for i in order]
    assert names.index("w") < names.index("g")
    assert model.peak(list(range(len(bindings)))) == 4 * 4096
    assert model.peak(order) == 3 * 4096 + 4


@I.ir_module
class DynamicLateReductions:
    """LateReductions with a dynamic batch: every tensor is (n, 16)."""

    @T.prim_func(private=True)
    def step(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 16))
        y = T.match_buffer(var_y, (n, 16))
        T.evaluate(0)

    @T.prim_func(private=True)
    def reduce(var_x: T.handle, y: T.Buffer((), "float32")):
        n = T.int64()
        x = T.match_buffer(var_x, (n, 16))
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor(("n", 16), "float32")):
        n = T.int64()
        cls = DynamicLateReductions
        with R.dataflow():
            g = R.call_tir(cls.step, (x,), out_ty=R.Tensor((n, 16), "float32"))
            h = R.call_tir(cls.step, (g,), out_ty=R.Tensor((n, 16), "float32"))
            k = R.call_tir(cls.step, (h,), out_ty=R.Tensor((n, 16), "float32"))
            s = R.call_tir(cls.reduce, (g,), out_ty=R.Tensor((), "float32"))
            t = R.call_tir(cls.reduce, (h,), out_ty=R.Tensor((), "float32"))
            out = (k, s, t)
            R.output(out)
        return out


def test_a_dynamic_batch_is_straightened_as_at_64_rows() -> None:
    """Tensors of a symbolic batch count as 64 rows (they used to count as nothing, which left
    a dynamic-batch graph in autodiff's order): the reduction of g moves up, as in the static
    block, and the modelled peak falls from three tensors to two."""
    bindings = list(DynamicLateReductions["main"].body.blocks[0].bindings)
    model = BlockModel(bindings)
    order = straighten(model)
    assert [bindings[i].var.name for i in order] == ["g", "h", "s", "k", "t", "out"]
    assert model.peak(list(range(len(bindings)))) == 3 * 64 * 64 + 4
    assert model.peak(order) == 2 * 64 * 64 + 8


def test_in_place_update_stays_after_other_readers() -> None:
    """The update overwrites p and frees s, so greedily it would run right after s; it waits
    for r, which reads the old p."""

    @I.ir_module
    class Before:
        @T.prim_func(private=True)
        def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def reduce(x: T.Buffer((1024,), "float32"), y: T.Buffer((), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def update(p: T.Buffer((1024,), "float32"), s: T.Buffer((), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((1024,), "float32"), p: R.Tensor((1024,), "float32")):
            cls = Before
            with R.dataflow():
                g = R.call_tir(cls.step, (x,), out_ty=R.Tensor((1024,), "float32"))
                h = R.call_tir(cls.step, (g,), out_ty=R.Tensor((1024,), "float32"))
                r = R.call_tir(cls.reduce, (p,), out_ty=R.Tensor((), "float32"))
                k = R.call_tir(cls.step, (h,), out_ty=R.Tensor((1024,), "float32"))
                s = R.call_tir(cls.reduce, (g,), out_ty=R.Tensor((), "float32"))
                u = R.call_tir_inplace(cls.update, (p, s), 0, out_ty=R.Tensor((1024,), "float32"))
                out = (k, r, u)
                R.output(out)
            return out

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def reduce(x: T.Buffer((1024,), "float32"), y: T.Buffer((), "float32")):
            T.evaluate(0)

        @T.prim_func(private=True)
        def update(p: T.Buffer((1024,), "float32"), s: T.Buffer((), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((1024,), "float32"), p: R.Tensor((1024,), "float32")):
            cls = Expected
            with R.dataflow():
                g = R.call_tir(cls.step, (x,), out_ty=R.Tensor((1024,), "float32"))
                h = R.call_tir(cls.step, (g,), out_ty=R.Tensor((1024,), "float32"))
                s = R.call_tir(cls.reduce, (g,), out_ty=R.Tensor((), "float32"))
                k = R.call_tir(cls.step, (h,), out_ty=R.Tensor((1024,), "float32"))
                r = R.call_tir(cls.reduce, (p,), out_ty=R.Tensor((), "float32"))
                u = R.call_tir_inplace(cls.update, (p, s), 0, out_ty=R.Tensor((1024,), "float32"))
                out = (k, r, u)
                R.output(out)
            return out

    tvm.ir.assert_structural_equal(StraightenBindings()(Before), Expected)


def test_order_that_does_not_lower_the_peak_is_kept() -> None:
    """A chain has one valid order; the module comes back unchanged."""

    @I.ir_module
    class Chain:
        @T.prim_func(private=True)
        def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((1024,), "float32")):
            cls = Chain
            with R.dataflow():
                a = R.call_tir(cls.step, (x,), out_ty=R.Tensor((1024,), "float32"))
                b = R.call_tir(cls.step, (a,), out_ty=R.Tensor((1024,), "float32"))
                R.output(b)
            return b

    tvm.ir.assert_structural_equal(StraightenBindings()(Chain), Chain)


def test_kill_switch_and_report() -> None:
    """Disabled, the pass returns its input; enabled, it reports the peak before and after."""
    assert StraightenBindings(enabled=False)(LateReductions).same_as(LateReductions)
    messages: list[str] = []
    StraightenBindings(report=messages.append)(LateReductions)
    assert messages == ["StraightenBindings: peak live memory main 12.0 KiB -> 8.0 KiB"]


def test_peak_of_the_example_goes_from_three_tensors_to_two() -> None:
    """The modelled peak: g, h, k and s in program order; h, k, s and t straightened."""
    bindings = list(LateReductions["main"].body.blocks[0].bindings)
    model = BlockModel(bindings)
    assert model.peak(list(range(len(bindings)))) == 3 * 4096 + 4
    assert model.peak(straighten(model)) == 2 * 4096 + 8


@I.ir_module
class StubKernels:
    @T.prim_func(private=True)
    def k1(a: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def k2(a: T.handle, b: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def k3(a: T.handle, b: T.handle, c: T.handle):
        T.evaluate(0)

    @T.prim_func(private=True)
    def k4(a: T.handle, b: T.handle, c: T.handle, d: T.handle):
        T.evaluate(0)


def _random_module(rng: random.Random, n: int) -> tvm.IRModule:
    """n call_tir bindings of random sizes, each reading up to three of the parameters and the
    six values before it, and an in-place call overwriting parameter p0 in the middle; the last
    three are the results."""
    bb = relax.BlockBuilder(StubKernels)
    params = [relax.Var(f"p{i}", relax.TensorType((16,), "float32")) for i in range(2)]
    with bb.function("main", params):
        with bb.dataflow():
            values: list[relax.Expr] = list(params)
            for i in range(n):
                recent = list(params) + values[len(params):][-6:]
                args = rng.sample(recent, k=min(len(recent), rng.randint(1, 3)))
                if i == n // 2:
                    args = [params[0], *(a for a in args if not a.same_as(params[0]))]
                    kernel = StubKernels.get_global_var(f"k{len(args)}")
                    call = relax.call_tir_inplace(kernel, args, [0], relax.TensorType((16,), "float32"))
                else:
                    size = rng.choice([1, 16, 256, 4096])
                    kernel = StubKernels.get_global_var(f"k{len(args) + 1}")
                    call = relax.call_tir(kernel, args, relax.TensorType((size,), "float32"))
                values.append(bb.emit(call))
            out = bb.emit_output(relax.Tuple(values[-3:]))
        bb.emit_func_output(out)
    return bb.get()


def _readers_of_p0_before_update(func: relax.Function) -> set[str]:
    """Names of the bindings that read p0 before the in-place call overwrites it."""
    p0 = func.params[0]
    names = set()
    for binding in func.body.blocks[0].bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir_inplace")):
            return names
        if any(v.same_as(p0) for v in relax.analysis.free_vars(value)):
            names.add(binding.var.name)
    raise AssertionError("no in-place call")


@pytest.mark.parametrize("seed", range(20))
def test_random_blocks_keep_in_place_order_and_never_grow_the_peak(seed: int) -> None:
    """On random blocks (well-formed, so every value is defined before use: the fixture checks)
    the same bindings read p0 before the in-place call, and the modelled peak is at most the
    original's."""
    before = _random_module(random.Random(seed), 40)
    after = StraightenBindings()(before)
    old, new = before["main"], after["main"]
    peak = lambda f: BlockModel(list(f.body.blocks[0].bindings)).peak(  # noqa: E731
        list(range(len(f.body.blocks[0].bindings))))
    assert peak(new) <= peak(old)
    assert _readers_of_p0_before_update(new) == _readers_of_p0_before_update(old)


def test_an_in_place_update_waits_for_the_readers_of_a_reshape_of_what_it_overwrites() -> None:
    """A reshape kernel becomes a view of its input after this pass (RewriteDataflowReshape), so
    a reader of `reshape(p)` reads p: the update of p must run after it. Modelled as a copy,
    the reader could move after the update and read the new p (a wrong gradient in a training
    graph whose build() unsqueezes a parameter: OpInfo's unbatched conv_transpose1d)."""
    from tvm import te, topi

    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((1024,), "float32"))
    p = relax.Var("p", R.Tensor((1024,), "float32"))
    with bb.function("main", [x, p]):
        with bb.dataflow():
            view = bb.emit_te(topi.reshape, p, (32, 32), primfunc_name_hint="reshape")
            g = bb.emit_te(lambda a: te.compute((1024,), lambda i: a[i] * 2.0), x, primfunc_name_hint="step")
            s = bb.emit_te(topi.sum, g, primfunc_name_hint="reduce")
            r = bb.emit_te(topi.sum, view, primfunc_name_hint="reduce_view")
            update = bb.add_func(te.create_prim_func([te.placeholder((1024,)), te.placeholder(())]), "update")
            u = bb.emit(relax.call_tir_inplace(update, (p, s), [0], R.Tensor((1024,), "float32")))
            out = bb.emit_output(relax.Tuple([r, u, view]))  # view outlives r: r frees nothing
        bb.emit_func_output(out)
    mod = bb.get()
    assert relax.analysis.has_reshape_pattern(mod["reshape"])

    def order(m: tvm.IRModule) -> list[str]:
        return [b.var.name for b in m["main"].body.blocks[0].bindings]

    straightened = order(StraightenBindings()(mod))
    assert straightened.index(r.name) < straightened.index(u.name)
    # Without the view, the update (which frees s) runs right after s, before r.
    model = BlockModel(list(mod["main"].body.blocks[0].bindings))
    names = order(mod)
    as_copies = [names[i] for i in straighten(model)]
    assert as_copies.index(u.name) < as_copies.index(r.name)


@I.ir_module
class LateReductionOfAnOutput:
    """LateReductions with `g` also a block output that nothing after the block reads."""

    @T.prim_func(private=True)
    def step(x: T.Buffer((1024,), "float32"), y: T.Buffer((1024,), "float32")):
        T.evaluate(0)

    @T.prim_func(private=True)
    def reduce(x: T.Buffer((1024,), "float32"), y: T.Buffer((), "float32")):
        T.evaluate(0)

    @R.function
    def main(x: R.Tensor((1024,), "float32")):
        cls = LateReductionOfAnOutput
        with R.dataflow():
            g = R.call_tir(cls.step, (x,), out_ty=R.Tensor((1024,), "float32"))
            h = R.call_tir(cls.step, (g,), out_ty=R.Tensor((1024,), "float32"))
            k = R.call_tir(cls.step, (h,), out_ty=R.Tensor((1024,), "float32"))
            s = R.call_tir(cls.reduce, (g,), out_ty=R.Tensor((), "float32"))
            t = R.call_tir(cls.reduce, (h,), out_ty=R.Tensor((), "float32"))
            out = (k, s, t)
            R.output(g, out)
        return out


def test_a_block_output_that_nothing_after_the_block_reads_dies_in_it() -> None:
    """`g` leaves the block (a non-dataflow var, as a value read across a cut of
    SeparateBackward or RecomputeLateReads is until FuseTIR merges the blocks), but nothing
    after the block reads it: it dies at its last reader like a dataflow var, so the reduction
    of g runs as soon as h has read g. Before, every block output was kept to the end of the
    block, and the order stayed."""
    after = StraightenBindings()(LateReductionOfAnOutput)
    (block,) = after["main"].body.blocks
    assert [b.var.name for b in block.bindings] == ["g", "h", "s", "k", "t", "out"]

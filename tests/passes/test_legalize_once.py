"""LegalizeOnce legalizes each distinct operator call once: the module it makes is the one
TVM's LegalizeOps makes (before/after IR), and its report counts what it reused."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.legalize_once import LegalizeOnce


def legalize_once(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[str]]:
    said: list[str] = []
    return LegalizeOnce(said.append)(mod), said


@I.ir_module
class Repeats:
    """Calls that repeat (the adds of like tensors, the reshapes to one shape), calls that do not
    (another shape, another attribute), and calls LegalizeOnce must not reuse: a concat (its
    legalization looks up the tuple's binding), an add of a tensor to itself, a constant."""

    @R.function
    def main(a: R.Tensor((4, 8), "float32"), b: R.Tensor((4, 8), "float32"), c: R.Tensor((8, 4), "float32")):
        with R.dataflow():
            x = R.add(a, b)
            y = R.add(b, x)  # the same add on other variables: reused
            z = R.add(c, c)  # the same variable twice: not reused
            w = R.add(c, R.permute_dims(x))  # another shape: legalized
            r1 = R.reshape(x, (8, 4))
            r2 = R.reshape(y, (8, 4))  # reused
            r3 = R.reshape(y, (2, 16))  # another target shape: legalized
            s1 = R.sum(x, axis=[1])
            s2 = R.sum(y, axis=[0])  # another attribute: legalized
            k = R.add(x, R.const(1.0, "float32"))  # a constant: not reused
            t = (r1, r2)
            cat = R.concat(t, axis=0)  # a tuple: not reused
            cat2 = R.concat((r2, r1), axis=0)
            out = (z, w, r3, s1, s2, k, cat, cat2)
            R.output(out)
        return out


def test_the_module_is_the_one_legalize_ops_makes() -> None:
    mine, _ = legalize_once(Repeats)
    tvm.ir.assert_structural_equal(mine, relax.transform.LegalizeOps()(Repeats))


def test_an_equal_call_on_other_variables_reuses_the_first_ones_prim_func() -> None:
    mine, said = legalize_once(Repeats)
    main = mine["main"]
    calls = {b.var.name: b.value for block in main.body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_tir"}
    assert calls["x"].args[0].same_as(calls["y"].args[0])
    assert [v.name for v in calls["y"].args[1].fields] == ["b", "x"]
    assert calls["r1"].args[0].same_as(calls["r2"].args[0])
    assert not calls["r2"].args[0].same_as(calls["r3"].args[0])
    # 13 operator calls: y reuses x's legalization and r2 r1's; the permute_dims and the
    # constant, tuple and self-add calls are legalized as they come.
    assert said == ["LegalizeOnce: operator call legalized x11, reused x2"]


def test_nothing_to_reuse_says_nothing() -> None:
    @I.ir_module
    class Single:
        @R.function
        def main(a: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                y = R.nn.relu(a)
                R.output(y)
            return y

    mine, said = legalize_once(Single)
    tvm.ir.assert_structural_equal(mine, relax.transform.LegalizeOps()(Single))
    assert said == []

"""FuseCastScale groups `astype(x) * scale` (scalar scale, either side) into one kernel."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.fuse_cast_scale import FuseCastScale


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((4, 8), "float16"), s: R.Tensor((), "float32")):
        with R.dataflow():
            a = R.astype(x, "float32")
            b = R.multiply(a, s)
            c = R.multiply(R.const(2.0, "float32"), R.astype(x, "float32"))
            d = R.multiply(R.astype(x, "float32"), R.astype(x, "float32"))
            R.output(b, c, d)
        return (b, c, d)


def test_cast_times_scalar_becomes_one_group() -> None:
    """b (0-d tensor scale) and c (constant scale, on the left) are grouped; d multiplies two
    casts, not a cast and a scalar, and stays as it is."""

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def fused_relax_astype_relax_multiply(x: R.Tensor((4, 8), "float16"), s: R.Tensor((), "float32")
                                              ) -> R.Tensor((4, 8), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_cast_scale", "Primitive": True})
            with R.dataflow():
                a = R.astype(x, "float32")
                gv = R.multiply(a, s)
                R.output(gv)
            return gv

        @R.function(private=True)
        def fused_relax_astype_relax_multiply1(x: R.Tensor((4, 8), "float16"), param_0: R.Tensor((), "float32")
                                               ) -> R.Tensor((4, 8), "float32"):
            R.func_attr({"Composite": "tvmgraph.fuse_cast_scale", "Primitive": True})
            with R.dataflow():
                lv2 = R.astype(x, "float32")
                gv = R.multiply(param_0, lv2)
                R.output(gv)
            return gv

        @R.function
        def main(x: R.Tensor((4, 8), "float16"), s: R.Tensor((), "float32")):
            cls = Expected
            with R.dataflow():
                gv = cls.fused_relax_astype_relax_multiply(x, s)
                gv1 = cls.fused_relax_astype_relax_multiply1(x, R.const(2.0, "float32"))
                lv4 = R.astype(x, "float32")
                lv5 = R.astype(x, "float32")
                d = R.multiply(lv4, lv5)
                R.output(gv, gv1, d)
            return (gv, gv1, d)

    messages: list[str] = []
    tvm.ir.assert_structural_equal(FuseCastScale(report=messages.append)(Before), Expected)
    assert messages == ["FuseCastScale: 2 cast + scale kernel(s)"]


def test_cast_with_other_users_is_left_alone() -> None:
    """a is read by the multiply and by an add. Grouped, the product would be computed where `a`
    is first read and kept from there: in a training step, a backward term (a batch norm's
    variance gradient, `astype(x) * 2/N`) computed in the forward pass and kept to the backward."""

    @I.ir_module
    class Shared:
        @R.function
        def main(x: R.Tensor((4, 8), "float16"), s: R.Tensor((), "float32")):
            with R.dataflow():
                a = R.astype(x, "float32")
                c = R.add(a, a)
                b = R.multiply(a, s)
                R.output(b, c)
            return (b, c)

    messages: list[str] = []
    tvm.ir.assert_structural_equal(FuseCastScale(report=messages.append)(Shared), Shared)
    assert messages == []


def test_scale_that_broadcasts_or_is_a_tensor_is_left_alone() -> None:
    """A (1, 8) scale is not a scalar; a (1,) scale that broadcasts a 0-d cast to (1,) changes
    the shape: neither is grouped."""

    @I.ir_module
    class NotScalar:
        @R.function
        def main(x: R.Tensor((4, 8), "float16"), s: R.Tensor((1, 8), "float32"), y: R.Tensor((), "float16"),
                 t: R.Tensor((1,), "float32")):
            with R.dataflow():
                a = R.multiply(R.astype(x, "float32"), s)
                b = R.multiply(R.astype(y, "float32"), t)
                R.output(a, b)
            return (a, b)

    tvm.ir.assert_structural_equal(FuseCastScale()(NotScalar), NotScalar)


def test_kill_switch() -> None:
    """Disabled, the pass returns its input."""
    assert FuseCastScale(enabled=False)(Before).same_as(Before)


def test_scale_computed_from_the_cast_is_not_grouped() -> None:
    """relax's max gradient: `m = astype(mask); m * (g / sum(m))`. Grouping the cast with the
    multiply would make the group read its own output (`DataflowVar lv4 is not defined`)."""

    @I.ir_module
    class SelfScaled:
        @R.function
        def main(mask: R.Tensor((1, 3), "bool"), g: R.Tensor((1, 1), "float32")):
            with R.dataflow():
                m = R.astype(mask, "float32")
                total = R.sum(m, axis=[1], keepdims=True)
                scale = R.divide(g, total)
                out = R.multiply(m, scale)
                R.output(out)
            return out

    after = FuseCastScale()(SelfScaled)
    tvm.ir.assert_structural_equal(after, SelfScaled)

"""UnitSumsAsReshapes: a sum over axes of extent 1 only is a reshape (an RNN step's
`collapse_sum_to` of a broadcast that only added a unit axis)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.unit_sums import UnitSumsAsReshapes


@I.ir_module
class Sums:
    @R.function
    def main(dy: R.Tensor((1, 16, 8), "float32"), z: R.Tensor((4, 1, 8), "float32"),
             like: R.Tensor((16, 8), "float32")):
        with R.dataflow():
            a = R.collapse_sum_to(dy, R.shape([16, 8]))
            b = R.sum(z, axis=[1], keepdims=True)
            c = R.sum(z, axis=[-2])
            d = R.collapse_sum_like(dy, like)
            R.output(a, b, c, d)
        return (a, b, c, d)


def test_sums_over_unit_axes_are_reshapes() -> None:
    @I.ir_module
    class Expected:
        @R.function
        def main(dy: R.Tensor((1, 16, 8), "float32"), z: R.Tensor((4, 1, 8), "float32"),
                 like: R.Tensor((16, 8), "float32")):
            with R.dataflow():
                a = R.reshape(dy, R.shape([16, 8]))
                b = R.reshape(z, R.shape([4, 1, 8]))
                c = R.reshape(z, R.shape([4, 8]))
                d = R.reshape(dy, R.shape([16, 8]))
                R.output(a, b, c, d)
            return (a, b, c, d)

    tvm.ir.assert_structural_equal(UnitSumsAsReshapes()(Sums), Expected)


def test_a_sum_over_a_longer_axis_stays() -> None:
    """collapse_sum_to (2, 16, 8) -> (16, 8) adds two rows; (4, 8) -> (1, 8) sums four."""

    @I.ir_module
    class Real:
        @R.function
        def main(dy: R.Tensor((2, 16, 8), "float32"), x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                a = R.collapse_sum_to(dy, R.shape([16, 8]))
                b = R.collapse_sum_to(x, R.shape([1, 8]))
                c = R.sum(x, axis=[0, 1])
                R.output(a, b, c)
            return (a, b, c)

    tvm.ir.assert_structural_equal(UnitSumsAsReshapes()(Real), Real)


def test_reports_what_it_rewrote() -> None:
    messages: list[str] = []
    UnitSumsAsReshapes(messages.append)(Sums)
    assert messages == ["UnitSumsAsReshapes: collapse_sum_like over unit axes x1, "
                        "collapse_sum_to over unit axes x1, sum over unit axes x2"]


def test_results_equal_the_sums() -> None:
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(s).astype("float32") for s in ((1, 16, 8), (4, 1, 8), (16, 8))]
    results = []
    for mod in (Sums, UnitSumsAsReshapes()(Sums)):
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        results.append([t.numpy() for t in vm["main"](*(tvm.runtime.tensor(x) for x in inputs))])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)

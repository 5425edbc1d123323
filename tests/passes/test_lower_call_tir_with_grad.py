"""LowerCallTIRWithGrad turns call_tir_with_grad into call_tir, leaving all else alone."""

from __future__ import annotations

import tvm
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relay_passes.lower_call_tir_with_grad import LowerCallTIRWithGrad


def test_call_tir_with_grad_becomes_call_tir() -> None:
    @I.ir_module
    class Before:
        @T.prim_func(private=True)
        def double(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            cls = Before
            with R.dataflow():
                y = R.call_tir_with_grad(cls.double, (x,), out_ty=R.Tensor((4,), "float32"),
                                         te_grad_name="some_grad", te_grad_kwargs={"k": 1})
                z = R.add(y, x)
                R.output(z)
            return z

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def double(x: T.Buffer((4,), "float32"), y: T.Buffer((4,), "float32")):
            T.evaluate(0)

        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            cls = Expected
            with R.dataflow():
                y = R.call_tir(cls.double, (x,), out_ty=R.Tensor((4,), "float32"))
                z = R.add(y, x)
                R.output(z)
            return z

    tvm.ir.assert_structural_equal(LowerCallTIRWithGrad()(Before), Expected)


def test_module_without_it_is_unchanged() -> None:
    @I.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((4,), "float32")) -> R.Tensor((4,), "float32"):
            with R.dataflow():
                z = R.add(x, x)
                R.output(z)
            return z

    tvm.ir.assert_structural_equal(LowerCallTIRWithGrad()(Plain), Plain)

"""MinusInfinityPool (tvmgraph/schedules/minus_infinity_pool.py): after the schedules, a max
pooling's init and padding are -inf instead of the lowest finite float; other kernels keep
their constants."""

from __future__ import annotations

import pytest
import tvm
from tvm import relax
from tvm.script import relax as R

from tvmgraph import max_pool_forward  # noqa: F401  (registers the whole-plane legalization)
from tvmgraph.schedules import ApplyCPUSchedules
from tvmgraph.schedules.minus_infinity_pool import MinusInfinityPool

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()})
LOWEST = "-340282346638528859811704183484516925440.0"


def scheduled(emit) -> tvm.IRModule:  # noqa: ANN001  (x -> Relax call)
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((2, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(emit(x)))
        bb.emit_func_output(out)
    with TARGET:
        return ApplyCPUSchedules()(relax.transform.LegalizeOps()(bb.get()))


@pytest.mark.parametrize("emit", [
    lambda x: relax.op.nn.max_pool2d(x, (3, 3), (1, 1), (1, 1, 1, 1)),  # padded: a pad_temp buffer
    lambda x: relax.op.nn.max_pool2d(x, (2, 2), (2, 2)),
    lambda x: relax.op.nn.max_pool2d(x, (8, 8), (8, 8)),  # whole plane: rfactor'd reduction
], ids=["padded", "windows", "whole_plane"])
def test_a_poolings_lowest_constants_become_minus_infinity(emit) -> None:  # noqa: ANN001
    before = scheduled(emit)
    assert LOWEST in before.script()
    after = MinusInfinityPool()(before)
    text = after.script()
    assert LOWEST not in text and 'T.float32("-inf")' in text, text


def test_a_clamp_to_the_lowest_float_is_left_alone() -> None:
    before = scheduled(lambda x: relax.op.maximum(x, relax.const(float(LOWEST), "float32")))
    assert LOWEST in before.script()
    tvm.ir.assert_structural_equal(MinusInfinityPool()(before), before)

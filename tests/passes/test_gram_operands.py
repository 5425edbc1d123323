"""GramOperandsApart: `x @ x.T` reads its second operand from a kernel of its own, so that the
matmul rules (which need two buffers) schedule it."""

from __future__ import annotations

import logging

import pytest
import torch
import tvm
from tvm import relax

from relay_passes.gram_operands import OPAQUE, GramOperandsApart
from tests.conftest import Fn, ModuleGraph


def _gram_module() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((3, 24, 40), "float32"))
    y = relax.Var("y", relax.TensorType((3, 40, 24), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            gram = bb.emit(relax.op.matmul(x, relax.op.permute_dims(x, [0, 2, 1])))
            other = bb.emit(relax.op.matmul(x, y))  # two tensors: kept
            out = bb.emit_output(relax.Tuple([gram, other]))
        bb.emit_func_output(out)
    return bb.get()


def _matmuls(func: relax.Function) -> list[relax.Call]:
    return [b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == "relax.matmul"]


def test_the_second_operand_of_a_gram_matrix_is_an_opaque_transpose() -> None:
    """Before: matmul(x, permute_dims(x)). After: matmul(x, t) with t an opaque kernel's
    transpose of x (FuseOps cannot merge it back); matmul(x, y) is untouched."""
    before = _gram_module()
    after = GramOperandsApart()(before)
    bindings = {b.var: b.value for block in after["main"].body.blocks for b in block.bindings}
    gram, other = _matmuls(after["main"])
    assert gram.args[0].same_as(after["main"].params[0])
    copy = bindings[gram.args[1]]
    assert copy.op.name == "relax.call_tir" and copy.args[1][0].same_as(after["main"].params[0])
    kernel = after[copy.args[0]]
    assert int(kernel.attrs["op_pattern"]) == OPAQUE
    assert other.args[1].same_as(after["main"].params[1])


@pytest.mark.parametrize("name, fn", [
    ("x @ x.mT", lambda x: x @ x.mT),
    ("x.mT @ x", lambda x: x.mT @ x),
    ("a @ a.mT + I", lambda x: x @ x.mT + torch.eye(x.shape[-2])),
    ("cdist(x, x)", lambda x: torch.cdist(x, x)),
])
def test_gram_matrices_match_eager_and_get_the_matmul_schedule(name: str, fn, caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(4, 48, 64)
    with caplog.at_level(logging.DEBUG, logger="tvmgraph"):
        got = ModuleGraph(Fn(fn))(x)
    # cdist's diagonal is sqrt(|x|^2 + |x|^2 - 2 x.x): float32 cancellation, eager's as large
    torch.testing.assert_close(got, fn(x), atol=1e-2 if name.startswith("cdist") else 1e-4, rtol=1e-4)
    assert "Matmul scheduled" in caplog.text

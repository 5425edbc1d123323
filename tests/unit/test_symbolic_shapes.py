"""training/symbolic_shapes.py: a symbolic batch past TVM 0.27's autodiff, before/after IR."""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from tvmgraph.training.symbolic_shapes import lift_shapes


def _class_token_module(image_rank: int) -> tuple[tvm.IRModule, tirx.Var]:
    """A ViT's start: a class token broadcast over the batch n of `x`, concatenated with it."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n, *([4, 16] if image_rank == 3 else [2, 4, 16])], "float32"))
    cls = relax.Var("cls", relax.TensorType([1, 1, 16], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, cls]):
        with bb.dataflow():
            tokens = x if image_rank == 3 else bb.emit(relax.op.reshape(x, [n, 8, 16]))
            expanded = bb.emit(relax.op.broadcast_to(cls, relax.ShapeExpr([n, 1, 16])))
            out = bb.emit_output(bb.emit(relax.op.concat([expanded, tokens], axis=1)))
        bb.emit_func_output(out)
    return bb.get(), n


def _ops(func: relax.Function) -> list[str]:
    return [b.value.op.name for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def test_a_broadcast_over_the_batch_becomes_a_product_with_ones_of_the_batch() -> None:
    """Before: broadcast_to(cls, R.shape([n, 1, 16])), whose shape argument autodiff's copy could
    only take as a parameter (and then had no shape: the concat's gradient failed). After:
    cls * ones, the ones sliced from x, so every type keeps n and nothing is lifted."""
    mod, n = _class_token_module(image_rank=3)
    lifted, names = lift_shapes(mod)
    assert names == []
    assert _ops(lifted["main"]) == ["relax.strided_slice", "relax.ones_like", "relax.multiply", "relax.concat"]
    product = next(b.var for b in lifted["main"].body.blocks[0].bindings
                   if isinstance(b.value, relax.Call) and b.value.op.name == "relax.multiply")
    batch, *rest = product.ty.shape.values
    assert batch.same_as(n) and [int(d) for d in rest] == [1, 16]


def test_the_ones_take_the_rank_of_the_broadcast() -> None:
    """From a rank-4 input the ones are squeezed to rank 3; the reshape's symbolic shape is
    still lifted into a parameter (the first of the three limits the module works around)."""
    mod, _ = _class_token_module(image_rank=4)
    lifted, names = lift_shapes(mod)
    assert names == ["tvmgraph_shape_0"]
    assert _ops(lifted["main"]) == ["relax.reshape", "relax.strided_slice", "relax.ones_like", "relax.squeeze",
                                    "relax.multiply", "relax.concat"]

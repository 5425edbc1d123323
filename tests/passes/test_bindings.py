"""relay_passes/bindings.py: what a binding reads, walked in Python for the common shapes; unread
bindings dropped with the forward/backward boundary kept."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.bindings import _visited_vars, drop_unread, vars_in


def test_vars_in_reads_as_the_visitor_does() -> None:
    """Same variables, same order, same repeats as TVM's post-order visitor, for calls, tuples,
    tuple items, constants, shapes, numbers, a closure call and an `If` (visited)."""
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    y = relax.Var("y", relax.TensorType((2, 3), "float32"))
    t = relax.Var("t", relax.TupleType([relax.TensorType((2, 3), "float32")] * 2))
    f = relax.Var("f", relax.FuncType([relax.TensorType((2, 3), "float32")], relax.TensorType((2, 3), "float32")))
    c = relax.Var("c", relax.TensorType((), "bool"))
    const = relax.const(np.ones((2, 3), "float32"))
    values = [
        x,
        relax.op.add(x, relax.op.multiply(y, x)),
        relax.op.concat(relax.Tuple([x, y, x]), axis=0),
        relax.TupleGetItem(t, 1),
        relax.op.add(relax.TupleGetItem(t, 0), const),
        relax.op.reshape(x, relax.ShapeExpr([3, 2])),
        relax.op.full((2, 3), relax.prim_value(tvm.tirx.FloatImm("float32", 1.0)), "float32"),
        relax.Call(f, [y]),
        relax.If(c, relax.SeqExpr([], x), relax.SeqExpr([], y)),
    ]
    for value in values:
        got, want = vars_in(value), _visited_vars(value)
        assert len(got) == len(want) and all(a.same_as(b) for a, b in zip(got, want)), value
    assert [v.name for v in vars_in(values[1])] == ["x", "y", "x"]


def test_drop_unread_keeps_the_boundary_between_the_blocks() -> None:
    """An unread chain goes (`b` only feeds the unread `c`); the boundary block, which nothing
    reads either, stays, and with it the two dataflow blocks (relax.analysis.remove_all_unused
    dropped it: the blocks merged)."""

    @I.ir_module
    class Cut:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            with R.dataflow():
                a = R.add(x, x)
                b = R.multiply(x, x)
                c = R.exp(b)
                R.output(a)
            block_boundary = R.tuple()
            with R.dataflow():
                d = R.multiply(a, a)
                e = R.negative(a)
                R.output(d)
            return d

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4,), "float32")):
            with R.dataflow():
                a = R.add(x, x)
                R.output(a)
            block_boundary = R.tuple()
            with R.dataflow():
                d = R.multiply(a, a)
                R.output(d)
            return d

    tvm.ir.assert_structural_equal(drop_unread(Cut["main"]), Expected["main"])
    assert [type(b).__name__ for b in drop_unread(Cut["main"]).body.blocks] == \
        ["DataflowBlock", "BindingBlock", "DataflowBlock"]
    assert drop_unread(Expected["main"]).same_as(Expected["main"])  # nothing unread: unchanged

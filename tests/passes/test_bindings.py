"""relay_passes/bindings.py: what a binding reads, walked in Python for the common shapes."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from relay_passes.bindings import _visited_vars, vars_in


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

"""SplitAsSlices: a `split` whose pieces are read only element-wise becomes one strided slice
per piece.

    s = R.split(gates, 4, axis=1)                     i = R.strided_slice(gates, [1], [0], [128])
    i = s[0]                                    ->    f = R.strided_slice(gates, [1], [128], [256])
    f = s[1]                                          a = R.sigmoid(i)
    a = R.sigmoid(i)                                  b = R.sigmoid(f)
    b = R.sigmoid(f)

A split returns a tuple, and FuseOps fuses no kernel into the readers of a tuple's fields: the
split stays a kernel of its own that copies every piece out, and each reader reads its piece
back. A slice is an injective op that FuseOps fuses into its reader, which then reads its piece
in place. An LSTM's cell splits its gate pre-activations in four (`chunk(4)`, sigmoid and
tanh of each), a GRU's in three: one kernel less per time step, and at inference the whole
cell update becomes one kernel reading the gates.

Only splits whose every piece is read by element-wise ops only (RECOGNISED_READERS) and bound
to a dataflow variable (not a block output) are rewritten: a piece read by a matmul or a
reshape (an attention's q/k/v split) would become a copy of its own, one kernel per piece
where the split was one.

Position: before LegalizeOps (it rewrites Relax ops).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm.relax.op.binary
import tvm.relax.op.unary
from tvm import relax

from relay_passes import report_counts

from tvmgraph.legalize_fixes import split_bounds

from .bindings import rewrite_dataflow_blocks, vars_in

_SPLIT = tvm.ir.Op.get("relax.split")


def _op_names(module: object) -> set[str]:
    """`relax.<f>` for each function `f` a tvm.relax.op module defines (one per op)."""
    return {f"relax.{name}" for name, value in vars(module).items()
            if callable(value) and getattr(value, "__module__", None) == module.__name__}


# Relax ops that legalize to element-wise kernels FuseOps fuses an injective producer into.
RECOGNISED_READERS = frozenset(
    _op_names(tvm.relax.op.unary) | _op_names(tvm.relax.op.binary)
    | {"relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.astype",
       "relax.where"})


def rewrite(block: relax.DataflowBlock) -> tuple[relax.DataflowBlock, int]:
    """`block` with its element-wise-read splits as slices, and how many splits it rewrote."""
    readers: dict[relax.Var, list[relax.Binding]] = {}
    for b in block.bindings:
        for v in set(vars_in(b.value)):
            readers.setdefault(v, []).append(b)

    def piece_read_element_wise(b: relax.Binding, split_var: relax.Var) -> bool:
        value = b.value
        if not (isinstance(value, relax.TupleGetItem) and value.tuple_value.same_as(split_var)
                and isinstance(b.var, relax.DataflowVar)):
            return False
        return all(isinstance(r.value, relax.Call) and isinstance(r.value.op, tvm.ir.Op)
                   and r.value.op.name in RECOGNISED_READERS for r in readers.get(b.var, []))

    slices: dict[relax.Var, relax.Expr] = {}  # piece variable -> its slice
    dropped: set[relax.Var] = set()
    for b in block.bindings:
        value = b.value
        if not (isinstance(value, relax.Call) and value.op.same_as(_SPLIT) and isinstance(b.var, relax.DataflowVar)):
            continue
        pieces = readers.get(b.var, [])
        bounds = split_bounds(value)
        if bounds is None or not pieces or not all(piece_read_element_wise(p, b.var) for p in pieces):
            continue
        axis = int(value.attrs.axis) % len(value.args[0].ty.shape)
        for p in pieces:
            begin, end = bounds[p.value.index]
            slices[p.var] = relax.op.strided_slice(value.args[0], axes=[axis], begin=[begin], end=[end],
                                                   assume_inbound=True)
        dropped.add(b.var)
    if not dropped:
        return block, 0
    bindings = [relax.VarBinding(b.var, slices[b.var]) if b.var in slices else b
                for b in block.bindings if b.var not in dropped]
    return relax.DataflowBlock(bindings), len(dropped)


@tvm.transform.module_pass(opt_level=0, name="SplitAsSlices")
class SplitAsSlices:
    """Rewrite each split whose pieces are read element-wise as one strided slice per piece."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        counts = []

        def each(block: relax.DataflowBlock) -> list[relax.DataflowBlock]:
            block, n = rewrite(block)
            counts.append(n)
            return [block]

        mod, _ = rewrite_dataflow_blocks(mod, each)
        report_counts(self.report, "SplitAsSlices", {"split as slices": sum(counts)} if sum(counts) else {})
        return mod

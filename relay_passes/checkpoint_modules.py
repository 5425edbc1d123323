"""CheckpointModules: the backward pass recomputes what checkpointed modules computed instead of keeping it.

    # one call of `model.layer1` (bindings y, z)     # after
    y = R.matmul(x, w)                               xs = R.grad.start_checkpoint(x)
    z = R.nn.relu(y)                        ->       ws = R.grad.start_checkpoint(w)
    (uses of z)                                      y = R.matmul(xs, ws)
                                                     z = R.nn.relu(y)
                                                     ze = R.grad.end_checkpoint(z)
                                                     (uses of ze)

Position: on the forward function, before RecomputeAttention and `relax.transform.Gradient`
(tvmgraph/training/train_step.py). `Gradient` keeps for the backward pass only what is not
computed from a `start_checkpoint` without an `end_checkpoint` in between, and recomputes the
rest there (Relax's activation checkpointing); so each call of a checkpointed module keeps its
inputs, and its intermediate results are computed twice (forward, then again in backward).

Why: OneFlow's `graph.<module>.to(nn.graph.GraphModule).activation_checkpointing = True`. A
module's activations (a transformer layer's attention and feed-forward intermediates) are most
of a training step's live memory; checkpointing each layer keeps one tensor per layer instead.

Input: `regions`, one per module call, each the names of the bindings that call computed
(tvmgraph/training/checkpoint_regions.py finds them from torch.export's module stack). Every
tensor the region reads from outside it (activations, parameters) goes through a
`start_checkpoint` of the region, made just before the first binding that reads it; every
tensor the region computes and something outside it reads (a later layer, a running-statistics
update, an output) goes through an `end_checkpoint` right after its binding. Values the forward
pass returns are the forward pass's own: batch norm's running statistics are updated once per
step, not again by the recomputation. A dropout inside recomputes its mask from the same seed
(tvmgraph/dropout.py), so the recomputed activations equal the forward's exactly.

Not marked: tuples and other non-tensor values (they stay as they are; anything computed from
them is then kept or recomputed as `Gradient` decides) and region results read by the
function's return outside the dataflow block (they are outputs anyway).

No switch of its own: it runs only for modules whose `activation_checkpointing` is on. Report:
the number of module calls marked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import tvm
from tvm import relax

from .bindings import vars_in


def _substitute(expr: relax.Expr, mapping: dict[relax.Var, relax.Var]) -> relax.Expr:
    """`expr` with the variables in `mapping` replaced (bindings are in A-normal form: calls,
    tuples and tuple items of variables and constants)."""
    if isinstance(expr, relax.Var):
        return mapping.get(expr, expr)
    if isinstance(expr, relax.Call):
        args = [_substitute(a, mapping) for a in expr.args]
        if all(a.same_as(b) for a, b in zip(args, expr.args)):
            return expr
        return relax.Call(expr.op, args, expr.attrs, expr.ty_args)
    if isinstance(expr, relax.Tuple):
        fields = [_substitute(f, mapping) for f in expr.fields]
        return expr if all(a.same_as(b) for a, b in zip(fields, expr.fields)) else relax.Tuple(fields)
    if isinstance(expr, relax.TupleGetItem):
        inner = _substitute(expr.tuple_value, mapping)
        return expr if inner.same_as(expr.tuple_value) else relax.TupleGetItem(inner, expr.index)
    return expr


def _is_tensor(var: relax.Var) -> bool:
    return isinstance(var.ty, relax.TensorType)


class _Marker:
    """Rewrites the dataflow blocks of one function."""

    def __init__(self, regions: Sequence[Collection[str]]) -> None:
        self.region_of = {name: index for index, names in enumerate(regions) for name in names}
        self.marked: set[int] = set()
        self.builder = relax.BlockBuilder()  # types the rewritten values (normalize)

    def block(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        bindings = list(block.bindings)
        region = {b.var: self.region_of.get(b.var.name) for b in bindings}
        escaping: set[relax.Var] = set()  # region results read outside their region
        for b in bindings:
            for var in vars_in(b.value):
                if region.get(var) is not None and region[var] != region[b.var]:
                    escaping.add(var)
        ends: dict[relax.Var, relax.Var] = {}  # region result -> its end_checkpoint
        starts: dict[tuple[int, relax.Var], relax.Var] = {}  # (region, outer tensor) -> start_checkpoint
        out: list[relax.Binding] = []
        for b in bindings:
            r = region[b.var]
            mapping = {var: end for var, end in ends.items() if region[var] != r}
            if r is not None:
                self.marked.add(r)
                for var in vars_in(b.value):
                    if region.get(var) == r or not _is_tensor(var):
                        continue
                    if (r, var) not in starts:
                        start = relax.DataflowVar(f"{var.name}_start", var.ty)
                        marker = relax.op.grad.start_checkpoint(ends.get(var, var))
                        out.append(relax.VarBinding(start, self.builder.normalize(marker)))
                        starts[r, var] = start
                    mapping[var] = starts[r, var]
            value = _substitute(b.value, mapping)
            if not value.same_as(b.value):
                value = self.builder.normalize(value)
            if isinstance(b, relax.MatchCast):
                out.append(b if value.same_as(b.value) else relax.MatchCast(b.var, value, b.ty))
            else:
                out.append(b if value.same_as(b.value) else relax.VarBinding(b.var, value))
            if b.var in escaping and _is_tensor(b.var) and isinstance(b.var, relax.DataflowVar):
                end = relax.DataflowVar(f"{b.var.name}_end", b.var.ty)
                out.append(relax.VarBinding(end, self.builder.normalize(relax.op.grad.end_checkpoint(b.var))))
                ends[b.var] = end
        return relax.DataflowBlock(out)


@tvm.transform.module_pass(opt_level=0, name="CheckpointModules")
class CheckpointModules:
    """Mark each call of a checkpointed module for recomputation in the backward pass."""

    def __init__(self, regions: Sequence[Collection[str]] = (), report: Callable[[str], None] | None = None,
                 func_name: str = "main") -> None:
        self.regions = [frozenset(names) for names in regions if names]
        self.report = report or (lambda msg: None)
        self.func_name = func_name

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.regions or self.func_name not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        func = mod[self.func_name]
        marker = _Marker(self.regions)
        blocks = [marker.block(b) if isinstance(b, relax.DataflowBlock) else b for b in func.body.blocks]
        body = marker.builder.normalize(relax.SeqExpr(blocks, func.body.body))
        mod = mod.clone()
        mod[self.func_name] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
        self.report(f"CheckpointModules: {len(marker.marked)} module call(s) recomputed in the backward pass")
        return mod

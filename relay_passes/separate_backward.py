"""SeparateBackward: a training function's forward and backward passes in two dataflow blocks.

    with R.dataflow():                          with R.dataflow():
        y = f(x)                                    y = f(x)            (y: a Var now, read later)
        r = reshape(y)                              r = reshape(y)
        loss = g(r)                                 loss = g(r)
        loss_adjoint = ones(...)          ->        R.output(y, loss)
        y_adjoint = h(r, loss_adjoint)          block_boundary = R.tuple()
        ...                                     with R.dataflow():
                                                    loss_adjoint = ones(...)
                                                    r_again = reshape(y)
                                                    y_adjoint = h(r_again, loss_adjoint)
                                                    ...

Why: FuseOps emits fused groups in an order of its own (`TopoSortByGroupDep`), which puts a
group that reads only forward values right after them, in the forward pass, and
StraightenBindings cannot undo a whole chain of them. Backward work that reads only forward
values (a batch norm's centred input, a cast RecomputeUpcasts redid for the backward pass) was
then computed in the forward pass and its result kept to the backward. FuseOps works within a
block, so two blocks keep each pass's work in its pass.

The cut (`bindings.cut_block`) puts a binding block between the two, an empty tuple nothing
reads: Relax's normalizer merges adjacent dataflow blocks, and until 2026-11-27 it merged these
right back (the pass changed nothing). FuseTIR drops the boundary after fusion, so everything
after it (StraightenBindings, CompressMemory) sees one block again. A layout view of a forward
value that the backward pass reads is made again in the backward pass, so that the forward
block passes on the tensor itself: a view read on both sides was a second output of a fused
forward kernel, a copy (+8 MiB planned in the benchmark GPT's step).

The backward pass starts at `bindings.backward_start` (autodiff's first `*_adjoint`). Forward
variables the backward pass reads become block outputs (non-dataflow `Var`s).

Position: after RecomputeUpcasts, before the fusion passes. A pass after it that drops unread
bindings must keep the boundary, which nothing reads (`bindings.drop_unread`, as
`mutate_graph_functions(drop_unused=True)` does; TVM's `remove_all_unused` drops it).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from .bindings import VIEW_OPS, Substitute, backward_start, cut_block, rebound, rewrite_dataflow_blocks, vars_in


def _view(binding: relax.Binding) -> bool:
    value = binding.value
    return (isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op) and value.op.name in VIEW_OPS)


def separate(block: relax.DataflowBlock) -> list[relax.BindingBlock]:
    """`block` as [forward, boundary, backward], or [block] when it has no backward pass."""
    bindings = list(block.bindings)
    start = backward_start(bindings)
    if not start:
        return [block]
    return cut_block(bindings[:start] + _views_again(bindings[:start], bindings[start:]), [start])


def _views_again(forward: list[relax.Binding], backward: list[relax.Binding]) -> list[relax.Binding]:
    """`backward` reading each layout view of a forward value (a reshape, a transpose) through
    its own copy of the view, made right before its first reader, so that the forward block
    passes on the tensor itself. A view read on both sides is otherwise a second output of a
    fused forward kernel: a copy of the tensor (an attention's probabilities reshaped for
    `probs @ v`, read again by the value's gradient: 2 MiB per GPT layer)."""
    views = {b.var: b for b in forward if _view(b) and isinstance(b.var, relax.DataflowVar)}
    again: dict[relax.Var, relax.Var] = {}
    out: list[relax.Binding] = []

    def redo(var: relax.Var) -> relax.Var:
        if var not in views:
            return var
        if var not in again:
            source = views[var].value.args[0]
            new_source = redo(source) if isinstance(source, relax.Var) else source
            value = Substitute({source: new_source}).visit_expr(views[var].value) if new_source is not source \
                else views[var].value
            again[var] = relax.DataflowVar(f"{var.name}_again", var.ty)
            out.append(relax.VarBinding(again[var], value))
        return again[var]

    for binding in backward:
        for var in vars_in(binding.value):
            if var in views:
                redo(var)
        out.append(rebound(binding, Substitute(again)) if again else binding)
    return out


@tvm.transform.module_pass(opt_level=0, name="SeparateBackward")
class SeparateBackward:
    """Cut every training function's dataflow block where its backward pass starts."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod, changed = rewrite_dataflow_blocks(mod, separate)
        if changed:
            self.report(f"SeparateBackward: forward and backward passes in separate blocks in {', '.join(changed)}")
        return mod

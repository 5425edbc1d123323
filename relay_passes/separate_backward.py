"""SeparateBackward: a training function's forward and backward passes in two dataflow blocks.

    with R.dataflow():                          with R.dataflow():
        y = f(x)                                    y = f(x)            (y: a Var now, read later)
        loss = g(y)                                 loss = g(y)
        loss_adjoint = ones(...)          ->        R.output(y, loss)
        y_adjoint = h(y, loss_adjoint)          with R.dataflow():
        ...                                         loss_adjoint = ones(...)
                                                    y_adjoint = h(y, loss_adjoint)
                                                    ...

Why: FuseOps emits fused groups in an order of its own (`TopoSortByGroupDep`), which puts a
group that reads only forward values right after them, in the forward pass, and
StraightenBindings cannot undo a whole chain of them. Backward work that reads only forward
values (a batch norm's centred input, a cast RecomputeUpcasts redid for the backward pass) was
then computed in the forward pass and its result kept to the backward. FuseOps and
StraightenBindings work within a block, so two blocks keep each pass's work in its pass. On the
benchmark ResNet-18's AMP training step the planned memory fell from 80.4 to 61.8 MiB (with
RecomputeUpcasts; the time per step did not change measurably).

The backward pass starts at `bindings.backward_start` (autodiff's first `*_adjoint`). Forward
variables the backward pass reads become block outputs (non-dataflow `Var`s).

Position: after RecomputeUpcasts, before the fusion passes.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from .bindings import Substitute, backward_start, rebound, rewrite_dataflow_blocks, vars_in


def separate(block: relax.DataflowBlock) -> list[relax.DataflowBlock]:
    """`block` as [forward, backward], or [block] when it has no backward pass to cut off."""
    bindings = list(block.bindings)
    start = backward_start(bindings)
    if not start:
        return [block]
    read_later = {v for b in bindings[start:] for v in vars_in(b.value)}
    outputs = {b.var: relax.Var(b.var.name, b.var.ty) for b in bindings[:start]
               if isinstance(b.var, relax.DataflowVar) and b.var in read_later}
    substitute = Substitute(outputs)
    return [relax.DataflowBlock([rebound(b, substitute) for b in bindings[:start]]),
            relax.DataflowBlock([rebound(b, substitute) for b in bindings[start:]])]


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

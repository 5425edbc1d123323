"""RecomputeUpcasts: the backward pass casts a 16-bit activation to float32 again instead of
keeping the forward pass's float32 copy.

    y = astype(x, "float32")     # forward (x: bfloat16)           y = astype(x, "float32")
    ... = batch_norm(y, ...)                                         ... = batch_norm(y, ...)
    ...                                                   ->         ...
    loss_adjoint = ...           # backward                          ...
    ... = f(y, g_adjoint)                                            y_again = astype(x, "float32")
                                                                     ... = f(y_again, g_adjoint)

Under AMP a batch norm (torch computes it in float32) reads its bfloat16 input cast to float32,
and autodiff's batch-norm gradient reads that cast too: the float32 copy of every normalized
activation stayed live from the forward to the backward pass, twice the bytes of the bfloat16
activation that eager keeps. A cast is cheap to redo (one pass over `x`), and FuseOps fuses the
new one into its reader. It needs SeparateBackward after it: FuseOps would otherwise emit the
new cast, which reads only a forward value, back in the forward pass.

Only casts of a variable from float16/bfloat16 to float32, bound in the forward pass (before
`bindings.backward_start`) to a dataflow variable, are redone, once each, right before their
first reader in the backward pass.

Position: after AccumulateFloat32 (whose casts it also sees), before SeparateBackward.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from relay_passes import report_counts

from .bindings import Substitute, backward_start, rebound, rewrite_dataflow_blocks, vars_in

_ASTYPE = tvm.ir.Op.get("relax.astype")
_HALF = ("float16", "bfloat16")


def _is_upcast(binding: relax.Binding) -> bool:
    value = binding.value
    if not (isinstance(binding, relax.VarBinding) and isinstance(binding.var, relax.DataflowVar)
            and isinstance(value, relax.Call) and value.op.same_as(_ASTYPE)):
        return False
    x = value.args[0]
    return (str(value.attrs.dtype) == "float32" and isinstance(x, relax.Var)
            and isinstance(x.ty, relax.TensorType) and x.ty.dtype.dtype in _HALF)


def recompute(block: relax.DataflowBlock) -> tuple[relax.DataflowBlock, int]:
    """`block` with its forward upcasts redone in its backward pass, and how many."""
    bindings = list(block.bindings)
    start = backward_start(bindings)
    if not start:
        return block, 0
    upcasts = {b.var: b for b in bindings[:start] if _is_upcast(b)}
    first_reader: dict[relax.Var, int] = {}
    for i in range(start, len(bindings)):
        for var in vars_in(bindings[i].value):
            if var in upcasts:
                first_reader.setdefault(var, i)
    if not first_reader:
        return block, 0
    again = {y: relax.DataflowVar(f"{y.name}_again", y.ty) for y in first_reader}
    before: dict[int, list[relax.Binding]] = {}
    for y, i in first_reader.items():
        before.setdefault(i, []).append(relax.VarBinding(again[y], upcasts[y].value))
    substitute = Substitute(again)
    out = bindings[:start]
    for i in range(start, len(bindings)):
        out += before.get(i, [])
        out.append(rebound(bindings[i], substitute))
    return relax.DataflowBlock(out), len(again)


@tvm.transform.module_pass(opt_level=0, name="RecomputeUpcasts")
class RecomputeUpcasts:
    """Redo in the backward pass every forward float32 upcast of a 16-bit tensor it reads."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        counts = []

        def rewrite(block: relax.DataflowBlock) -> list[relax.DataflowBlock]:
            block, n = recompute(block)
            counts.append(n)
            return [block]

        mod, _ = rewrite_dataflow_blocks(mod, rewrite)
        if sum(counts):
            report_counts(self.report, "RecomputeUpcasts", {"float32 cast redone in the backward pass": sum(counts)})
        return mod

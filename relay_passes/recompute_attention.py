"""RecomputeAttention: the backward pass recomputes attention probabilities instead of keeping them.

    s = R.matmul(q, k)                         qc = R.grad.start_checkpoint(q)
    p = R.nn.softmax(s, axis=-1)               kc = R.grad.start_checkpoint(k)
    o = R.matmul(p, v)                  ->     vc = R.grad.start_checkpoint(v)
    (uses of o)                                s = R.matmul(qc, kc)
                                               p = R.nn.softmax(s, axis=-1)
                                               o = R.matmul(p, vc)
                                               oc = R.grad.end_checkpoint(o)
                                               (uses of oc)

Position: on the forward function, before `relax.transform.Gradient` (tvmgraph/training/
train_step.py), which then recomputes everything between the markers in the backward pass
(Relax's activation checkpointing) instead of keeping it from the forward pass.

Why: autodiff keeps each attention's probabilities, batch x heads x seq x seq, for the
backward pass, twice when torch's safe softmax (which zeroes rows that are all -inf) follows
the softmax: in the benchmark transformer 4 MiB per layer, more than its q, k and v together.
Eager PyTorch on CPU runs a flash-attention kernel that keeps only q, k, v and the output.
Recomputing costs the two attention matmuls and the softmax again (a small part of a layer's
FLOPs: the projections and the feed-forward block dominate).

Matched: `m1 = matmul(a, b)`, then a chain of reshape, broadcast_to, add (a mask), multiply or
divide (a scale) ending in `softmax`; from the softmax, reshape, broadcast_to and the safe-
softmax `where` (with the `full_like` that makes its zeros) lead to exactly one
`m2 = matmul(p, c)` reading the probabilities as its first operand. Nothing else may read the
probabilities (e.g. attention weights returned with `need_weights=True`): then they are kept
anyway, and the pass leaves that attention alone. An attention inside a checkpointed module
(relay_passes/checkpoint_modules.py, which runs first) is left alone too: the module's
recomputation covers it, and markers of its own would keep q, k and v.

Kill switch: `GraphConfig.enable_recompute_attention(False)`. Report: the number of attentions.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .bindings import vars_in

_TO_SCORES = {"relax.reshape", "relax.broadcast_to", "relax.add", "relax.multiply", "relax.divide"}
_FROM_PROBS = {"relax.reshape", "relax.broadcast_to", "relax.where", "relax.full_like"}


def _op_name(value: relax.Expr) -> str | None:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) else None


class _Block:
    """The bindings of a dataflow block, by variable, and who reads each variable."""

    def __init__(self, block: relax.DataflowBlock) -> None:
        self.value = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
        self.readers: dict[relax.Var, list[relax.Var]] = {}
        for var, value in self.value.items():
            for arg in value.args if isinstance(value, relax.Call) else ():
                if isinstance(arg, relax.Var):
                    self.readers.setdefault(arg, []).append(var)
        self.outputs = {b.var for b in block.bindings if not isinstance(b.var, relax.DataflowVar)}
        # Computed from a start_checkpoint with no end_checkpoint in between: recomputed anyway.
        self.recomputed: set[relax.Var] = set()
        for var, value in self.value.items():
            name = _op_name(value)
            if name == "relax.grad.start_checkpoint" or (
                    name != "relax.grad.end_checkpoint" and any(a in self.recomputed for a in vars_in(value))):
                self.recomputed.add(var)

    def scores_matmul(self, scores: relax.Var) -> relax.Var | None:
        """Walk back from the softmax input to the matmul that computed the scores."""
        var = scores
        while var in self.value:
            value = self.value[var]
            name = _op_name(value)
            if name == "relax.matmul":
                return var
            if name not in _TO_SCORES:
                return None
            if name in ("relax.reshape", "relax.broadcast_to"):
                var = value.args[0]
                continue
            # An add or a scale: the scores flow through the operand of the result's shape
            # (the mask or the scale broadcasts).
            same_shape = [a for a in value.args if isinstance(a, relax.Var)
                          and tvm_ffi.structural_equal(a.ty.shape, value.ty.shape)]
            if not same_shape:
                return None
            var = same_shape[0]
        return None

    def output_matmul(self, probs: relax.Var) -> relax.Var | None:
        """The one matmul that reads the probabilities (through reshapes and the safe-softmax
        where) as its first operand; None if anything else reads them."""
        found: list[relax.Var] = []
        pending, seen = [probs], set()
        while pending:
            var = pending.pop()
            if var in seen:
                continue
            seen.add(var)
            if var in self.outputs:
                return None
            for reader in self.readers.get(var, []):
                value = self.value[reader]
                if _op_name(value) == "relax.matmul" and value.args[0].same_as(var) \
                        and not value.args[1].same_as(var):
                    found.append(reader)
                elif _op_name(value) in _FROM_PROBS:
                    pending.append(reader)
                else:
                    return None
        return found[0] if len(found) == 1 else None


@mutator
class _Marker(PyExprMutator):
    """Wraps the matched attentions in checkpoint markers."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.starts: set[relax.Var] = set()  # matmuls whose operands get start_checkpoint
        self.ends: set[relax.Var] = set()  # matmuls whose result gets end_checkpoint
        self.count = 0

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        found = _Block(block)
        for var, value in found.value.items():
            if _op_name(value) != "relax.nn.softmax":
                continue
            first = found.scores_matmul(value.args[0]) if isinstance(value.args[0], relax.Var) else None
            second = found.output_matmul(var)
            if first is not None and second is not None and first not in found.recomputed:
                self.starts |= {first, second}
                self.ends.add(second)
                self.count += 1
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.starts:
            super().visit_var_binding_(binding)
            return
        call = self.visit_expr(binding.value)
        args = list(call.args)
        first_operand_too = binding.var not in self.ends  # the scores matmul: q and k
        for i in range(len(args)):
            if i == 1 or first_operand_too:
                args[i] = self.builder_.emit(relax.op.grad.start_checkpoint(args[i]))
        result = self.builder_.emit(relax.Call(call.op, args, call.attrs), name_hint=binding.var.name)
        if binding.var in self.ends:
            result = self.builder_.emit(relax.op.grad.end_checkpoint(result))
        self.set_var_remap(binding.var, result)


@tvm.transform.module_pass(opt_level=0, name="RecomputeAttention")
class RecomputeAttention:
    """Mark each attention core (scores, softmax, weighted sum) for recomputation in backward."""

    def __init__(self, enabled: bool = True, report: Callable[[str], None] | None = None,
                 func_name: str = "main") -> None:
        self.enabled = enabled
        self.report = report or (lambda msg: None)
        self.func_name = func_name

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.enabled or self.func_name not in [gv.name_hint for gv in mod.get_global_vars()]:
            return mod
        marker = _Marker(mod)
        gv = mod.get_global_var(self.func_name)
        marker.builder_.update_func(gv, marker.visit_expr(mod[gv]))
        if marker.count:
            self.report(f"RecomputeAttention: {marker.count} attention(s) recomputed in the backward pass")
        return marker.builder_.get()

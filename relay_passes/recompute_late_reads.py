"""RecomputeLateReads: a checkpointed activation that the backward pass reads long after its
recomputation is recomputed again right before that read, instead of kept.

    # backward pass of a checkpointed layer       # after
    h_cp = matmul(x, w1)          (recomputed)    h_cp = matmul(x, w1)
    a_cp = gelu(h_cp)                             a_cp = gelu(h_cp)
    y_cp = matmul(a_cp, w2)                       y_cp = matmul(a_cp, w2)      (a_cp dies here)
    ... = layer_norm_gradient(y_cp, ...)          ... = layer_norm_gradient(y_cp, ...)
    dy = ...                                      dy = ...
                                                  ---- new dataflow block ----
                                                  a_again = gelu(h_cp)
    dw2 = matmul(permute_dims(dy), a_cp)          dw2 = matmul(permute_dims(dy), a_again)
    dh = gelu_gradient(h_cp, ...)                 dh = gelu_gradient(h_cp, ...)

Why: autodiff (relax.transform.Gradient) recomputes a checkpointed module call (CheckpointModules'
markers) all at once, when its backward pass first needs any of it, and keeps each recomputed
value to its last gradient reader: the call's whole set of activations is live at the start of
its backward pass, which is where a checkpointed training step peaks.

Candidates: forward values of the backward pass (they read no adjoint) that the recomputation
reads (early) and gradients read after it (late, directly or through a layout view). One is
redone as a chain of bindings (at most MAX_CHAIN) through ops linear in their result's size
(element-wise, layout, casts, reductions, softmax, layer norm), and through a matmul only where
a softmax reads its result (an attention's scores: the trade RecomputeAttention and
flash-attention make); each leaf of the chain must be a parameter or a value that some binding
at or after the insertion point reads anyway.

Which are redone: while the peak of live bytes of the backward block falls where a candidate is
live only for its late readers, the biggest such candidate (`_lowering_the_peak`; the model
counts each non-view result from its binding to its last reader, except an element-wise one
that one element-wise op or reduction reads, which fusion keeps out of memory). A step without
checkpointed modules has no candidate whose wait spans its peak.

Where: right after the last of the late reader's other operands is computed (looking through
layout views, which fusion folds into the reader), so that StraightenBindings can run the
reader, and free the value, before the backward pass allocates the next gradient. A new
dataflow block starts there: FuseOps orders fused groups by their inputs and would move a chain
that reads only early values back to where they were computed (SeparateBackward cuts the
forward pass off for the same reason).

Effect (docs/benchmarks.md): the benchmark transformer's training step with both layers
checkpointed plans 25.0 -> 17.0 MiB; its measured peak falls 34-36% below the step without
checkpointing (21% before). Cost: GELU, layer norm, attention scores and softmax once more per
checkpointed layer.

Position: after SeparateBackward (it rewrites the backward block, the one that starts with the
loss's adjoint), before the fusion passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import relax

from relay_passes import report_counts

from .bindings import VIEW_OPS, Substitute, cut_block, rebound, rewrite_dataflow_blocks, vars_in
from .tensor_sizes import bytes_per_unit

MAX_CHAIN = 32

def _ops(names: str) -> frozenset[str]:
    return frozenset(f"relax.{name}" for name in names.split())


# Element-wise and injective ops: fusion folds a chain of them, and one into a matmul's epilogue
# or a reduction after it, so a result that one such op reads is never stored.
_FUSIBLE = _ops(
    "add subtract multiply divide negative abs exp log sqrt rsqrt tanh sigmoid erf power maximum "
    "minimum clip where equal not_equal less greater less_equal greater_equal logical_not astype "
    "broadcast_to expand_dims squeeze strided_slice nn.gelu nn.gelu_tanh nn.relu nn.silu")
# Ops whose cost is linear in their result's size: redoing one is a pass over memory.
_LINEAR = _FUSIBLE | _ops("reshape permute_dims nn.leakyrelu max min sum mean nn.softmax nn.log_softmax "
                          "nn.layer_norm")
_REDUCTIONS = _ops("sum mean max min collapse_sum_to")
_SOFTMAX = frozenset({"relax.nn.softmax", "relax.nn.log_softmax"})
_MATMUL = "relax.matmul"


def _op(binding: relax.Binding) -> str | None:
    value = binding.value
    if isinstance(binding, relax.VarBinding) and isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


@dataclass
class _Block:
    """What the rewrite needs to know of the backward block's bindings."""

    bindings: list[relax.Binding]
    position: dict[relax.Var, int]   # where each variable of the block is bound
    readers: dict[relax.Var, list[int]]  # positions of the bindings that read it
    forward: set[relax.Var]          # values that read no adjoint (recomputed forward values)
    params: set[relax.Var]           # the function's parameters: live throughout

    @classmethod
    def of(cls, bindings: list[relax.Binding], params: set[relax.Var]) -> _Block:
        position = {b.var: i for i, b in enumerate(bindings)}
        readers: dict[relax.Var, list[int]] = {}
        forward: set[relax.Var] = set()
        for i, b in enumerate(bindings):
            read = vars_in(b.value)
            for v in read:
                readers.setdefault(v, []).append(i)
            inside = [v for v in read if v in position]
            if (read and not b.var.name.endswith("_adjoint")
                    and all(v in forward for v in inside)):
                forward.add(b.var)
        return cls(bindings, position, readers, forward, params)

    def read_at_or_after(self, var: relax.Var, point: int) -> bool:
        return var in self.params or any(r >= point for r in self.readers.get(var, []))


def _is_view(block: _Block, position: int) -> bool:
    return _op(block.bindings[position]) in VIEW_OPS


def _split_readers(block: _Block, var: relax.Var) -> tuple[list[int], list[int]]:
    """(early, late) readers of `var`: the recomputation's own computations read it early; a
    gradient, or a layout view that only gradients read (autodiff's `permute_dims(a)` for a
    matmul's gradient), reads it late."""
    early, late = [], []
    for r in block.readers.get(var, []):
        reader = block.bindings[r].var
        if reader not in block.forward:
            late.append(r)
        elif _is_view(block, r):
            inner_early, inner_late = _split_readers(block, reader)
            (early if inner_early or not inner_late else late).append(r)
        else:
            early.append(r)
    return early, late


def _ready(block: _Block, r: int, skip: relax.Var) -> int:
    """The first position where the binding at `r` could run if `skip` were at hand: after its
    other operands (looking through layout views, which fusion folds into their reader); for a
    view of `skip`, where the first of its own readers could, and not after the view."""
    reader = block.bindings[r]
    if _is_view(block, r) and reader.var in block.forward:
        # NOTE: not after the view itself, which will read the recomputed value
        return min([r, *(_ready(block, q, reader.var) for q in block.readers.get(reader.var, []))])
    ready = 0
    for v in vars_in(reader.value):
        if v.same_as(skip):
            continue
        while v in block.position and _is_view(block, block.position[v]):
            v = block.bindings[block.position[v]].value.args[0]
        if v in block.position:
            ready = max(ready, block.position[v] + 1)
    return min(ready, r)


class _Chains:
    """Builds the recomputation of each chosen value at its insertion point, sharing what an
    earlier chain (at or before that point) already recomputed."""

    def __init__(self, block: _Block, dying: set[relax.Var]):
        self.block = block
        self.dying = dying  # values being recomputed: not live late, whatever their readers
        self.again: dict[relax.Var, tuple[relax.Var, int]] = {}
        self.emitted: dict[int, list[relax.Binding]] = {}

    def plan(self, var: relax.Var, point: int, chain: list) -> relax.Var | None:
        """The variable that holds `var`'s value at `point`, appending to `chain` the bindings
        that recompute it; None when it cannot be recomputed there."""
        block = self.block
        if var in self.again and self.again[var][1] <= point:
            return self.again[var][0]
        if var not in block.position:  # from the forward block or a parameter
            return var if block.read_at_or_after(var, point) else None
        if var not in self.dying and block.read_at_or_after(var, point):
            return var
        b = block.bindings[block.position[var]]
        op = _op(b)
        if var not in block.forward or op is None or len(chain) >= MAX_CHAIN:
            return None
        if op not in _LINEAR and not (op == _MATMUL and self.scores(var)):
            return None
        mapping = {}
        for v in dict.fromkeys(vars_in(b.value)):  # in order: the same chain every compile
            new = self.plan(v, point, chain)
            if new is None:
                return None
            if new is not v:
                mapping[v] = new
        again = relax.DataflowVar(f"{var.name}_again", var.ty)
        chain.append((var, relax.VarBinding(again, Substitute(mapping).visit_expr(b.value))))
        return again

    def scores(self, var: relax.Var) -> bool:
        """Whether a softmax reads `var` (through views): a matmul's result that is an
        attention's scores."""
        return any(_op(self.block.bindings[r]) in _SOFTMAX for r in _uses(self.block, self.block.readers.get(var, [])))

    def commit(self, point: int, chain: list) -> None:
        for var, binding in chain:
            self.again[var] = (binding.var, point)
            self.emitted.setdefault(point, []).append(binding)


def _uses(block: _Block, positions: list[int]) -> set[int]:
    """The positions of the bindings that read through the bindings at `positions`: each
    non-view one itself, a view's readers (recursively) for a view."""
    found: set[int] = set()
    for r in positions:
        if _is_view(block, r):
            found |= _uses(block, block.readers.get(block.bindings[r].var, []))
        else:
            found.add(r)
    return found


def _root(block: _Block, var: relax.Var) -> relax.Var:
    """The tensor a view refers to (`var` itself when it is not a view)."""
    while var in block.position and _is_view(block, block.position[var]):
        var = block.bindings[block.position[var]].value.args[0]
    return var


def _fused_away(block: _Block, var: relax.Var, reader: int) -> bool:
    """Whether fusion keeps `var` out of memory: an element-wise result (or a matmul's) that
    only one element-wise op or reduction reads."""
    own = _op(block.bindings[block.position[var]])
    return (own in _FUSIBLE or own == _MATMUL) and _op(block.bindings[reader]) in _FUSIBLE | _REDUCTIONS


def _lowering_the_peak(block: _Block, candidates: dict[relax.Var, tuple[int, list[int]]]) -> set[relax.Var]:
    """The candidates worth recomputing: while the block's peak of live bytes falls where a
    candidate's tensor is live only for the candidate's late readers, recompute the biggest.

    The model of the block: each binding that is not a view allocates its result, which lives
    to its last reader (through views); values from before the block live from its start.
    Fusion keeps some of them in registers, so the numbers are an upper bound, but a
    recomputation's activations all live across the peak either way."""
    n = len(block.bindings)
    intervals: dict[relax.Var, list[tuple[int, int, int]]] = {}
    for var in list(block.readers):
        if var in block.params or _root(block, var) is not var:
            continue
        size = bytes_per_unit(var.ty) if isinstance(var.ty, relax.TensorType) else None
        uses = _uses(block, block.readers[var])
        if var in block.position and len(uses) == 1 and _fused_away(block, var, next(iter(uses))):
            continue
        if size and size[0] and size[1] is None and uses:
            intervals[var] = [(block.position.get(var, 0), max(uses), size[0])]
    gaps = {}  # candidate -> (its tensor, last early use, first late use, last late use)
    for var, (point, late) in candidates.items():
        root = _root(block, var)
        if root not in intervals:
            continue
        late_uses = _uses(block, late)
        early_uses = _uses(block, block.readers[root]) - late_uses
        if early_uses and late_uses:
            gaps[var] = (root, max(early_uses), point, max(late_uses))
    chosen: set[relax.Var] = set()
    while True:
        delta = [0] * (n + 2)
        for spans in intervals.values():
            for start, end, nbytes in spans:
                delta[start] += nbytes
                delta[end + 1] -= nbytes
        live, peak, peak_at = 0, -1, 0
        for i in range(n):
            live += delta[i]
            if live > peak:
                peak, peak_at = live, i
        best, best_bytes = None, 0
        for var, (root, last_early, point, _) in gaps.items():
            nbytes = intervals[root][0][2]
            if var not in chosen and last_early < peak_at < point and nbytes > best_bytes:
                best, best_bytes = var, nbytes
        if best is None:
            return chosen
        chosen.add(best)
        root, last_early, point, last_late = gaps[best]
        start, _, nbytes = intervals[root][0]
        intervals[root] = [(start, last_early, nbytes)]
        intervals[best] = [(point, last_late, nbytes)]


def recompute(block: relax.DataflowBlock, params: set[relax.Var]) -> tuple[list[relax.DataflowBlock], int]:
    """The backward block with its late-read recomputed values recomputed again, cut into
    blocks at the insertion points; and how many values."""
    bindings = list(block.bindings)
    if not bindings or not bindings[0].var.name.endswith("_adjoint"):
        return [block], 0  # not a backward block (SeparateBackward starts one at the loss's adjoint)
    info = _Block.of(bindings, params)
    candidates = {}
    for var in info.forward:
        size = bytes_per_unit(var.ty)
        if not isinstance(var, relax.DataflowVar) or not size or size[1] is not None:
            continue
        early, late = _split_readers(info, var)
        if early and late and max(early) < min(late):
            point = max(min(_ready(info, r, var) for r in late), max(early) + 1)
            candidates[var] = (point, late)
    # A value dies early only if its own recomputation works. First each on its own (every
    # other value kept where its readers need it), then together, dropping those that fail
    # until none does (a dropped value is kept, and chains through it read it instead).
    dying = {v for v in candidates if _Chains(info, {v}).plan(v, candidates[v][0], []) is not None}
    while True:
        chains = _Chains(info, dying)
        failed = {v for v in dying if chains.plan(v, candidates[v][0], []) is None}
        if not failed:
            break
        dying -= failed
    chosen = _lowering_the_peak(info, {v: candidates[v] for v in dying})
    chains = _Chains(info, chosen)
    substitute: dict[int, dict[relax.Var, relax.Var]] = {}
    for var in sorted(chosen, key=lambda v: candidates[v][0]):
        point, late = candidates[var]
        chain: list = []
        again = chains.plan(var, point, chain)
        if again is None:  # cannot happen (fewer values die than when it was checked); keep it
            continue
        chains.commit(point, chain)
        for r in late:
            substitute.setdefault(r, {})[var] = again
    if not chosen:
        return [block], 0
    out: list[relax.Binding] = []
    cuts = []
    for i, b in enumerate(bindings):
        if i in chains.emitted:
            cuts.append(len(out))
            out += chains.emitted[i]
        out.append(rebound(b, Substitute(substitute[i])) if i in substitute else b)
    return cut_block(out, cuts), len(chosen)


@tvm.transform.module_pass(opt_level=0, name="RecomputeLateReads")
class RecomputeLateReads:
    """Recompute, right before a gradient reads it, each checkpointed value it reads late."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        counts = []
        params: set[relax.Var] = set()
        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                params |= set(func.params)

        def rewrite(block: relax.DataflowBlock) -> list[relax.DataflowBlock]:
            blocks, n = recompute(block, params)
            counts.append(n)
            return blocks

        mod, _ = rewrite_dataflow_blocks(mod, rewrite)
        if sum(counts):
            report_counts(self.report, "RecomputeLateReads", {"checkpointed value recomputed where read late": sum(counts)})
        return mod

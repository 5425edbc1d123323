"""What a binding reads, where a training function's backward pass starts, and whether a fused
group would read itself: helpers the passes that walk bindings share."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes import graph_functions
from tvmgraph.schedules.loops import with_functions

if TYPE_CHECKING:
    from tvm.relax.transform import PatternCheckContext


# Ops that only relabel their input's elements (a reshape, a transpose): layout views, which
# the passes treat as the tensor they read.
VIEW_OPS = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze"})


def read_counts(mod: tvm.IRModule) -> Counter[relax.Var]:
    """How many times each variable of `mod`'s graph functions is read."""
    counts: Counter[relax.Var] = Counter()
    for _, func in graph_functions(mod):
        counts.update(function_reads(func))
    return counts


def function_reads(func: relax.Function) -> Counter[relax.Var]:
    """How many times each variable is read in `func`'s bindings and result."""
    counts: Counter[relax.Var] = Counter(vars_in(func.body.body))
    for block in func.body.blocks:
        for binding in block.bindings:
            counts.update(vars_in(binding.value))
    return counts


def vars_in(expr: relax.Expr) -> list[relax.Var]:
    """The variables `expr` refers to, in the order TVM's post-order visitor takes (with
    repeats). The common shapes of a binding's value are walked here (several times faster:
    the visitor called back into Python for every node, 44 a binding on the benchmark CNN's
    training step); anything else is visited."""
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Call):
        op = [expr.op] if isinstance(expr.op, relax.Var) else []
        return op + [v for a in expr.args for v in vars_in(a)]
    if isinstance(expr, relax.Tuple):
        return [v for f in expr.fields for v in vars_in(f)]
    if isinstance(expr, relax.TupleGetItem):
        return vars_in(expr.tuple_value)
    if isinstance(expr, (tvm.ir.Constant, relax.ShapeExpr)):  # tensors, numbers, strings, shapes
        return []
    return _visited_vars(expr)


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def is_view(call: relax.Call, mod: tvm.IRModule | None) -> bool:
    """A reshape kernel, which RewriteDataflowReshape turns into a view of its input: its readers
    read that input (StraightenBindings: an in-place update of the input waits for them;
    LiftFrozenComputation: a view of a weight is no copy worth keeping)."""
    if mod is None or not (call.op.same_as(_CALL_TIR) and isinstance(call.args[0], tvm.ir.GlobalVar)):
        return False
    func = mod[call.args[0]]
    if not isinstance(func, tvm.tirx.PrimFunc):
        return False
    try:
        return bool(relax.analysis.has_reshape_pattern(func))
    except tvm.error.InternalError:  # a body that is not one block (nothing RewriteDataflowReshape takes)
        return False


def _visited_vars(expr: relax.Expr) -> list[relax.Var]:
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found


def backward_start(bindings: list[relax.Binding]) -> int | None:
    """Index of the first binding of a training function's backward pass: relax.transform.Gradient
    names every adjoint `<var>_adjoint`, the loss's first. None in a function without one."""
    return next((i for i, b in enumerate(bindings) if b.var.name.endswith("_adjoint")), None)


@mutator
class Substitute(PyExprMutator):
    """Replace variables by other expressions (variables, constants) in an expression:
    `Substitute({old: new}).visit_expr(e)`."""

    def __init__(self, mapping: dict[relax.Var, relax.Expr]) -> None:
        super().__init__()
        self.mapping = mapping

    def visit_dataflow_var_(self, op: relax.DataflowVar) -> relax.Expr:
        return self.mapping.get(op, op)

    def visit_var_(self, op: relax.Var) -> relax.Expr:
        return self.mapping.get(op, op)


def rebound(binding: relax.Binding, substitute: Substitute) -> relax.Binding:
    """`binding` with `substitute` applied to its variable and its value."""
    var, value = substitute.mapping.get(binding.var, binding.var), substitute.visit_expr(binding.value)
    if isinstance(binding, relax.MatchCast):
        return relax.MatchCast(var, value, binding.struct_info)
    return relax.VarBinding(var, value)


def cut_block(bindings: list[relax.Binding], cuts: list[int]) -> list[relax.BindingBlock]:
    """`bindings` as dataflow blocks that start at each position of `cuts` (with a boundary
    block between each two); a dataflow variable read after the block that binds it becomes a
    block output (a non-dataflow `Var`)."""
    bounds = sorted({c for c in cuts if 0 < c < len(bindings)})
    starts, ends = [0, *bounds], [*bounds, len(bindings)]
    block_of = {b.var: k for k, (lo, hi) in enumerate(zip(starts, ends)) for b in bindings[lo:hi]}
    outputs = {}
    for k, (lo, hi) in enumerate(zip(starts, ends)):
        for b in bindings[lo:hi]:
            for v in vars_in(b.value):
                if isinstance(v, relax.DataflowVar) and block_of.get(v, k) < k and v not in outputs:
                    outputs[v] = relax.Var(v.name, v.ty)
    substitute = Substitute(outputs)
    blocks: list[relax.BindingBlock] = []
    for lo, hi in zip(starts, ends):
        if blocks:
            blocks.append(_block_boundary())
        blocks.append(relax.DataflowBlock([rebound(b, substitute) for b in bindings[lo:hi]]))
    return blocks


def _block_boundary() -> relax.BindingBlock:
    """A binding block between two dataflow blocks: Relax's normalizer merges adjacent dataflow
    blocks, and with them the cut. This one binds an empty tuple that nothing reads, which
    FuseTIR removes (the fusion passes before it work within each block)."""
    return relax.BindingBlock([relax.VarBinding(relax.Var("block_boundary", relax.TupleType([])), relax.Tuple([]))])


def drop_unread(func: relax.Function) -> relax.Function:
    """`func` without the dataflow bindings nothing reads (transitively); blocks outside dataflow
    are kept as they are. Unlike `relax.analysis.remove_all_unused`, this keeps a boundary
    block (`cut_block`), which nothing reads either: without it the normalizer merged the
    forward and backward passes back into one block, and fusion mixed their work."""
    if not isinstance(func.body, relax.SeqExpr):
        return func
    reads = function_reads(func)
    dropped: set[relax.Var] = set()
    for block in reversed(func.body.blocks):  # readers come after what they read: one sweep
        if isinstance(block, relax.DataflowBlock):
            for binding in reversed(block.bindings):
                if reads[binding.var] == 0:
                    dropped.add(binding.var)
                    reads.subtract(vars_in(binding.value))
    if not dropped:
        return func
    blocks = []
    for block in func.body.blocks:
        if isinstance(block, relax.DataflowBlock):
            kept = [b for b in block.bindings if b.var not in dropped]
            if kept:
                blocks.append(relax.DataflowBlock(kept))
        else:
            blocks.append(block)
    body = relax.SeqExpr(blocks, func.body.body)
    return relax.BlockBuilder().normalize(relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs))


def rewrite_dataflow_blocks(mod: tvm.IRModule, rewrite) -> tuple[tvm.IRModule, list[str]]:
    """`mod` with each dataflow block of its graph functions replaced by `rewrite(block)`, a list
    of blocks (`[block]` for no change), and normalized; and the names of the functions that
    changed (`mod` itself when none did)."""
    updates = {}
    for gv, func in graph_functions(mod):
        if not isinstance(func.body, relax.SeqExpr):
            continue
        blocks = [part for block in func.body.blocks
                  for part in (rewrite(block) if isinstance(block, relax.DataflowBlock) else [block])]
        if len(blocks) != len(func.body.blocks) or any(not a.same_as(b) for a, b in zip(blocks, func.body.blocks)):
            body = relax.SeqExpr(blocks, func.body.body)
            updates[gv] = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
    if not updates:
        return mod, []
    return relax.transform.Normalize()(with_functions(mod, updates)), sorted(gv.name_hint for gv in updates)


class Acyclic:
    """A FuseOpsByPattern check: accepts a match only if its group would not depend on itself,
    given the groups this pattern has already formed in `mod` (groups of earlier patterns are
    calls in `mod` by now). FuseOpsByPattern does not check this itself; a group that reads its
    own output leaves a variable used before it is defined (`Var lv36 is not defined`).

    A group depends on itself when one of its inputs is computed from one of its members. The
    search walks back from the inputs; a member of an earlier group stands for all of them
    (their group is one call). Bindings are numbered in program order: a plain binding before
    `low` cannot reach the match, where `low` is the first member of the match or of any
    earlier group straddling it, so the search stops there.

    It also refuses a group whose members lie in more than one dataflow block (SeparateBackward
    and RecomputeLateReads cut functions into several): FuseOpsByPattern builds such a group but
    then fails (`Check failed: defined_vars_.count(var.get())`).
    """

    def __init__(self, mod: tvm.IRModule) -> None:
        self.mod = mod
        self.position: dict[relax.Var, int] = {}  # filled at the first match (most patterns match none)
        self.value_of: dict[relax.Var, relax.Expr] = {}
        self.reads: dict[relax.Var, list[relax.Var]] = {}  # what a binding reads, asked as the search goes
        self.group_of: dict[relax.Var, frozenset[relax.Var]] = {}
        self.bounds: dict[frozenset[relax.Var], tuple[int, int]] = {}  # each group's first and last position
        self.block_of: dict[relax.Var, int] = {}

    def _number_bindings(self) -> None:
        blocks = 0
        for _, func in self.mod.functions_items():
            if isinstance(func, relax.Function) and isinstance(func.body, relax.SeqExpr):
                for block in func.body.blocks:
                    blocks += 1
                    for binding in block.bindings:
                        self.position[binding.var] = len(self.position)
                        self.value_of[binding.var] = binding.value
                        self.block_of[binding.var] = blocks

    def _reads(self, var: relax.Var) -> list[relax.Var]:
        if var not in self.reads:
            self.reads[var] = vars_in(self.value_of[var])
        return self.reads[var]

    def __call__(self, context: PatternCheckContext) -> bool:
        if not self.position:
            self._number_bindings()
        members = set(context.matched_bindings.keys())
        merged = {self.group_of[v] for v in members if v in self.group_of}
        for group in merged:  # a match that takes in an earlier group merges with it
            members |= group
        if not members <= self.position.keys():
            return False
        if len({self.block_of[v] for v in members}) > 1:
            return False
        if self._reaches_itself(members):
            return False
        group = frozenset(members)
        for var in group:
            self.group_of[var] = group
        for old in merged:
            del self.bounds[old]
        positions = [self.position[v] for v in group]
        self.bounds[group] = (min(positions), max(positions))
        return True

    def _reaches_itself(self, members: set[relax.Var]) -> bool:
        low = min(self.position[v] for v in members)
        changed = True
        while changed:
            changed = False
            for first, last in self.bounds.values():
                if first < low <= last:
                    low, changed = first, True
        seen: set[relax.Var] = set(members)
        pending = [v for m in members for v in self._reads(m) if v not in members]
        while pending:
            var = pending.pop()
            if var in members:
                return True
            if var in seen or var not in self.position:  # a parameter
                continue
            group = self.group_of.get(var)
            if group is not None:
                seen |= group
                pending.extend(v for g in group for v in self._reads(g))
            elif self.position[var] >= low:
                seen.add(var)
                pending.extend(self._reads(var))
        return False

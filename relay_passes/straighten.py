"""StraightenBindings: reorder each dataflow block so that fewer tensors are live at once.

Position: after fusion and schedules (the bindings are whole kernels, `call_tir` and
`call_tir_inplace`), before `ToNonDataflow`, so that `StaticPlanBlockMemory` (or
CompressMemory) plans the new order.

Why: autodiff emits the backward pass in a valid but memory-blind order. In a CNN it emits each
layer's weight and bias gradients (small reductions) after the whole backward pass, so every
upstream gradient they read stays live until the end: the benchmark CNN's training step peaks at
469 MiB of live tensors in that order and at 268 MiB straightened.

The order is a greedy topological sort over a model of the block where every binding allocates
its result's bytes (`call_tir_inplace`, tuple and alias bindings allocate nothing, nor does a
reshape kernel: RewriteDataflowReshape makes it a view of its input after this pass) and a tensor
dies at its last reader:
  1. a ready binding that frees at least as much as it allocates (it is the last reader of
     big tensors, e.g. a reduction) runs first, the one freeing most first;
  2. otherwise the ready binding that comes first in the original order runs, so the forward
     pass and anything the model does not see keep the order the program was written in.
Every tensor is a "root" allocated by one binding (a kernel with several results allocates one
per result); aliases share it. Results of the block (non-dataflow vars) and values from outside
it never die in it.

Constraints besides data dependencies: every in-place call (`call_tir_inplace`, e.g. the fused
optimizer update) runs after all other readers of the tensors it overwrites, and every binding
stays after the `match_cast`s before it (they may define shape variables it uses).

Cost: O((bindings + uses) log bindings) per block.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from tvmgraph.debug import logger
from tvmgraph.schedules.loops import REFERENCE_BATCH

from .bindings import is_view, vars_in
from .tensor_sizes import bytes_per_unit, format_bytes

_INPLACE = tvm.ir.Op.get("relax.call_tir_inplace")


class BlockModel:
    """What the scheduler knows about a block: for each binding the bindings it depends on, the
    tensors ("roots") it allocates and the roots it reads. A kernel with several results
    allocates one root per result, so that each dies at its own last reader (a fused
    linear + GELU keeps its pre-activation for the GELU gradient, while its output dies at the
    weight gradient that reads it last)."""

    def __init__(self, bindings: list[relax.Binding], mod: tvm.IRModule | None = None,
                 read_elsewhere: set[relax.Var] | None = None):
        """`read_elsewhere`: the variables read outside the block (later blocks, the function's
        result); a non-dataflow variable bound here lives to the end of the block only if it is
        one of them (None: every one does)."""
        n = len(bindings)
        self.n = n
        index = {b.var: i for i, b in enumerate(bindings)}
        self.root_bytes: list[int] = []
        self.allocates: list[list[int]] = []  # roots each binding allocates
        outer: dict[relax.Var, int] = {}  # a value from outside the block: a root of no bytes
        roots: list[set[int]] = []  # for each binding, the roots of the tensors it refers to
        fields: dict[int, list[set[int]]] = {}  # for a binding of tuple value, each field's roots

        def new_root(nbytes: int) -> int:
            self.root_bytes.append(nbytes)
            return len(self.root_bytes) - 1

        def roots_of(expr: relax.Expr) -> set[int]:
            if isinstance(expr, relax.TupleGetItem) and isinstance(expr.tuple_value, relax.Var) \
                    and index.get(expr.tuple_value) in fields:
                return set(fields[index[expr.tuple_value]][expr.index])
            found: set[int] = set()
            for var in vars_in(expr):
                if var in index:
                    found |= roots[index[var]]
                else:
                    if var not in outer:
                        outer[var] = new_root(0)
                    found.add(outer[var])
            return found

        self.deps = [{index[v] for v in vars_in(b.value) if v in index} for b in bindings]
        self.reads: list[set[int]] = []
        self.protected: set[int] = set()  # roots that never die in this block
        last_match_cast = -1
        for i, binding in enumerate(bindings):
            value = binding.value
            self.reads.append(roots_of(value))
            self.allocates.append([])
            if last_match_cast >= 0:
                self.deps[i].add(last_match_cast)
            if isinstance(binding, relax.MatchCast):
                last_match_cast = i
            if isinstance(value, relax.Call) and value.op.same_as(_INPLACE):
                # The result is the overwritten arguments: it aliases their roots.
                args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else [value.args[1]]
                roots.append(set().union(*(roots_of(args[int(k)]) for k in value.attrs.inplace_indices
                                           if int(k) >= 0)))
            elif isinstance(value, relax.Call) and not is_view(value, mod):
                ty = binding.var.ty
                field_types = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
                self.allocates[i] = [new_root(_bytes(t)) for t in field_types]
                roots.append(set(self.allocates[i]))
                if isinstance(ty, relax.TupleType):
                    fields[i] = [{r} for r in self.allocates[i]]
            else:  # Var, Tuple, TupleGetItem, constant, a reshape: an alias of what it reads
                roots.append(self.reads[i])
                if isinstance(value, relax.Tuple):
                    fields[i] = [roots_of(field) for field in value.fields]
                elif isinstance(value, relax.Var) and index.get(value) in fields:
                    fields[i] = fields[index[value]]
            if not isinstance(binding.var, relax.DataflowVar) and (
                    read_elsewhere is None or binding.var in read_elsewhere):
                self.protected |= roots[i]
        self.protected |= set(outer.values())
        self.size = [sum(self.root_bytes[r] for r in rs) for rs in self.allocates]  # bytes each allocates
        # An in-place call stays after every reader of what it overwrites that came before it,
        # and before every reader that came after it (which sees the new values).
        self.readers: dict[int, list[int]] = {}
        for i in range(n):
            for r in self.reads[i]:
                self.readers.setdefault(r, []).append(i)
        for i, binding in enumerate(bindings):
            if isinstance(binding.value, relax.Call) and binding.value.op.same_as(_INPLACE):
                for r in roots[i]:
                    for j in self.readers.get(r, ()):
                        if j < i:
                            self.deps[i].add(j)
                        elif j > i:
                            self.deps[j].add(i)

    def root_size(self, r: int) -> int:
        return self.root_bytes[r]

    def peak(self, order: list[int]) -> int:
        """Peak bytes of live tensors when the bindings run in `order`."""
        last: dict[int, int] = {}
        for step, b in enumerate(order):
            for r in self.reads[b]:
                last[r] = step
        dying: list[list[int]] = [[] for _ in order]
        for step, b in enumerate(order):
            for r in self.allocates[b]:
                if self.root_bytes[r] and r not in self.protected:
                    dying[last.get(r, step)].append(r)
        live = peak = 0
        for step, b in enumerate(order):
            live += self.size[b]
            peak = max(peak, live)
            live -= sum(self.root_bytes[r] for r in dying[step])
        return peak


def _bytes(ty: object) -> int:
    """A result's bytes; a dynamic batch's tensor counted at REFERENCE_BATCH rows (as
    CompressMemory weighs it), so that the order is not blind to every activation of a
    dynamic-batch graph."""
    size = bytes_per_unit(ty)
    if size is None:
        return 0
    nbytes, unit = size
    return nbytes if unit is None else nbytes * REFERENCE_BATCH


def straighten(model: BlockModel) -> list[int]:
    """The greedy order described in the module docstring, as binding indices."""
    n = model.n
    remaining = {r: len(set(bs)) for r, bs in model.readers.items()}
    unscheduled_readers = {r: set(bs) for r, bs in model.readers.items()}
    waiting = [len(d) for d in model.deps]
    users: list[list[int]] = [[] for _ in range(n)]
    for i, deps in enumerate(model.deps):
        for j in deps:
            users[j].append(i)
    ready = [False] * n
    done = [False] * n

    def net(b: int) -> int:
        freed = sum(model.root_size(r) for r in model.reads[b]
                    if remaining[r] == 1 and r not in model.protected)
        return model.size[b] - freed

    freeing: list[tuple[int, int]] = []  # (net, index) of ready bindings with net <= 0
    # Ready bindings by when they are first needed: the original index of their first user
    # (their own index if unused). Forward chains keep their order; a recomputation that an
    # earlier pass hoisted into the forward pass waits for the backward step that reads it
    # (measured: the benchmark transformer's step 51 -> 49 MiB; following chains of users
    # further made it 51 again).
    needed = [min(users[b], default=b) for b in range(n)]
    in_order: list[tuple[int, int]] = []

    def make_ready(b: int) -> None:
        ready[b] = True
        heapq.heappush(in_order, (needed[b], b))
        gain = net(b)
        if gain <= 0:
            heapq.heappush(freeing, (gain, b))

    for b in range(n):
        if waiting[b] == 0:
            make_ready(b)
    order: list[int] = []
    while len(order) < n:
        b = -1
        while freeing:
            gain, candidate = heapq.heappop(freeing)
            if not done[candidate] and gain == net(candidate):
                b = candidate
                break
        if b < 0:
            while done[in_order[0][1]]:
                heapq.heappop(in_order)
            b = heapq.heappop(in_order)[1]
        done[b] = True
        order.append(b)
        for r in model.reads[b]:
            remaining[r] -= 1
            unscheduled_readers[r].discard(b)
            if remaining[r] == 1:
                (last,) = unscheduled_readers[r]
                if ready[last] and not done[last] and net(last) <= 0:
                    heapq.heappush(freeing, (net(last), last))
        for u in users[b]:
            waiting[u] -= 1
            if waiting[u] == 0:
                make_ready(u)
    return order


@mutator
class _Straightener(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.before = 0  # peak live bytes of the current function, max over its blocks
        self.after = 0
        self.read_elsewhere: dict[int, set[relax.Var]] = {}  # per block (by position in the function)
        self.blocks: list[relax.BindingBlock] = []

    def start_function(self, func: relax.Function) -> None:
        """Note, for each block of `func`, what is read outside it."""
        self.before = self.after = 0
        self.blocks = list(func.body.blocks) if isinstance(func.body, relax.SeqExpr) else []
        reads = [set(v for b in block.bindings for v in vars_in(b.value)) for block in self.blocks]
        result = set(vars_in(func.body.body)) if self.blocks else set()
        self.read_elsewhere = {k: result.union(*(r for j, r in enumerate(reads) if j != k))
                               for k in range(len(self.blocks))}

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        bindings = list(block.bindings)
        k = next((k for k, b in enumerate(self.blocks) if b.same_as(block)), None)
        model = BlockModel(bindings, self.mod, self.read_elsewhere.get(k) if k is not None else None)
        order = straighten(model)
        before, after = model.peak(list(range(len(bindings)))), model.peak(order)
        if after < before:
            block = relax.DataflowBlock([bindings[i] for i in order], block.span)
        self.before = max(self.before, before)
        self.after = max(self.after, min(before, after))
        return super().visit_dataflow_block_(block)


@tvm.transform.module_pass(opt_level=0, name="StraightenBindings")
class StraightenBindings:
    """Reorder dataflow bindings to lower the peak of live tensors (enable_straighten_algorithm)."""

    def __init__(self, enabled: bool = True, report: Callable[[str], None] | None = None):
        self.enabled = enabled
        self.report = report or (lambda msg: logger.info("%s", msg))

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.enabled:
            return mod
        straightener = _Straightener(mod)
        changes = []
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                straightener.start_function(func)
                straightener.builder_.update_func(gv, straightener.visit_expr(func))
                if straightener.after < straightener.before:
                    changes.append(f"{gv.name_hint} {format_bytes(straightener.before)} -> "
                                   f"{format_bytes(straightener.after)}")
        self.report("StraightenBindings: peak live memory " + ("; ".join(changes) or "unchanged"))
        return straightener.builder_.get()

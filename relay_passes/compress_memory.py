"""CompressMemory: one arena per function, packed by lifetimes, with in-place element-wise kernels.

Position: after `CallTIRRewrite` (every kernel result is an explicit `R.builtin.alloc_tensor`
passed to the kernel), before `StaticPlanBlockMemory`, which then plans only what is left.

`StaticPlanBlockMemory` reuses a freed storage only for a tensor of the same dtype and within
16x of its size, and a storage lives from its first tensor to its last: in a training step a
storage first used for a 256 KiB activation may be enlarged to hold a 4 MiB gradient and stay
live in between. This pass instead
  1. finds each tensor's lifetime: from its `alloc_tensor` to the last binding that uses it or
     an alias of it (a variable bound to it, a tuple holding it, a reshape view);
  2. in-place: when a kernel reads a tensor at its last use and writes a result of the same
     size and dtype, and the kernel is element-wise between the two (one block reads the input
     and writes the result at the same element, each once; `inplace_safe`), the result takes
     the input's memory;
  3. packs all tensors into one arena (each at the lowest offset free for its whole lifetime,
     placed biggest first as TFLite does, by first use, and by size x lifetime: the smallest
     arena of the three is kept; 64-byte aligned);
  4. keeps the arena only where it plans fewer bytes than `StaticPlanBlockMemory` does.
A dynamic batch: a tensor whose size is a constant times one symbolic variable n ((n, 3, 32, 32),
(n * 128, 256)) goes into a second arena, packed the same way in bytes per unit of n, whose size
and offsets are those numbers times n at run time (without it, each such tensor was its own
allocation and the CNN's element-wise kernels ran 2-3x slower than in the static graph's arena,
where a result written over its input stays in cache). The two plans are weighed at n = 64.
Tensors are left to `StaticPlanBlockMemory` when they escape (returned, passed to anything but a
TIR kernel or a view, used inside `if`), have another symbolic size or a non-global scope.

Why in-place here, on fused and scheduled kernels, and not TVM's `DataflowUseInplaceCalls` on
Relax ops before LegalizeOps (measured on the benchmark training steps): that pass fails on the
CNN and the transformer ("In-place index 0 is out of range"), and on the MLP the in-place calls
it makes are opaque to fusion and to the CPU schedules: 33x slower steps. Here it costs
nothing, but on the benchmarks it lowers no peak either: 39 of the CNN step's kernels write in
place, none of them where the step peaks (the end of the forward pass, where no element-wise
input dies); it pays where an element-wise kernel runs at a function's peak.

Kill switch: `GraphConfig.enable_compress_memory(False)`. Report: planned bytes per function,
before (StaticPlanBlockMemory) and after. Cost: linear in bindings plus the pairs of tensors
live at the same time.

Limits: CPU (LLVM) targets; on GPU targets the pass does nothing, since RewriteCUDAGraph, which
runs next there, is untested with an arena of offset views.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm import ir, relax, s_tir, tirx
from tvm.sym import Analyzer

from tvmgraph.debug import logger
from tvmgraph.schedules.loops import REFERENCE_BATCH, at_reference_batch

from .bindings import vars_in
from .tensor_sizes import bytes_per_unit, format_bytes

ALIGN = 64  # bytes; TVM's kAllocAlignment, which kernels assume for their buffers
_ALLOC = tvm.ir.Op.get("relax.builtin.alloc_tensor")
_ALIASES = (relax.Var, relax.Tuple, relax.TupleGetItem)  # bindings that name what they read
_VIEWS = [tvm.ir.Op.get(f"relax.{name}")  # bindings that are views of their first argument
          for name in ("reshape", "memory.view", "memory.ensure_zero_offset")]


# ---- which kernels may write a result over an input ----

def _point(region: tirx.BufferRegion) -> list[tirx.PrimExpr] | None:
    """The indices of a single-element region, else None."""
    if not all(isinstance(r.extent, tirx.IntImm) and int(r.extent) == 1 for r in region.region):
        return None
    return [r.min for r in region.region]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _flat(index: list[tirx.PrimExpr], shape: list[tirx.PrimExpr]) -> tirx.PrimExpr:
    """The row-major element offset of `index` in a buffer of `shape`."""
    offset = tirx.IntImm("int64", 0)
    for i, extent in zip(index, shape):
        offset = offset * tirx.Cast("int64", extent) + tirx.Cast("int64", i)
    return offset


def _same_element(block: s_tir.SBlock, a: tirx.Buffer, a_index: list, b: tirx.Buffer, b_index: list) -> bool:
    """Whether `a[a_index]` and `b[b_index]` are the same element of one memory for every
    instance of `block`: the same index, or one reshaped (a GELU gradient that reads
    (8, 128, 1024) tensors and writes their (1024, 1024) reshape)."""
    if _same(list(a.shape), list(b.shape)) and _same(a_index, b_index):
        return True
    analyzer = Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    return analyzer.can_prove_equal(_flat(a_index, list(a.shape)), _flat(b_index, list(b.shape)))


def inplace_safe(func: tirx.PrimFunc, src: int, dst: int) -> bool:
    """Whether `func` computes the same when parameter `dst` is stored in parameter `src`'s memory.

    True when the two have the same dtype and number of elements and exactly one block touches
    either: a spatial block, run once per index (its iteration binding is a bijection of its
    loops), that reads `src` and writes `dst` only at a single element, the same one of the
    shared memory (the same index, or the same row-major offset when one is a reshape of the
    other), and never writes `src` or reads `dst`. Each element of `dst` is then written after
    the only read of `src` at that element.
    """
    a, b = func.params[src], func.params[dst]
    if a.dtype != b.dtype or not Analyzer().can_prove_equal(math.prod(a.shape), math.prod(b.shape)):
        return False
    touching: list[tuple[s_tir.SBlockRealize, list[tirx.For]]] = []
    loops: list[tirx.For] = []
    uses = {"a": 0, "b": 0}

    def on_for(node: tirx.For, visitor) -> object:
        loops.append(node)
        result = visitor.default_visit(node)
        loops.pop()
        return result

    def on_realize(node: s_tir.SBlockRealize, visitor) -> object:
        block = node.block
        if any(r.source.same_as(a) or r.source.same_as(b) for r in [*block.reads, *block.writes]):
            touching.append((node, list(loops)))
        return visitor.default_visit(node)

    def on_var(node: ir.Var, visitor) -> object:
        uses["a"] += node.same_as(a)
        uses["b"] += node.same_as(b)
        return visitor.default_visit(node)

    tvm_ffi.structural_visit(func.body, [(tirx.For, on_for), (s_tir.SBlockRealize, on_realize),
                                         (ir.Var, on_var)])
    if len(touching) != 1:
        return False
    realize, enclosing = touching[0]
    block = realize.block
    if block.init is not None or any(int(iv.iter_type) != 0 for iv in block.iter_vars):
        return False
    reads = [r for r in block.reads if r.source.same_as(a)]
    writes = [r for r in block.writes if r.source.same_as(b)]
    if (len(reads) != 1 or len(writes) != 1 or any(r.source.same_as(b) for r in block.reads)
            or any(r.source.same_as(a) for r in block.writes)):
        return False
    index, read_index = _point(writes[0]), _point(reads[0])
    if index is None or read_index is None or not _same_element(block, a, read_index, b, index):
        return False
    # Every access in the body is at that index, and the buffers appear nowhere else.
    loads, stores, bad = [], [], []

    def on_load(node: ir.TensorLoad) -> None:
        if node.source.same_as(a):
            loads.append(node)
        elif node.source.same_as(b):
            bad.append(node)

    def on_store(node: tirx.BufferStore) -> None:
        if node.buffer.same_as(b):
            stores.append(node)
        elif node.buffer.same_as(a):
            bad.append(node)

    tvm_ffi.structural_walk(block.body, [(ir.TensorLoad, on_load), (tirx.BufferStore, on_store)])
    if (bad or not stores or not all(_same(list(x.indices), read_index) for x in loads)
            or not all(_same(list(x.indices), index) for x in stores)):
        return False
    if uses["a"] != 1 + len(loads) or uses["b"] != 1 + len(stores):
        return False
    # Each block instance runs once: its iteration values are a bijection of its loops.
    domain = {loop.loop_var: tvm.ir.Range.from_min_extent(loop.min, loop.extent) for loop in enclosing}
    if not realize.iter_values:
        return not domain
    mapped = tvm.sym.detect_iter_map(list(realize.iter_values), domain, realize.predicate,
                                     check_level="bijective")
    return len(mapped.indices) > 0


# ---- lifetimes ----

@dataclass
class Tensor:
    """One planned `alloc_tensor`: its binding position, last use and bytes."""

    var: relax.Var
    start: int
    end: int
    nbytes: int
    key: tuple  # (device index, scope): tensors of one arena
    group: Tensor | None = None  # the tensor whose memory it takes (in-place), if any
    offset: int = -1

    def root(self) -> Tensor:
        t = self
        while t.group is not None:
            t = t.group
        return t


@dataclass
class FunctionPlan:
    """The tensors of one function and where each goes."""

    tensors: dict[relax.Var, Tensor] = field(default_factory=dict)
    inplace: int = 0
    arena_bytes: dict[tuple, int] = field(default_factory=dict)


def _const_int(expr: relax.Expr) -> int | None:
    return int(expr.value) if isinstance(expr, tirx.IntImm) else None


def analyze(mod: tvm.IRModule, func: relax.Function, inplace: bool = True) -> FunctionPlan:
    """Lifetimes of the function's plannable tensors, and which results take an input's memory."""
    plan = FunctionPlan()
    bindings = [b for block in func.body.blocks for b in block.bindings]
    alias: dict[relax.Var, set[relax.Var]] = {}  # var -> planned tensors it may refer to
    escaped: set[relax.Var] = set()
    first_use: dict[relax.Var, int] = {}
    kernel_calls = []  # (position, PrimFunc, GlobalVar, tensors each argument refers to)

    fields: dict[relax.Var, list[set[relax.Var]]] = {}  # a tuple var -> what each field refers to

    def refs(expr: relax.Expr) -> set[relax.Var]:
        if isinstance(expr, relax.TupleGetItem) and expr.tuple_value in fields:
            return set(fields[expr.tuple_value][expr.index])  # one result of a multi-result kernel
        found: set[relax.Var] = set()
        for var in vars_in(expr):
            found |= alias.get(var, set())
        return found

    for pos, binding in enumerate(bindings):
        value = binding.value
        if isinstance(value, relax.Call) and value.op.same_as(_ALLOC):
            size = bytes_per_unit(binding.var.ty)
            device, scope = _const_int(value.args[2]), getattr(value.args[3], "value", None)
            if size and size[0] and scope == "global" and device is not None:
                nbytes, unit = size  # a dynamic batch's tensors go in an arena of `unit` rows
                key = (device, scope) if unit is None else (device, scope, unit)
                plan.tensors[binding.var] = Tensor(binding.var, pos, pos, nbytes, key)
                alias[binding.var] = {binding.var}
            continue
        if isinstance(binding, relax.MatchCast) or isinstance(value, _ALIASES):
            alias[binding.var] = refs(value)
            if isinstance(value, relax.Tuple):
                fields[binding.var] = [refs(field) for field in value.fields]
            elif isinstance(value, relax.Var) and value in fields:
                fields[binding.var] = fields[value]
        elif isinstance(value, relax.Call) and any(value.op.same_as(op) for op in _VIEWS):
            alias[binding.var] = refs(value.args[0])
        elif isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar) and \
                isinstance(mod[value.op], tirx.PrimFunc):
            targets = [refs(arg) for arg in value.args]
            kernel_calls.append((pos, mod[value.op], value.op, list(value.args), targets))
        else:  # anything else may keep a reference: leave its tensors to StaticPlanBlockMemory
            escaped |= refs(value)
        for t in refs(value):
            plan.tensors[t].end = pos
            first_use.setdefault(t, pos)
    escaped |= refs(func.body.body)
    for var in escaped:
        plan.tensors.pop(var, None)
    if inplace:
        cache: dict[tuple, bool] = {}
        for pos, prim, gv, args, targets in kernel_calls:
            plan.inplace += _inplace_results(prim, gv, args, targets, plan, first_use, pos, cache)
    return plan


def _inplace_results(prim: tirx.PrimFunc, gv: relax.GlobalVar, args: list, targets: list[set],
                     plan: FunctionPlan, first_use: dict, pos: int, cache: dict) -> int:
    """Let each fresh result of the kernel call at `pos` take the memory of an input read there
    for the last time, where the kernel allows it."""
    counts: dict[relax.Var, int] = {}
    for t in targets:
        for v in t:
            counts[v] = counts.get(v, 0) + 1
    merged = 0
    for dst, out in enumerate(targets):
        if len(out) != 1:
            continue
        (out_var,) = out
        result = plan.tensors.get(out_var)
        if result is None or first_use.get(out_var) != pos or counts[out_var] != 1:
            continue  # not a planned, fresh result of this call
        for src, ins in enumerate(targets):
            if src == dst or len(ins) != 1:
                continue
            (in_var,) = ins
            if in_var not in plan.tensors or counts[in_var] != 1:
                continue
            donor = plan.tensors[in_var].root()
            if (donor.end != pos or donor is result or donor.nbytes != result.nbytes
                    or donor.key != result.key or not _same_dtype(args[src], args[dst])):
                continue
            key = (gv, src, dst)
            if key not in cache:
                cache[key] = inplace_safe(prim, src, dst)
            if cache[key]:
                result.group = donor
                donor.end = result.end  # the group lives on as the result
                merged += 1
                break
    return merged


def _same_dtype(a: relax.Expr, b: relax.Expr) -> bool:
    """Both tensors of one dtype (their sizes are compared by the caller, their shapes may differ:
    inplace_safe checks that the kernel reads and writes the same element)."""
    ta, tb = a.ty, b.ty
    return (isinstance(ta, relax.TensorType) and isinstance(tb, relax.TensorType)
            and ta.dtype.dtype == tb.dtype.dtype)


# ---- packing ----

# Orders in which `pack` places tensors, each greedily at the lowest free offset; the smallest
# arena wins. By size first is TFLite's; it left 2 MiB of the transformer's 7 MiB inference peak
# unused (9 MiB arena), where placing by first use packs it in 7.
_PACKING_ORDERS = (
    lambda t: (-t.nbytes, t.start),               # biggest first
    lambda t: (t.start, -t.nbytes),               # in order of first use
    lambda t: (-t.nbytes * (t.end - t.start + 1), t.start),  # biggest size x lifetime first
)


def pack(plan: FunctionPlan) -> None:
    """Give every group of tensors an offset in its arena: greedy placement in each of
    _PACKING_ORDERS, the smallest arena kept (per arena)."""
    groups: dict[int, Tensor] = {}
    for tensor in plan.tensors.values():
        root = tensor.root()
        groups[id(root)] = root
    for root in groups.values():
        root.nbytes = -(-root.nbytes // ALIGN) * ALIGN
    by_start = sorted(groups.values(), key=lambda t: t.start)
    conflicts: dict[int, list[Tensor]] = {id(t): [] for t in by_start}
    for i, t in enumerate(by_start):  # every pair live at the same time, in O(n + pairs)
        for u in by_start[i + 1:]:
            if u.start > t.end:
                break
            if u.key == t.key:
                conflicts[id(t)].append(u)
                conflicts[id(u)].append(t)
    plan.arena_bytes = {}
    by_key: dict[tuple, list[Tensor]] = {}
    for t in by_start:
        by_key.setdefault(t.key, []).append(t)
    for key, tensors in by_key.items():
        best: tuple[int, dict[int, int]] | None = None
        for order in _PACKING_ORDERS:
            offsets = _place(sorted(tensors, key=order), conflicts)
            size = max(offsets[id(t)] + t.nbytes for t in tensors)
            if best is None or size < best[0]:
                best = (size, offsets)
        assert best is not None
        for t in tensors:
            t.offset = best[1][id(t)]
        plan.arena_bytes[key] = best[0]
    for tensor in plan.tensors.values():
        tensor.offset = tensor.root().offset


def _place(order: list[Tensor], conflicts: dict[int, list[Tensor]]) -> dict[int, int]:
    """Offsets (by tensor id) placing each tensor of `order` in turn at the lowest offset that no
    tensor placed before it and live at the same time occupies."""
    offsets: dict[int, int] = {}
    for t in order:
        taken = sorted((offsets[id(u)], offsets[id(u)] + u.nbytes) for u in conflicts[id(t)] if id(u) in offsets)
        offset = 0
        for lo, hi in taken:
            if lo - offset >= t.nbytes:
                break
            offset = max(offset, hi)
        offsets[id(t)] = offset
    return offsets


def check_plan(plan: FunctionPlan) -> list[str]:
    """Invariant: no two tensors live at the same time share a byte (in-place pairs aside)."""
    problems = []
    tensors = sorted(plan.tensors.values(), key=lambda t: t.start)
    for i, t in enumerate(tensors):
        for u in tensors[i + 1:]:
            if u.start > t.end:
                break
            same_group = t.root() is u.root()
            overlap = t.key == u.key and t.offset < u.offset + u.nbytes and u.offset < t.offset + t.nbytes
            if overlap and not same_group:
                problems.append(f"{t.var.name} [{t.start}, {t.end}] and {u.var.name} [{u.start}, {u.end}] "
                                f"overlap at offsets {t.offset} and {u.offset}")
    return problems


# ---- rewriting ----

@relax.expr_functor.mutator
class _Rewriter(relax.expr_functor.PyExprMutator):
    """Each planned `alloc_tensor` becomes a tensor at its offset in its function's arena."""

    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.plan: FunctionPlan | None = None
        self.arenas: dict[tuple, relax.Var] = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        tensor = self.plan.tensors.get(binding.var) if self.plan is not None else None
        if tensor is None:
            return super().visit_var_binding_(binding)
        unit = arena_unit(tensor.key)
        scaled = (lambda b: b) if unit is None else (lambda b: unit * tirx.IntImm("int64", b))
        if tensor.key not in self.arenas:
            device, scope = tensor.key[:2]
            storage = relax.op.memory.alloc_storage(relax.ShapeExpr([scaled(self.plan.arena_bytes[tensor.key])]),
                                                    device, scope, "uint8")
            self.arenas[tensor.key] = self.builder_.emit(storage, name_hint="arena")
        shape, dtype, device = binding.value.args[0], binding.value.args[1], binding.value.args[2]
        offset = tensor.offset if unit is None else relax.prim_value(scaled(tensor.offset))
        value = relax.op.memory.alloc_tensor(self.arenas[tensor.key], offset, shape, dtype, device)
        if tensor.offset:
            # Kernels require byte_offset == 0: make the offset part of the data pointer (a
            # view on CPU and CUDA, where the host may do arithmetic on device addresses).
            at_offset = self.builder_.emit(value, name_hint=f"{binding.var.name}_at")
            value = relax.op.memory.ensure_zero_offset(at_offset)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))

    def rewrite(self, func: relax.Function, plan: FunctionPlan) -> relax.Function:
        self.plan, self.arenas = plan, {}
        try:
            return self.visit_expr(func)
        finally:
            self.plan = None


def arena_unit(key: tuple) -> tirx.Var | None:
    """The symbolic variable an arena's bytes and offsets are multiples of (a dynamic batch), if any."""
    return key[2] if len(key) > 2 else None


def _planned_bytes(func: relax.Function) -> int:
    """Bytes of all `memory.alloc_storage`s of a function planned by StaticPlanBlockMemory (a
    symbolic size at REFERENCE_BATCH)."""
    total = 0
    alloc_storage = tvm.ir.Op.get("relax.memory.alloc_storage")

    def visit(expr: relax.Expr) -> None:
        nonlocal total
        if isinstance(expr, relax.Call) and expr.op.same_as(alloc_storage):
            size = expr.args[0]
            if isinstance(size, relax.ShapeExpr):
                total += at_reference_batch(math.prod(size.values, start=tirx.IntImm("int64", 1))) or 0

    relax.analysis.post_order_visit(func.body, visit)
    return total


def _arena_bytes(plan: FunctionPlan) -> int:
    """Bytes of the plan's arenas (an arena of a symbolic unit at REFERENCE_BATCH of it)."""
    return sum(nbytes * (1 if arena_unit(key) is None else REFERENCE_BATCH) for key, nbytes in plan.arena_bytes.items())


def _format_arenas(plan: FunctionPlan) -> str:
    return " + ".join(format_bytes(nbytes) + ("" if arena_unit(key) is None else f" x {arena_unit(key).name}")
                      for key, nbytes in plan.arena_bytes.items())


@tvm.transform.module_pass(opt_level=0, name="CompressMemory")
class CompressMemory:
    """Plan intermediate tensors into one arena per function (enable_compress_memory)."""

    def __init__(self, enabled: bool = True, report: Callable[[str], None] | None = None,
                 inplace: bool = True):
        self.enabled = enabled
        self.inplace = inplace
        self.report = report or (lambda msg: logger.info("%s", msg))

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.enabled:
            return mod
        target = tvm.target.Target.current()
        if target is not None and "gpu" in target.keys:
            # NOTE: RewriteCUDAGraph captures the storages StaticPlanBlockMemory makes; an arena
            # of views (ensure_zero_offset) is untested there, so GPU programs keep TVM's plan.
            self.report(f"CompressMemory: skipped on {target.kind.name} (StaticPlanBlockMemory plans)")
            return mod
        static = relax.transform.StaticPlanBlockMemory()(mod)  # the plan to beat
        rewriter = _Rewriter(mod)
        lines = []
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            plan = analyze(mod, func, self.inplace)
            if not plan.tensors:
                continue
            pack(plan)
            problems = check_plan(plan)
            assert not problems, f"CompressMemory overlapped tensors in {gv.name_hint}: {problems[:3]}"
            before, after = _planned_bytes(static[gv.name_hint]), _arena_bytes(plan)
            symbolic = any(arena_unit(key) is not None for key in plan.arena_bytes)
            at = f" at {REFERENCE_BATCH} rows" if symbolic else ""
            if after >= before:
                lines.append(f"{gv.name_hint} {format_bytes(before)}{at} kept (arena: {format_bytes(after)})")
                continue
            rewriter.builder_.update_func(gv, rewriter.rewrite(func, plan))
            arenas = f"; arenas {_format_arenas(plan)}" if symbolic else ""
            lines.append(f"{gv.name_hint} {format_bytes(before)} -> {format_bytes(after)}{at} "
                         f"({len(plan.tensors)} tensors in {len(plan.arena_bytes)} arena(s), "
                         f"{plan.inplace} in place{arenas})")
        if lines:
            self.report("CompressMemory: memory planned: " + "; ".join(lines))
        return rewriter.builder_.get()

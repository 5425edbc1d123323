"""RecomputeSharedLayouts: a layout kernel that several element-wise kernels read is redone in
each of them instead of written out once.

    qkv = call_tir(reshape_transpose, (proj,))        q = call_tir(reshape_transpose, (proj,))
    q = call_tir(slice0_scale, (qkv,))          ->    q = call_tir(slice0_scale, (q_qkv,))
    k = call_tir(slice1, (qkv,))                      k_qkv = call_tir(reshape_transpose, (proj,))
                                                      k = call_tir(slice1, (k_qkv,))

FuseOps fuses an injective producer into its reader only when it has one reader: with several
it stays a kernel of its own, which writes its whole result and has each reader read it back.
torch's multi-head attention splits its packed q/k/v projection that way (`unflatten`,
`unsqueeze`, `transpose`, `squeeze`, then `proj[0]`, `proj[1]`, `proj[2]`): a 3 MiB copy per
layer at batch 8 that the three slices read again. A kernel that only moves elements (each of its
blocks stores a plain load of an input) costs nothing to redo inside a reader that moves or
computes element-wise; with one copy per reader, FuseOps fuses each into its reader, which then
reads the projection directly. Readers that are not element-wise (a matmul, a reduction) keep the
kernel as it was: they would not fuse with it, and it would run once per reader.

Only dataflow variables are redone (a block output stays computed once), repeatedly, so that a
chain of layout kernels (reshape, expand_dims, transpose, squeeze) moves into its readers whole.

Position: after AnnotateTIROpPattern (it reads each PrimFunc's op_pattern), before FuseOps.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.expr import TensorLoad

from relay_passes import report_counts

from tvmgraph.schedules.loops import root_blocks

from .bindings import Substitute, rebound, rewrite_dataflow_blocks, vars_in

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_INJECTIVE = 2  # TVM's OpPatternKind: 0 element-wise, 1 broadcast, 2 injective


def _pattern(func: tirx.PrimFunc) -> int | None:
    attrs = func.attrs or {}
    return int(attrs["op_pattern"]) if "op_pattern" in attrs else None


def stores_plain_loads(func: tirx.PrimFunc) -> bool:
    """True when each block of `func` stores a plain load of a buffer: for an injective PrimFunc,
    a reshape, transpose, slice, squeeze or chain of them, with no arithmetic to redo."""
    sch = s_tir.Schedule(func)
    blocks = [sch.get(b) for b in root_blocks(sch)]
    return bool(blocks) and all(isinstance(b.body, tirx.BufferStore) and isinstance(b.body.value, TensorLoad)
                                for b in blocks)


class _Kernels:
    """What the pass asks of the PrimFunc a binding calls, each answer computed once per kernel
    of the module."""

    def __init__(self, mod: tvm.IRModule) -> None:
        self.funcs = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
        self.answers: dict[str, tuple[bool, bool]] = {}

    def _ask(self, value: relax.Expr) -> tuple[bool, bool]:
        """(moves elements only, element-wise or injective) for a call_tir, else (False, False)."""
        if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR)):
            return False, False
        name = value.args[0].name_hint
        if name not in self.answers:
            func = self.funcs.get(name)
            pattern = _pattern(func) if func is not None else None
            injective = pattern is not None and pattern <= _INJECTIVE
            self.answers[name] = (injective and stores_plain_loads(func), injective)
        return self.answers[name]

    def is_layout(self, value: relax.Expr) -> bool:
        return self._ask(value)[0]

    def is_elementwise(self, value: relax.Expr) -> bool:
        return self._ask(value)[1]


def recompute(kernels: _Kernels, block: relax.DataflowBlock) -> tuple[relax.DataflowBlock, int]:
    """`block` with each shared layout kernel redone once per element-wise reader (until none
    is left), and how many copies it made.

    One sweep from the last binding to the first: redoing a binding puts its copies after it,
    reading what it read, so only the readers of earlier bindings change, and those are kept
    up to date as it goes (the block's readers were counted again after every copy before:
    1.2 s on a 2-layer GRU's training step)."""
    bindings = list(block.bindings)
    reads: dict[relax.Binding, set[relax.Var]] = {}

    def read_by(b: relax.Binding) -> set[relax.Var]:
        if b not in reads:
            reads[b] = set(vars_in(b.value))
        return reads[b]

    readers: dict[relax.Var, list[relax.Binding]] = {}  # in block order
    for b in bindings:
        for v in read_by(b):
            readers.setdefault(v, []).append(b)

    def shared(b: relax.Binding) -> bool:
        mine = readers.get(b.var, []) if isinstance(b.var, relax.DataflowVar) else []
        return (len(mine) >= 2 and isinstance(b, relax.VarBinding) and kernels.is_layout(b.value)
                and all(isinstance(r, relax.VarBinding) and kernels.is_elementwise(r.value) for r in mine))

    copies = 0
    for at in reversed(range(len(bindings))):
        layout = bindings[at]
        if not shared(layout):
            continue
        mine = readers.pop(layout.var)
        replaced: dict[relax.Binding, tuple[relax.Binding, relax.Binding]] = {}
        for reader in mine:
            copy = relax.VarBinding(relax.DataflowVar(f"{layout.var.name}_{reader.var.name}", layout.var.ty),
                                    layout.value)
            replaced[reader] = (copy, rebound(reader, Substitute({layout.var: copy.var})))
        # The copies read what the layout kernel read; each rebound reader reads its copy.
        for v in read_by(layout):
            readers[v] = [r for r in readers[v] if r is not layout] + [copy for copy, _ in replaced.values()]
        for reader, (copy, new) in replaced.items():
            reads[copy] = read_by(layout)
            reads[new] = {copy.var} | {v for v in read_by(reader) if not v.same_as(layout.var)}
            readers[copy.var] = [new]
            for v in reads[new] - {copy.var}:
                readers[v] = [new if r is reader else r for r in readers[v]]
        tail = [b for r in bindings[at + 1:] for b in (replaced[r] if r in replaced else (r,))]
        bindings = bindings[:at] + tail
        copies += len(mine)
    return relax.DataflowBlock(bindings), copies


@tvm.transform.module_pass(opt_level=0, name="RecomputeSharedLayouts")
class RecomputeSharedLayouts:
    """Redo a layout kernel read by several element-wise kernels once per reader."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        counts = []
        kernels = _Kernels(mod)

        def rewrite(block: relax.DataflowBlock) -> list[relax.DataflowBlock]:
            block, n = recompute(kernels, block)
            counts.append(n)
            return [block]

        mod, _ = rewrite_dataflow_blocks(mod, rewrite)
        if sum(counts):
            report_counts(self.report, "RecomputeSharedLayouts", {"layout kernel redone in a reader": sum(counts)})
        return mod

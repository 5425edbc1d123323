"""StackStepGradients: gradients summed over the steps of an unrolled loop are computed once,
over the steps stacked.

    dW = A_0^T B_0 + A_1^T B_1 + ... + A_31^T B_31   ->   dW = concat(A_t)^T concat(B_t)
    dx = pad_0(d_0) + pad_1(d_1) + ... + pad_31(d_31) ->   dx = concat(d_0, d_1, ..., d_31)

torch's LSTM and GRU run one cell per time step (an unrolled loop), and autodiff sums each
step's contribution to a gradient as it goes:
- a weight read at every step (the recurrent weight W_hh) gets one small product per step,
  A_t^T B_t with A_t the step's (batch, 4 hidden) gate gradient and B_t its (batch, hidden)
  input: 32 products of depth 16 (the batch), each far below the FMA peak, and 31 adds of the
  whole weight. Stacked, one product of depth 32 x 16;
- a tensor read one step at a time (the input projection, `for x_t in x`) gets each step's
  gradient padded with zeros to the whole tensor, and 31 adds of the whole tensor: 32 reads of
  every element. Where the padded pieces do not overlap, their sum is their concatenation.

Rewritten: an `add` chain (each partial sum a dataflow variable read only by the next add) with
at least MIN_STEPS leaves of one kind:
- `matmul(permute_dims(A_t), B_t)`, 2-D, each read only by the chain, with at most MAX_DEPTH rows
  (a deeper product is efficient already, and stacking keeps every A_t and B_t alive until the
  last step);
- `nn.pad(d_t)` with zeros along one axis only, the padded ranges disjoint.
Other leaves stay added to the result. The sum's order changes (one product accumulates over
all steps): a float32 rounding difference, as between two BLAS libraries.

Position: after SeparateBackward (the sums are in the backward block), before FuseEpilogue
(which groups each matmul with its transposes).
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

from relay_passes import report_counts

from .bindings import rewrite_dataflow_blocks, vars_in

MIN_STEPS = 4
MAX_DEPTH = 64

_ADD = tvm.ir.Op.get("relax.add")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_PAD = tvm.ir.Op.get("relax.nn.pad")


def _static(shape) -> list[int] | None:
    dims = list(shape) if shape is not None else None
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]


def _same_type(a: relax.Expr, b: relax.Expr) -> bool:
    return (isinstance(a.ty, relax.TensorType) and isinstance(b.ty, relax.TensorType)
            and a.ty.dtype == b.ty.dtype and _static(a.ty.shape) is not None
            and _static(a.ty.shape) == _static(b.ty.shape))


class _Block:
    """The bindings of a dataflow block, who reads each variable, and what each binds."""

    def __init__(self, block: relax.DataflowBlock) -> None:
        self.bindings = list(block.bindings)
        self.value = {b.var: b.value for b in self.bindings if isinstance(b, relax.VarBinding)}
        self.readers: dict[relax.Var, int] = {}
        for b in self.bindings:
            for v in vars_in(b.value):
                self.readers[v] = self.readers.get(v, 0) + 1

    def call(self, var: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
        """The call of `op` that dataflow variable `var` binds, if `var` is read once."""
        value = self.value.get(var) if isinstance(var, relax.DataflowVar) else None
        if isinstance(value, relax.Call) and value.op.same_as(op) and self.readers.get(var) == 1:
            return value
        return None

    def leaves(self, root: relax.Call) -> tuple[list[relax.Expr], list[relax.Var]]:
        """The terms of the add chain ending in `root`, and the chain's inner partial sums."""
        terms, inner = [], []
        stack = list(root.args)
        while stack:
            term = stack.pop()
            add = self.call(term, _ADD)
            if add is not None and _same_type(add.args[0], add.args[1]) and _same_type(term, add.args[0]):
                inner.append(term)
                stack.extend(add.args)
            else:
                terms.append(term)
        return terms[::-1], inner

    def product(self, term: relax.Expr) -> tuple[relax.Expr, relax.Expr] | None:
        """(A, B) for a term `matmul(permute_dims(A), B)` of 2-D shallow operands, else None."""
        mm = self.call(term, _MATMUL)
        if mm is None or (mm.attrs.out_dtype is not None and str(mm.attrs.out_dtype) not in ("", "void")):
            return None
        perm = self.call(mm.args[0], _PERMUTE)
        if perm is None:
            return None
        a, b = perm.args[0], mm.args[1]
        sa, sb = (_static(x.ty.shape) if isinstance(x.ty, relax.TensorType) else None for x in (a, b))
        if sa is None or sb is None or len(sa) != 2 or len(sb) != 2 or sa[0] != sb[0] or sa[0] > MAX_DEPTH:
            return None
        axes = perm.attrs.axes
        if axes is not None and [int(x) for x in axes] != [1, 0]:
            return None
        return a, b

    def pad(self, term: relax.Expr) -> tuple[relax.Expr, int, int] | None:
        """(d, axis, offset) for a term `pad(d)` with zeros along one axis only, else None."""
        call = self.call(term, _PAD)
        if call is None or str(call.attrs.pad_mode) != "constant" or float(call.attrs.pad_value) != 0.0:
            return None
        widths = [int(w) for w in call.attrs.pad_width]
        padded = [axis for axis in range(len(widths) // 2) if widths[2 * axis] or widths[2 * axis + 1]]
        if len(padded) != 1 or _static(call.args[0].ty.shape) is None:
            return None
        return call.args[0], padded[0], widths[2 * padded[0]]


def _stacked_product(pairs: list[tuple[relax.Expr, relax.Expr]]) -> relax.Expr:
    a = relax.op.concat([p[0] for p in pairs], axis=0)
    b = relax.op.concat([p[1] for p in pairs], axis=0)
    return relax.op.matmul(relax.op.permute_dims(a, [1, 0]), b)


def _concatenated_pads(pieces: list[tuple[relax.Expr, int, int]], full: list[int], dtype: str) -> relax.Expr | None:
    """The pieces (d, axis, offset) concatenated along their axis, zeros where none is; None
    when they overlap."""
    axis = pieces[0][1]
    parts, at = [], 0
    for d, _, offset in sorted(pieces, key=lambda p: p[2]):
        if offset < at:
            return None
        if offset > at:
            parts.append(relax.op.zeros([*full[:axis], offset - at, *full[axis + 1:]], dtype))
        parts.append(d)
        at = offset + _static(d.ty.shape)[axis]
    if at < full[axis]:
        parts.append(relax.op.zeros([*full[:axis], full[axis] - at, *full[axis + 1:]], dtype))
    return relax.op.concat(parts, axis=axis)


def rewrite(block: relax.DataflowBlock) -> tuple[relax.DataflowBlock, dict[str, int]]:
    """`block` with each stackable add chain rewritten, and how many of each kind."""
    info = _Block(block)
    counts: dict[str, int] = {}
    replaced: dict[relax.Var, relax.Expr] = {}  # chain root -> its new value
    orphans: set[relax.Var] = set()
    inner_of_some_chain: set[relax.Var] = set()
    for b in reversed(info.bindings):  # roots first: a chain's inner sums are not roots
        if b.var in inner_of_some_chain or not isinstance(b, relax.VarBinding):
            continue
        value = b.value
        if not (isinstance(value, relax.Call) and value.op.same_as(_ADD) and _same_type(value.args[0], value.args[1])
                and _same_type(b.var, value.args[0])):
            continue
        terms, inner = info.leaves(value)
        inner_of_some_chain.update(inner)
        products = [(t, p) for t in terms if (p := info.product(t)) is not None]
        pads = [(t, p) for t in terms if (p := info.pad(t)) is not None]
        by_axis: dict[int, list] = {}
        for t, p in pads:
            by_axis.setdefault(p[1], []).append((t, p))
        pads = max(by_axis.values(), key=len) if by_axis else []
        new_terms, used = [], set()
        if len(products) >= MIN_STEPS and len({(str(a.ty.dtype), _static(a.ty.shape)[1], _static(b_.ty.shape)[1])
                                                for _, (a, b_) in products}) == 1:
            new_terms.append(_stacked_product([p for _, p in products]))
            used.update(t for t, _ in products)
            counts["products stacked"] = counts.get("products stacked", 0) + len(products)
        if len(pads) >= MIN_STEPS:
            full = _static(b.var.ty.shape)
            stacked = _concatenated_pads([p for _, p in pads], full, str(b.var.ty.dtype))
            if stacked is not None:
                new_terms.append(stacked)
                used.update(t for t, _ in pads)
                counts["padded steps concatenated"] = counts.get("padded steps concatenated", 0) + len(pads)
        if not used:
            continue
        rest = [t for t in terms if t not in used]
        total = new_terms[0]
        for term in [*new_terms[1:], *rest]:
            total = relax.op.add(total, term)
        replaced[b.var] = total
        orphans.update(inner)
        orphans.update(used)
    if not replaced:
        return block, counts
    bindings = [relax.VarBinding(b.var, replaced[b.var]) if b.var in replaced else b for b in info.bindings]
    return relax.DataflowBlock(_without_orphans(bindings, orphans)), counts


def _without_orphans(bindings: list[relax.Binding], orphans: set[relax.Var]) -> list[relax.Binding]:
    """`bindings` without those the rewrite left unread: the old partial sums and terms, and
    then whatever only they read (the terms' transposes), repeatedly. NOTE: reads are counted
    once and taken back as bindings go; a rescan per layer of the chain took the GRU's
    training graph 33 scans of 5000 bindings."""
    readers: dict[relax.Var, int] = {}
    for b in bindings:
        for v in vars_in(b.value):
            readers[v] = readers.get(v, 0) + 1
    value = {b.var: b.value for b in bindings}
    dead: set[relax.Var] = set()
    pending = [v for v in orphans if v in value and not readers.get(v)]
    while pending:
        var = pending.pop()
        if var in dead:
            continue
        dead.add(var)
        for v in vars_in(value[var]):
            readers[v] -= 1
            if not readers[v] and v in value and (v in orphans or isinstance(v, relax.DataflowVar)):
                pending.append(v)
    return [b for b in bindings if b.var not in dead]


@tvm.transform.module_pass(opt_level=0, name="StackStepGradients")
class StackStepGradients:
    """Sum a gradient's per-step products and padded pieces once, over the stacked steps."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        totals: dict[str, int] = {}

        def each(block: relax.DataflowBlock) -> list[relax.DataflowBlock]:
            block, counts = rewrite(block)
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            return [block]

        mod, _ = rewrite_dataflow_blocks(mod, each)
        report_counts(self.report, "StackStepGradients", totals)
        return mod

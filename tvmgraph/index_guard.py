"""Range checks of index inputs, on the torch side, before the compiled program runs.

An out-of-range index makes eager torch raise IndexError; a compiled kernel has no such check
and reads (or writes) outside its buffer: wrong numbers at best, SIGSEGV at worst. So at
trace time `IndexGuard.of` follows every index operand of an indexing op (embedding,
embedding bags' indices and offsets, index_select, gather, scatter, take, `x[idx]`, `x[i]`
with a 0-d `i`, cross-entropy / nll-loss labels, multi-margin and multilabel-margin targets,
max_unpool's indices, one_hot's classes, whose in-graph assertion lower.py drops) back through
value-preserving ops (views, casts, `where(y != ignore_index, y, 0)`, ...) to the user inputs
it comes from, and records the range the op accepts; each call then takes one `aminmax` of each
such input and raises `IndexOutOfRangeError` (an IndexError) naming the graph, the input and
the op, instead of running.

Indices computed inside the graph are not checked here; the converters (converters.py) clamp
or wrap them in the kernels so that they can never address memory outside the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .advanced_indexing import is_mask
from .errors import IndexOutOfRangeError
from .lower import module_path, op_key

# Ops whose result holds the values of the first tensor argument (or of every tensor in a list
# argument): an index flows through them unchanged.
_PASS_THROUGH = {
    "view.default", "_unsafe_view.default", "reshape.default", "unsqueeze.default", "squeeze.default",
    "squeeze.dim", "squeeze.dims", "expand.default", "clone.default", "alias.default", "detach.default",
    "contiguous.default", "permute.default", "transpose.int", "t.default", "flatten.using_ints",
    "unflatten.int", "slice.Tensor", "select.int", "_to_copy.default", "to.dtype", "to.dtype_layout",
    "lift_fresh_copy.default", "repeat.default", "cat.default", "stack.default", "narrow.default",
}
_CLASS_LOSSES = {"cross_entropy_loss.default": 4, "nll_loss_nd.default": 4, "nll_loss.default": 4,
                 "nll_loss_forward.default": 4, "nll_loss2d.default": 4, "nll_loss2d_forward.default": 4}
_DIM_INDEXED = {"index_select.default", "gather.default", "scatter.src", "scatter.value", "scatter.reduce",
                "scatter.value_reduce", "scatter_add.default", "scatter_reduce.two", "index_add.default",
                "index_copy.default", "index_fill.int_Scalar", "index_fill.int_Tensor"}


@dataclass(frozen=True)
class IndexRange:
    """Values an indexing op accepts from one user input: `low <= v < high`, or `v == exempt`."""

    position: int  # in the graph's flat user inputs
    name: str
    op: str  # "aten.embedding from 'model.emb' (Embedding)"
    low: int
    high: int
    exempt: int | None = None

    def valid(self) -> str:
        text = f"{self.low}..{self.high - 1}"
        return text if self.exempt is None else f"{text}, or {self.exempt} (ignore_index)"


def _size(node: torch.fx.Node, dim: int | None = None) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    size = val.numel() if dim is None else (val.shape[dim] if val.dim() else 1)
    return size if isinstance(size, int) else None  # a symbolic size is not checked


def _index_operands(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, int, int, int | None]]:
    """(index operand, low, high, exempt) for each index operand of an indexing op."""
    key, args = op_key(node), node.args
    if key == "embedding.default":
        size = _size(args[0], 0)
        if size is not None:
            yield args[1], 0, size, None
    elif key in _DIM_INDEXED:
        size = _size(args[0], args[1])
        if size is not None and isinstance(args[2], torch.fx.Node):
            yield args[2], 0, size, None
    elif key in ("index.Tensor", "index_put.default", "index_put_.default"):
        for dim, index in enumerate(args[1]):
            if index is not None and is_mask(index):
                return  # a boolean mask: torch checks its shape at trace time; dims after it shift
            size = _size(args[0], dim) if index is not None else None
            if size is not None:
                yield index, -size, size, None  # negative indices count from the end, as in Python
    elif key == "select.int" and isinstance(args[2], torch.fx.Node) and args[2].op == "call_function" \
            and op_key(args[2]) in ("item.default", "_local_scalar_dense.default"):
        size = _size(args[0], args[1])  # `x[i]` with `i` a 0-d tensor: select(x, dim, i.item())
        if size is not None:
            yield args[2].args[0], -size, size, None
    elif key == "take.default":
        size = _size(args[0])
        if size is not None:
            yield args[1], -size, size, None
    elif key == "one_hot.default":
        classes = args[1] if len(args) > 1 else node.kwargs.get("num_classes", -1)
        if isinstance(classes, int) and classes > 0:
            yield args[0], 0, classes, None
    elif key in ("embedding_bag.default", "embedding_bag.padding_idx", "_embedding_bag.default",
                 "_embedding_bag_forward_only.default"):
        size, count = _size(args[0], 0), _size(args[1])
        if size is not None:
            yield args[1], 0, size, None
        if count is not None and isinstance(args[2], torch.fx.Node):
            yield args[2], 0, count + 1, None  # offsets: where each bag starts, at most the count
    elif key in ("max_unpool2d.default", "max_unpool3d.default"):
        planes = args[2] if len(args) > 2 else node.kwargs.get("output_size")
        if isinstance(planes, (list, tuple)) and all(isinstance(d, int) for d in planes):
            yield args[1], 0, math.prod(planes), None  # a flat position in one output plane
    elif key in ("multi_margin_loss.default", "multilabel_margin_loss.default",
                 "multilabel_margin_loss_forward.default"):
        classes = _size(args[0], -1)
        if classes is not None:  # a multilabel target's -1 ends its list of labels
            yield args[1], 0 if key.startswith("multi_margin") else -1, classes, None
    elif key in _CLASS_LOSSES:
        val = args[0].meta.get("val")
        ignore_at = _CLASS_LOSSES[key]
        ignore = args[ignore_at] if len(args) > ignore_at else node.kwargs.get("ignore_index", -100)
        if isinstance(val, torch.Tensor):
            size = _size(args[0], 1 if val.dim() >= 2 else 0)
            if size is not None:
                yield args[1], 0, size, int(ignore)


def _sources(node: torch.fx.Node, exempt: int | None) -> Iterator[tuple[torch.fx.Node, int | None]]:
    """The placeholders whose values reach `node` unchanged, each with the value it may hold
    outside the range (kept out by a `where(v != exempt, v, other)` on the way)."""
    if not isinstance(node, torch.fx.Node):
        return
    if node.op == "placeholder":
        yield node, exempt
        return
    if node.op != "call_function":
        return
    key = op_key(node)
    if key == "where.self":
        cond, a, b = node.args[:3]
        guarded = (isinstance(cond, torch.fx.Node) and cond.op == "call_function"
                   and op_key(cond) == "ne.Scalar" and cond.args[0] is a)
        yield from _sources(a, int(cond.args[1]) if guarded else exempt)
        yield from _sources(b, exempt)
    elif key in _PASS_THROUGH and node.args:
        first = node.args[0]
        for arg in (first if isinstance(first, (list, tuple)) else [first]):
            yield from _sources(arg, exempt)


class IndexGuard:
    """The index ranges of one graph's user inputs, checked at every call."""

    __slots__ = ("graph_name", "_inputs")

    def __init__(self, graph_name: str, ranges: Sequence[IndexRange]):
        self.graph_name = graph_name
        by_input: dict[int, list[IndexRange]] = {}
        for r in ranges:
            by_input.setdefault(r.position, []).append(r)
        # Per input: the range all ops accept (the fast path), then each op's own range.
        self._inputs = [(position, max(r.low for r in rs), min(r.high for r in rs), tuple(rs))
                        for position, rs in by_input.items()]

    @classmethod
    def of(cls, graph_name: str, exported: torch.export.ExportedProgram) -> IndexGuard | None:
        """The guard of a traced program, or None when no user input is used as an index."""
        user = list(exported.graph_signature.user_inputs)
        ranges = []
        for node in exported.graph.nodes:
            if node.op != "call_function":
                continue
            for operand, low, high, exempt in _index_operands(node):
                for source, allowed in _sources(operand, exempt):
                    val = source.meta.get("val")
                    if source.name in user and isinstance(val, torch.Tensor) and not val.is_floating_point() \
                            and val.dtype is not torch.bool:
                        op = f"aten.{op_key(node).split('.')[0]} from {module_path(node)}"
                        ranges.append(IndexRange(user.index(source.name), source.name, op, low, high, allowed))
        return cls(graph_name, list(dict.fromkeys(ranges))) if ranges else None

    def check(self, flat_inputs: Sequence[torch.Tensor]) -> None:
        """Raise IndexOutOfRangeError if an index input holds a value some op does not accept."""
        for position, low, high, ranges in self._inputs:
            t = flat_inputs[position]
            if not t.numel():
                continue
            lo, hi = (int(v) for v in torch.aminmax(t))
            if low <= lo and hi < high:
                continue
            for r in ranges:
                bad = (t < r.low) | (t >= r.high)
                if r.exempt is not None:
                    bad &= t != r.exempt
                if bad.any():
                    where = bad.nonzero()[0].tolist()
                    raise IndexOutOfRangeError(
                        f"{self.graph_name}: input '{r.name}' holds {int(t[tuple(where)])} at {where}, out of "
                        f"range for {r.op}: valid values are {r.valid()}. Eager torch raises an "
                        f"IndexError or RuntimeError for it (a few CPU kernels, F.ctc_loss's, read outside "
                        f"the tensor instead); fix the indices, or size the module for them "
                        f"(num_embeddings, number of classes).")

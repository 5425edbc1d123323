"""Where gradients stop in build(): `x.detach()` and `with torch.no_grad():` blocks.

torch.export keeps both in its training IR (`aten.detach`, and the `wrap_with_set_grad_enabled`
higher-order op around a no_grad block), but `run_decompositions` turns `detach` into `alias`
and inlines the block. The Relax program, differentiated as a whole, then sent gradients through
them: `x * x.detach()` trained with twice torch's gradient, and a teacher's output computed
under no_grad was differentiated. `mark(exported)`, run right after export, rewrites them into
`tvmgraph::stop_gradient`, an op that survives decomposition and lowers to `relax.grad.no_grad`
(the identity, with no gradient). Under AMP, build() is traced at the ATen level, where no
no_grad block is recorded: `StopWhereGradIsOff`, active while build() is traced, stops the
results of ops run in one.

A tensor a no_grad block updates in place (`var.clamp_(min=eps)`, as F.gaussian_nll_loss does,
or through a view: `h[:, :4] = 0`) keeps its history in eager: the gradient passes the update
unchanged. Both paths give it the new value with the identity gradient to the old one
(`_straight_through`).
"""

from __future__ import annotations

import operator

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .errors import TraceError


@torch.library.custom_op("tvmgraph::stop_gradient", mutates_args=())
def stop_gradient(x: torch.Tensor) -> torch.Tensor:
    """x, through which no gradient flows (only traced: the compiled program runs it)."""
    return x.clone()


@stop_gradient.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


STOP = torch.ops.tvmgraph.stop_gradient.default
_DETACH = torch.ops.aten.detach.default
_SET_GRAD = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def mark(exported: torch.export.ExportedProgram, graph_name: str = "graph") -> int:
    """Rewrite `exported` in place: each `detach` becomes a stop, and so does each tensor that
    leaves a no_grad block, in the program and in the regions of its higher-order ops (AMP's
    autocast regions). Returns how many stops it placed; running it again places none.

    A stop is a new tensor, not an alias: a write through `x.detach()` (`x.detach().mul_(3)`,
    which changes x in eager) would change the stop only, so it is a TraceError naming the fix."""
    placed = 0
    for module in exported.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            placed += _mark_graph(module, graph_name)
    return placed


def _written_through(node: torch.fx.Node) -> torch.fx.Node | None:
    """The first op that writes `node`'s value in place, directly or through views of it; not
    those lower.py refuses by name (`F.embedding(max_norm=...)` renormalizes `weight.detach()`)."""
    from .lower import _DROPPED_MUTATIONS, op_key  # lower imports this module

    for user in node.users:
        if user.op != "call_function" or not user.args or user.args[0] is not node:
            continue
        if _writes_first_argument(user.target) and op_key(user) not in _DROPPED_MUTATIONS:
            return user
        if _views_first_argument(user.target):
            found = _written_through(user)
            if found is not None:
                return found
    return None


def _mark_graph(module: torch.fx.GraphModule, graph_name: str) -> int:
    graph = module.graph
    placed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _DETACH:
            write = _written_through(node)
            if write is not None:
                from .lower import describe

                raise TraceError(
                    f"{graph_name}: build() updates a tensor in place through .detach() ({describe(write)}, "
                    f"on x.detach()); eager changes x through that alias, which tvmgraph cannot follow (the "
                    f"update would be lost). Update x itself under torch.no_grad() instead: "
                    f"`with torch.no_grad(): x.mul_(3)`, which the graph keeps, as eager does.")
            node.target = STOP
            placed += 1
        elif node.target is _SET_GRAD and node.args and node.args[0] is False:
            block = getattr(module, node.args[1].target)
            returned = set()
            for out in [u for u in node.users if u.target is operator.getitem]:
                if _is_tensor(out) and not any(u.target is STOP for u in out.users):
                    updated = _updated_input(block, out.args[1])
                    if updated is None:
                        _stop(graph, out)
                    else:
                        returned.add(updated)
                        _straight_through(graph, out, node.args[2 + updated], node)
                    placed += 1
            for index in _written_inputs(block) - returned:
                updated = node.args[2 + index]
                if updated.op == "call_function" and _is_float_tensor(updated):  # an activation
                    _straight_through_after(graph, updated, node)
                    placed += 1
    if placed:
        module.recompile()
    return placed


def _stop(graph: torch.fx.Graph, out: torch.fx.Node) -> None:
    """Every use of `out` reads stop_gradient(out) instead."""
    with graph.inserting_after(out):
        stop = graph.call_function(STOP, (out,))
    stop.meta.update(out.meta)
    out.replace_all_uses_with(stop, delete_user_cb=lambda user: user is not stop)


def _straight_through(graph: torch.fx.Graph, out: torch.fx.Node, updated: torch.fx.Node,
                      block: torch.fx.Node) -> None:
    """`updated` changed in place by the no_grad `block` (`var.clamp_(min=eps)` in
    F.gaussian_nll_loss): eager keeps the tensor's history, so the gradient passes through the
    update unchanged. Every use of `out` reads stop(out) + where(isfinite(source), source -
    stop(source), 0) instead, with source a copy of `updated` taken before the block (after it,
    `updated` is the new value, through whose clamp no gradient passes): out's value exactly
    (x - x is 0; the where keeps inf - inf from making NaN), and the identity gradient to the
    tensor's history."""
    source = _copy_before(graph, updated, block)
    stop_out, straight = _with_gradient_of(graph, out, source)
    out.replace_all_uses_with(straight, delete_user_cb=lambda user: user is not stop_out)


def _straight_through_after(graph: torch.fx.Graph, updated: torch.fx.Node, block: torch.fx.Node) -> None:
    """`updated` written in place through a view by the no_grad `block`, which returns nothing
    (`h[:, :4] = 0`, `h[m].zero_()`): the uses of `updated` after the block read its new value
    with the identity gradient to its value before (as `_straight_through`)."""
    source = _copy_before(graph, updated, block)
    order = {node: i for i, node in enumerate(graph.nodes)}
    later = [user for user in updated.users if order[user] > order[block]]
    stop_new, straight = _with_gradient_of(graph, updated, source, after=block)
    for user in later:
        user.replace_input_with(updated, straight)


def _copy_before(graph: torch.fx.Graph, updated: torch.fx.Node, block: torch.fx.Node) -> torch.fx.Node:
    with graph.inserting_before(block):
        source = graph.call_function(torch.ops.aten.clone.default, (updated,))
    source.meta.update(updated.meta)
    return source


def _with_gradient_of(graph: torch.fx.Graph, new: torch.fx.Node, source: torch.fx.Node,
                      after: torch.fx.Node | None = None) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(stop(new), stop(new) + where(isfinite(source), source - stop(source), 0)): new's value
    with the identity gradient to source; inserted after `after` (default: after `new`)."""
    with graph.inserting_after(after or new):
        stop_new = graph.call_function(STOP, (new,))
    with graph.inserting_after(stop_new):
        stop_source = graph.call_function(STOP, (source,))
    with graph.inserting_after(stop_source):
        difference = graph.call_function(torch.ops.aten.sub.Tensor, (source, stop_source))
    with graph.inserting_after(difference):
        finite = graph.call_function(torch.ops.aten.isfinite.default, (source,))
    with graph.inserting_after(finite):
        zero = graph.call_function(torch.ops.aten.where.ScalarOther, (finite, difference, 0.0))
    with graph.inserting_after(zero):
        straight = graph.call_function(torch.ops.aten.add.Tensor, (stop_new, zero))
    for node in (stop_new, straight):
        node.meta.update(new.meta)
    for node in (stop_source, difference, zero):
        node.meta.update(source.meta)
    finite.meta["val"] = torch.isfinite(source.meta["val"])
    return stop_new, straight


def _updated_input(block: torch.fx.GraphModule, index: int) -> int | None:
    """Which input of a no_grad block its output `index` is, updated in place (a chain of
    in-place ops on it: `x.clamp_(...)`), or None."""
    returned = next(n for n in block.graph.nodes if n.op == "output").args[0][index]
    while returned.op == "call_function" and _writes_first_argument(returned.target):
        returned = returned.args[0]
    if returned.op != "placeholder":
        return None
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    return placeholders.index(returned)


def _written_inputs(block: torch.fx.GraphModule) -> set[int]:
    """The inputs of a no_grad block that an in-place op in it writes, itself or through a
    chain of views (`h[:, :4] = 0` is `fill_(slice(h))`)."""
    placeholders = [n for n in block.graph.nodes if n.op == "placeholder"]
    written = set()
    for node in block.graph.nodes:
        if node.op != "call_function" or not _writes_first_argument(node.target):
            continue
        base = node.args[0]
        while isinstance(base, torch.fx.Node) and base.op == "call_function" and _views_first_argument(base.target):
            base = base.args[0]
        if isinstance(base, torch.fx.Node) and base.op == "placeholder":
            written.add(placeholders.index(base))
    return written


def _views_first_argument(target: object) -> bool:
    """An op whose result is a view of its first argument (slice, select, view, transpose...)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments or not schema.returns:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and not alias.is_write and schema.returns[0].alias_info is not None


def _writes_first_argument(target: object) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


class StopWhereGradIsOff(torch.overrides.TorchFunctionMode):
    """While build() runs under AMP: the result of every op run with gradients off (a no_grad
    block) goes through stop_gradient. AMP traces at the ATen level (trace._export), which runs
    build() with gradients off and records no no_grad block, so the grad mode build() sets is
    kept here instead: `torch._C._set_grad_enabled` (what `no_grad`, `enable_grad` and
    `set_grad_enabled` call) sets it, and `torch.is_grad_enabled()` reads it while build() runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.grad_enabled = True
        self._saved = None

    def __enter__(self):
        self._saved = torch.is_grad_enabled
        torch.is_grad_enabled = lambda: self.grad_enabled
        return super().__enter__()

    def __exit__(self, *exc):
        torch.is_grad_enabled = self._saved
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._set_grad_enabled:
            self.grad_enabled = bool(args[0])
            return None
        if not self.grad_enabled and (_updates_in_place(func, args) or func is torch.Tensor.__setitem__):
            # The tensor keeps its history (see _straight_through): its new value, with the
            # identity gradient to its value before the update.
            target = args[0]
            before = target.clone()
            out = func(*args, **(kwargs or {}))
            target.copy_(STOP(target) + _zero_with_its_gradient(before))
            return None if func is torch.Tensor.__setitem__ else target
        out = func(*args, **(kwargs or {}))
        if self.grad_enabled:
            return out
        return torch.utils._pytree.tree_map_only(
            torch.Tensor, lambda t: STOP(t) if t.is_floating_point() else t, out)


def _updates_in_place(func: object, args: tuple) -> bool:
    """A Tensor method that writes its floating-point self (`clamp_`, `mul_`, `copy_`)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_") and bool(args)
            and isinstance(args[0], torch.Tensor) and args[0].is_floating_point())


def _zero_with_its_gradient(x: torch.Tensor) -> torch.Tensor:
    """0 where x is finite (x - stop(x): the identity gradient to x), else 0 (inf - inf is NaN:
    an attention mask filled with -inf and then updated in place)."""
    return torch.where(torch.isfinite(x), x - STOP(x), torch.zeros_like(x))


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _is_float_tensor(node: torch.fx.Node) -> bool:
    return _is_tensor(node) and node.meta["val"].is_floating_point()


def emit_te(bb: relax.BlockBuilder, func: object, *args: object, **kwargs: object) -> relax.Var:
    """`bb.emit_te(func, ...)` behind no_grad: a kernel autodiff must never reach (pooling indices,
    dropout's keep mask, random draws), even through a tuple that holds its result."""
    return bb.emit(relax.op.grad.no_grad(bb.emit_te(func, *args, **kwargs)))


def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    return importer.block_builder.emit(relax.op.grad.no_grad(importer.env[node.args[0]]))


CONVERTERS = {"stop_gradient.default": convert}

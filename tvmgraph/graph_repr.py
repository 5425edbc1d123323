"""`repr(graph)`: the tree OneFlow prints (seed 001), with torch dtypes.

Before the first call it shows the config, modules, parameters and buffers; after a call it
adds the INPUT and OUTPUT tensors of the graph and of each module, as traced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .spec import TensorSpec, TreeDef

if TYPE_CHECKING:
    from .graph import Graph
    from .stages import TracedGraph

INDENT = "  "


def tensor_meta(spec: TensorSpec, requires_grad: bool = False) -> str:
    """`tensor(..., size=(8, 3), dtype=torch.float32, requires_grad=True)`; device when not CPU."""
    device = f"device='{spec.device}', " if spec.device.type != "cpu" else ""
    size = "(" + ", ".join(map(str, spec.shape)) + ("," if len(spec.shape) == 1 else "") + ")"
    grad = ", requires_grad=True" if requires_grad else ""
    return f"tensor(..., {device}size={size}, dtype={spec.dtype}{grad})"


def _io_lines(prefix: str, kind: str, specs: list[TensorSpec], names: list[str]) -> list[str]:
    return [f"({kind}:_{prefix}-{name}:{tensor_meta(spec)})" for name, spec in zip(names, specs)]


def _tree_names(tree: TreeDef, stem: str) -> list[str]:
    """input_0, input_1.0, input_1.1 ... for the leaves of a top-level tuple of arguments."""
    if tree.kind in ("tuple", "list"):
        return [p for i, child in enumerate(tree.children) for p in child.leaf_paths(f"{stem}_{i}")]
    return tree.leaf_paths(f"{stem}_0")


def _module_lines(path: str, module: torch.nn.Module, traced: TracedGraph | None) -> list[str]:
    body: list[str] = []
    io = traced.module_io.get(path) if traced is not None else None
    if io is not None:
        body += _io_lines(path, "INPUT", io.inputs, [f"input_{i}" for i in range(len(io.inputs))])
    for name, p in module.named_parameters(recurse=False):
        body.append(f"(PARAMETER:{path}.{name}:{tensor_meta(TensorSpec.of(p), p.requires_grad)}): ()")
    for name, b in module.named_buffers(recurse=False):
        body.append(f"(BUFFER:{path}.{name}:{tensor_meta(TensorSpec.of(b))}): ()")
    for name, child in module.named_children():
        body += _module_lines(f"{path}.{name}", child, traced)
    if io is not None:
        body += _io_lines(path, "OUTPUT", io.outputs, [f"output_{i}" for i in range(len(io.outputs))])
    head = f"(MODULE:{path}:{type(module).__name__}({module.extra_repr()}))"
    if not body:
        return [f"{head}: ()"]
    return [f"{head}: (", *(INDENT + line for line in body), ")"]


def graph_repr(graph: Graph, traced: TracedGraph | None) -> str:
    """The full tree for `graph`; `traced` is the latest traced entry, or None before a call."""
    name = graph.name
    body = [f"(CONFIG:config:{graph.config!r})"]
    if traced is not None:
        body += _io_lines(name, "INPUT", list(traced.signature.leaves), _tree_names(traced.args_tree, "input"))
    for mod_name, module in graph._state().modules.items():
        body += _module_lines(mod_name, module, traced)
    if traced is not None:
        body += _io_lines(name, "OUTPUT", _output_specs(traced), _tree_names(traced.out_tree, "output"))
    lines = [f"(GRAPH:{name}:{type(graph).__name__}): (", *(INDENT + line for line in body), ")"]
    return "\n".join(lines)


def _output_specs(traced: TracedGraph) -> list[TensorSpec]:
    """Specs of build()'s outputs, read from the exported program's output node."""
    exported = traced.result.exported
    output_node = next(n for n in exported.graph.nodes if n.op == "output")
    values = output_node.args[0]
    user_names = {s.arg.name for s in exported.graph_signature.output_specs
                  if s.kind.name in ("USER_OUTPUT", "LOSS_OUTPUT")}
    specs = [TensorSpec.of(v.meta["val"]) for v in values if getattr(v, "name", None) in user_names]
    return specs[: traced.out_tree.num_leaves]

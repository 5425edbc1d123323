"""Which bindings of the imported Relax program each call of a checkpointed module computed.

torch.export records on every node the stack of modules it ran in (`nn_module_stack`): one
entry per module, keyed by the call (`L__self__model.layer1`, and `...layer1@1` for the
module's second call), valued by the module's path. A node belongs to a call of a
checkpointed module when that module's path is in its stack (the outermost checkpointed one
when modules nest). `lower.to_relax` notes on each node the Relax variables holding its result
(`RELAX_VAR`); a converter that emits several bindings emits them just before its result, so a
binding that no node names belongs to the node of the next binding one does.

The regions feed relay_passes/checkpoint_modules.py.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import tvm

from ..lower import RELAX_VAR


def _call_of(node: torch.fx.Node, paths: Collection[str]) -> str | None:
    """The key of the outermost checkpointed module call `node` ran in, if any."""
    for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
        if path in paths:
            return key
    return None


def checkpoint_regions(exported: torch.export.ExportedProgram, mod: tvm.IRModule,
                       paths: Collection[str], func_name: str = "main") -> tuple[list[list[str]], set[str]]:
    """The binding names of each call of the modules at `paths` (in call order), and the paths
    that ran no op in the program."""
    call_of_var: dict[str, str | None] = {}
    seen_paths: set[str] = set()
    for node in exported.graph.nodes:
        call = _call_of(node, paths) if node.op == "call_function" else None
        if call is not None:
            seen_paths.add(node.meta["nn_module_stack"][call][0])
        for name in node.meta.get(RELAX_VAR, ()):
            call_of_var[name] = call
    regions: dict[str, list[str]] = {}
    for block in mod[func_name].body.blocks:
        pending: list[str] = []  # bindings no node names yet: they belong to the next one named
        for binding in block.bindings:
            name = binding.var.name
            pending.append(name)
            if name not in call_of_var:
                continue
            call = call_of_var[name]
            if call is not None:
                regions.setdefault(call, []).extend(pending)
            pending = []
    return list(regions.values()), set(paths) - seen_paths


"""Compiled graphs as persistent artifacts: the cache key of a traced graph, and loading and
storing entries of the compiled cache (autotune/compiled_cache.py).

The key is made of named parts (autotune/cache_key.py): the traced program (every FX node with
its shapes and dtypes), the lifted constants' values, the call signature, the training plan,
the graph config, the target, the pass pipeline, the versions of torch/TVM/tvm-ffi, and a hash
of tvmgraph's own source. What the key ignores cannot change the compiled code: the graph's
name, the parameters' values (they are inputs), and debug settings.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
import tvm

from autotune.cache_key import Part, cache_key
from autotune.compiled_cache import CompiledCache

from .config import CompileOptions, GraphConfig, compile_options, settings
from .stages import CompiledGraph, TracedGraph
from .training.plan import TrainingPlan


@functools.cache
def source_fingerprint() -> str:
    """sha256 of tvmgraph's and relay_passes' Python sources: a code change is a new key."""
    import relay_passes

    h = hashlib.sha256()
    for package in (Path(__file__).parent, Path(relay_passes.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            h.update(str(path.relative_to(package.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _meta(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_meta(v) for v in value) + ")"
    return type(value).__name__


def program_text(exported: torch.export.ExportedProgram) -> str:
    """Every node of the traced program with its op, arguments and result shapes, one a line."""
    lines = [str(exported.graph_signature)]
    for node in exported.graph.nodes:
        lines.append(f"{node.op} {node.name} {node.target} {node.args} {node.kwargs} "
                     f"{_meta(node.meta.get('val'))}")
    return "\n".join(lines)


def _constants(exported: torch.export.ExportedProgram) -> bytes:
    h = hashlib.sha256()
    for name, value in sorted(exported.constants.items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def key_parts(traced: TracedGraph, plan: TrainingPlan | None, config: CompileOptions | GraphConfig,
              target: tvm.target.Target, pipeline: str) -> list[Part]:
    import tvm_ffi

    sig = traced.signature
    return [
        ("program", program_text(traced.result.exported)),
        ("constants", _constants(traced.result.exported)),
        # sig.optimizers holds object ids (per process); the plan below names parameters by path
        ("signature", repr((sig.args, sig.leaves, sig.module_modes))),
        ("training", repr(plan.structure()) if plan is not None else "inference"),
        # Every option that shapes code, the process-wide codegen settings included.
        ("options", repr(compile_options(config))),
        ("target", str(target)),
        ("pipeline", pipeline),
        ("versions", f"torch {torch.__version__}; tvm {tvm.__version__}; tvm-ffi {tvm_ffi.__version__}"),
        ("tvmgraph", source_fingerprint()),
    ]


def graph_key(graph_class: str, traced: TracedGraph, plan: TrainingPlan | None, config: CompileOptions | GraphConfig,
              target: tvm.target.Target, pipeline: str) -> str:
    """The compiled-cache key of `traced` compiled with these settings."""
    return cache_key(graph_class, key_parts(traced, plan, config, target, pipeline))


def compiled_cache() -> CompiledCache | None:
    """The process's compiled cache, or None when TVMGRAPH_COMPILE_CACHE=0."""
    return CompiledCache(settings.cache_dir / "compiled") if settings.compile_cache else None


def load(cache: CompiledCache, key: str, traced: TracedGraph, plan: TrainingPlan | None,
         device: torch.device, modules: Mapping[str, torch.nn.Module]) -> CompiledGraph | None:
    """The cached program for `key`, ready to run, or None (a miss, or a corrupt entry)."""
    entry = cache.load(key)
    if entry is None:
        return None
    meta = entry.meta
    return CompiledGraph(traced, plan, meta["signature"], meta["train_layout"], entry.lib,
                         tvm.target.Target(json.loads(meta["target"])), device, modules)

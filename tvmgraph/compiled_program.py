"""A compiled graph before it meets a device: what `LoweredGraph.compile(target)` makes.

    LoweredGraph.compile(target) -> CompiledProgram         device-free, cross-compiles
    CompiledProgram.store(cache, key) / .from_cache(...)    the compiled cache's format
    CompiledProgram.bind(device, modules, traced, plan)     -> CompiledGraph, the runner

A `CompiledProgram` is the library (the VM executable, or the shared library it was exported
to), its calling convention (`LoweredSignature`: input order by kind and path, mutations,
constants), the training step's layout, the target and the cache key. It holds no tensor, no
module and no device, so it can be built for another machine (tvmgraph/deploy.py exports it)
and persisted as versioned JSON plus a shared library (tvmgraph/compiled_cache.py, with the
codecs of tvmgraph/artifact.py). Binding it to the graph's modules and a device is a step of
its own that returns the runner.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import tvm
from tvm import relax

from .lower import LoweredSignature
from .openmp_launch import load_library
from .training.accumulation import MICRO_STEP
from .training.train_step import FUNC_NAME as TRAIN_STEP
from .training.train_step import TrainStepLayout

if TYPE_CHECKING:
    from .compiled_cache import CompiledCache
    from .stages import CompiledGraph, LoweredGraph, TracedGraph
    from .training.plan import TrainingPlan


@dataclass(frozen=True)
class CompiledProgram:
    """A compiled program without a device: library, calling convention, layout, target, key."""

    library: tvm.runtime.Module | relax.VMExecutable
    signature: LoweredSignature
    train_layout: TrainStepLayout | None
    target: tvm.target.Target
    key: str | None = None
    # The module after the pass pipeline, when it was built in this process (not persisted).
    optimized: tvm.IRModule | None = None

    @property
    def entry(self) -> str:
        """The function a call runs: `main`, `train_step`, or `accumulate_grads` (run once per
        micro-batch) with gradient accumulation."""
        return entry_name(self.train_layout)

    def meta(self) -> dict[str, Any]:
        """What persisting the program stores besides the library (artifact.encode_meta's input)."""
        return {"signature": self.signature, "train_layout": self.train_layout, "target": str(self.target)}

    def store(self, cache: CompiledCache, key: str, export: Callable[[Any, str], None]) -> CompiledProgram:
        """Write the program into `cache` under `key`; returns it running from the stored library
        (another process's, verified, when it stored the same key first)."""
        path = cache.store(key, self.library, meta=self.meta(), export=export)
        return replace(self, library=load_library(path), key=key)

    @classmethod
    def from_cache(cls, cache: CompiledCache, key: str) -> CompiledProgram | None:
        """The program stored under `key`, verified and loaded, or None (a miss, or an entry that
        was not trusted and is rebuilt)."""
        entry = cache.load(key)
        if entry is None:
            return None
        meta = entry.meta
        return cls(entry.lib, meta["signature"], meta["train_layout"],
                   tvm.target.Target(json.loads(meta["target"])), key)

    def bind(self, device: torch.device, modules: Mapping[str, torch.nn.Module], traced: TracedGraph,
             plan: TrainingPlan | None, lowered: LoweredGraph | None = None) -> CompiledGraph:
        """The runner: this program loaded on `device`, reading its parameters and buffers from
        `modules` (by path) and, for training, its optimizer state from `plan`."""
        from .stages import CompiledGraph

        return CompiledGraph(traced, plan, self, device, modules, lowered=lowered)

    def __repr__(self) -> str:
        return (f"CompiledProgram({self.entry}, target={self.target.kind.name}, "
                f"{len(self.signature.inputs)} inputs, key={self.key})")


def entry_name(layout: TrainStepLayout | None) -> str:
    if layout is None:
        return "main"
    return MICRO_STEP if layout.split else TRAIN_STEP


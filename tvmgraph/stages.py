"""The three stages of compiling a graph, each a small object you can hold and print.

    Graph.trace(*args) -> TracedGraph     torch.export program of build(), ready to lower
    TracedGraph.lower() -> LoweredGraph   Relax IRModule with a known calling convention
    LoweredGraph.compile() -> CompiledGraph   VM executable bound to a device, ready to run

`Graph.__call__` chains them with a cache keyed by the call's `Signature`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import tvm
from tvm import relax

from . import lower as lowering
from .binding import TensorBinder
from .config import GraphConfig
from .errors import DeviceMismatchError, StaleGraphError
from .pipeline import get_pipeline
from .spec import Signature, TensorSpec, TreeDef
from .target import target_for, tvm_device
from .trace import ModuleIO, TraceResult


class TracedGraph:
    """`build()` captured by torch.export; `.lower()` turns it into Relax."""

    __slots__ = ("graph_name", "signature", "args_tree", "result")

    def __init__(self, graph_name: str, signature: Signature, args_tree: TreeDef, result: TraceResult):
        self.graph_name = graph_name
        self.signature = signature
        self.args_tree = args_tree
        self.result = result

    @property
    def out_tree(self) -> TreeDef:
        return self.result.out_tree

    @property
    def module_io(self) -> dict[str, ModuleIO]:
        return self.result.module_io

    def as_text(self) -> str:
        """The torch.export FX graph of build()."""
        return str(self.result.exported.graph)

    def lower(self) -> LoweredGraph:
        """Decompose to core ATen, check every op, import into Relax."""
        exported = lowering.decompose(self.result.exported)
        lowering.check_supported(exported, self.graph_name)
        mod, sig = lowering.to_relax(exported, self.graph_name, self.result.has_backward)
        return LoweredGraph(self, mod, sig, exported)


class LoweredGraph:
    """A Relax `IRModule` whose `main` follows `LoweredSignature`; `.compile()` builds it."""

    __slots__ = ("traced", "mod", "signature", "exported")

    def __init__(self, traced: TracedGraph, mod: tvm.IRModule, signature: lowering.LoweredSignature,
                 exported: torch.export.ExportedProgram):
        self.traced = traced
        self.mod = mod
        self.signature = signature
        self.exported = exported

    def as_text(self) -> str:
        """TVMScript of the Relax module."""
        return self.mod.script(show_meta=False)

    def build(self, target: tvm.target.Target, config: GraphConfig,
              pipeline: str = "default") -> tuple[tvm.IRModule, relax.VMExecutable]:
        """Run the pass pipeline for `target` and generate code; needs no device (cross-compiles)."""
        optimized = get_pipeline(target, config, pipeline)(self.mod)
        return optimized, tvm.compile(optimized, target=target, relax_pipeline=None)

    def compile(self, device: torch.device, config: GraphConfig, modules: Mapping[str, torch.nn.Module],
                pipeline: str = "default") -> CompiledGraph:
        """Build for `device`'s target and load the result onto `device`, bound to `modules`."""
        target = target_for(device)
        optimized, executable = self.build(target, config, pipeline)
        binder = TensorBinder(self.signature.inputs, modules, self.signature.constants)
        return CompiledGraph(self, optimized, executable, target, device, binder)


class CompiledGraph:
    """A VM executable plus everything needed to call it with torch tensors."""

    __slots__ = ("lowered", "optimized", "executable", "target", "device", "binder", "_main",
                 "_num_mutations", "_num_user_outputs", "_mutation_sources")

    def __init__(self, lowered: LoweredGraph, optimized: tvm.IRModule, executable: relax.VMExecutable,
                 target: tvm.target.Target, device: torch.device, binder: TensorBinder):
        self.lowered = lowered
        self.optimized = optimized
        self.executable = executable
        self.target = target
        self.device = device
        self.binder = binder
        vm = relax.VirtualMachine(executable, tvm_device(device))
        self._main: Callable = vm["main"]
        sig = lowered.signature
        self._num_mutations = len(sig.mutations)
        self._num_user_outputs = sig.num_user_outputs
        self._mutation_sources = sig.mutations

    def as_text(self) -> str:
        """TVMScript of the module after the pass pipeline (what was built)."""
        return self.optimized.script(show_meta=False)

    def run(self, flat_inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Run once: returns the user outputs (flat) and the loss, if build() called backward()."""
        state = self.binder.tensors()
        try:
            results = self._main(*flat_inputs, *state)
        except Exception:  # the VM raises plain errors; say which tensor is at fault
            self._diagnose(state)
            raise
        n_mut, n_user = self._num_mutations, self._num_user_outputs
        if n_mut:
            self._write_back(flat_inputs, state, results[:n_mut])
        user = list(results[n_mut:n_mut + n_user])
        loss = results[n_mut + n_user] if len(results) > n_mut + n_user else None
        return user, loss

    def _write_back(self, flat_inputs: Sequence[torch.Tensor], state: list[torch.Tensor], new_values) -> None:
        named = dict(zip((s.target for s in self.binder.sources), state))
        with torch.no_grad():
            for source, value in zip(self._mutation_sources, new_values):
                dest = flat_inputs[int(source.target)] if source.kind == "user" else named[source.target]
                dest.copy_(value)

    def _diagnose(self, state: list[torch.Tensor]) -> None:
        graph = self.lowered.traced.graph_name
        params = self.lowered.mod["main"].params[self.lowered.signature.num_user_inputs:]
        for source, t, param in zip(self.binder.sources, state, params):
            expected = [int(d) for d in param.ty.shape]
            if list(t.shape) != expected or str(t.dtype).removeprefix("torch.") != param.ty.dtype:
                raise StaleGraphError(
                    f"{graph}: {source.kind} '{source.target}' is now {TensorSpec.of(t).describe()} but the "
                    f"graph was compiled for {param.ty.dtype}{expected}; create a new graph object "
                    f"after changing the model's structure."
                )
            if t.device != self.device:
                raise DeviceMismatchError(
                    f"{graph}: {source.kind} '{source.target}' is on {t.device} but the inputs are on "
                    f"{self.device}; move the module with .to({str(self.device)!r}) or the inputs with "
                    f".to({str(t.device)!r})."
                )

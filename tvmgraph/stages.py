"""The three stages of compiling a graph, each a small object you can hold and print.

    Graph.trace(*args) -> TracedGraph                  torch.export program of build(), ready to lower
    TracedGraph.lower() -> LoweredGraph                Relax IRModule with a known calling convention
    LoweredGraph.compile(target) -> CompiledProgram    library + calling convention, no device
    CompiledProgram.bind(device, ...) -> CompiledGraph loaded on a device, bound to the modules

`Graph.__call__` chains them with a cache keyed by the call's `Signature`, and with the
persistent compiled cache (tvmgraph/artifact.py): a program compiled once, by any process, is
loaded instead of compiled again. A training graph (build() called loss.backward() and the
graph has optimizers) lowers to a `train_step` function instead of `main`
(tvmgraph/training/train_step.py), or, with gradient accumulation, to `accumulate_grads` run
once per micro-batch and `apply_update` (tvmgraph/training/accumulation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import tvm
from tvm import relax

from . import codegen
from . import lower as lowering
from .debug import logger
from .binding import TensorBinder
from .compiled_program import CompiledProgram, entry_name
from .vm_results import releasing
from .config import CompileOptions, GraphConfig, compile_options, settings
from .errors import (ConfigError, DeviceMismatchError, StaleGraphError, TraceError, TvmGraphError,
                     UnsupportedOptionError)
from .frozen_weights import PackedWeights, mark_frozen_state
from .index_guard import IndexGuard
from .inputs import runnable_all
from .native_output import to_debug_log
from .pipeline import get_pipeline
from .spec import Signature, TensorSpec, TreeDef
from .target import tvm_device
from .trace import ModuleIO, TraceResult, shared_storage
from .training.accumulation import Accumulation, append_accumulation, update_positions
from .training.checkpoint_regions import checkpoint_regions
from .training.data_parallel import DataParallel, update_plan
from .training.plan import TrainingPlan
from .training.runtime import TrainingBinding
from .training.train_step import TrainStepLayout, append_train_step

if TYPE_CHECKING:
    from autotune.log import AppliedLog


def _shared_state(exported: torch.export.ExportedProgram) -> str:
    """The likely cause of a failed decomposition when two registered buffers share memory (a
    buffer registered in two modules) and build() updates it in place; "" else. (Tied
    parameters are one Parameter, which export keeps once.)"""
    pair = shared_storage((name, exported.state_dict.get(name)) for name in exported.graph_signature.buffers)
    if pair is None:
        return ""
    return (f"'{pair[0]}' and '{pair[1]}' are one tensor (registered twice), which torch cannot trace with an "
            f"in-place update in build(): register it in one module and read it from there in the other.")


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

    def lower(self, plan: TrainingPlan | None = None,
              report: Callable[[str], None] | None = None) -> LoweredGraph:
        """Decompose to core ATen, check every op, import into Relax; with a `plan`, append
        autodiff and the optimizer update. Passes say what they did through `report`."""
        lowering.check_no_dropped_mutations(self.result.exported, self.graph_name)
        try:
            exported = lowering.decompose(self.result.exported)
        except TvmGraphError:
            raise
        except Exception as e:  # noqa: BLE001  (torch raises any type from a decomposition)
            cause = self.result.aliasing or _shared_state(self.result.exported) or (
                "A plain tensor attribute (not a buffer) is updated in place in build(): register it as "
                "a buffer, module.register_buffer(name, tensor), which the graph updates as eager does."
                if "is mutated in the forward method" in str(e) else
                "A torch.autograd.Function or a legacy module (nn.CrossMapLRN2d) is the usual cause: "
                "rewrite it with torch ops, or run it eagerly outside the graph.")
            # torch's errors give the reason first, then the FX node and a traceback.
            reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            raise TraceError(
                f"{self.graph_name}: torch could not decompose build()'s program into core ATen ops "
                f"({type(e).__name__}: {reason[:400]}). {cause}") from e
        lowering.check_no_parameter_mutations(exported, self.graph_name)
        lowering.check_supported(exported, self.graph_name)
        lowering.check_dtypes(exported, self.graph_name)
        with to_debug_log("import"):  # a failed import's BlockBuilder complains on stderr
            mod, sig = lowering.to_relax(exported, self.graph_name, self.result.has_backward)
        layout = None
        if plan is not None and self.signature.options.frozen_weights:
            raise ConfigError(
                f"{self.graph_name}: enable_frozen_weights() is for inference graphs, and this one trains its "
                f"parameters (add_optimizer); turn it off with graph.config.enable_frozen_weights(False).")
        if plan is not None:
            index_of = {s.target: i for i, s in enumerate(sig.inputs) if s.kind == "parameter"}
            grad_indices = [index_of[t] for t in plan.targets]
            loss_index = len(sig.mutations) + sig.num_user_outputs
            origins = lowering.relax_origins(exported)
            regions = self._checkpoint_regions(exported, mod, plan, report)
            options = self.signature.options
            steps, ranks = options.gradient_accumulation_steps, options.data_parallel
            if options.zero_rank is not None and plan.loss_scaling:
                raise UnsupportedOptionError(
                    f"{self.graph_name}: a grad scaler (set_grad_scaler) with ZeRO is not implemented: each rank "
                    f"checks only its share of the gradients for inf/NaN, so the ranks could disagree about "
                    f"skipping a step. Use data parallel without ZeRO (enable_zero(False)), or no grad scaler "
                    f"(bfloat16 AMP on CPU needs none).")
            pipelined = options.pipeline_stage is not None
            if steps > 1 or ranks > 1 or pipelined:
                mod, layout = append_accumulation(mod, plan, grad_indices, loss_index, steps, report,
                                                  self.graph_name, origins, regions, ranks,
                                                  update_plan(plan, options, self.graph_name),
                                                  _received(sig, options.pipeline_stage[1]) if pipelined else (),
                                                  pipelined)
            else:
                mod, layout = append_train_step(mod, plan, grad_indices, loss_index, report, self.graph_name,
                                                origins, regions)
        return LoweredGraph(self, mod, sig, exported, plan, layout)

    def _checkpoint_regions(self, exported: torch.export.ExportedProgram, mod: tvm.IRModule, plan: TrainingPlan,
                            report: Callable[[str], None] | None) -> list[list[str]]:
        """The bindings of each call of a module with activation_checkpointing on."""
        if not plan.activation_checkpointing:
            return []
        regions, idle = checkpoint_regions(exported, mod, plan.activation_checkpointing)
        if idle and report is not None:
            report(f"activation_checkpointing: {', '.join(sorted(idle))} ran no op in build(); nothing to recompute")
        return regions


def _received(sig: lowering.LoweredSignature, count: int) -> list[int]:
    """The main parameters of a pipeline stage's first `count` user inputs, the activations it
    received (training/pipeline_parallel.py), that are floating point: their gradients go back
    to the stage that sent them."""
    users = [i for i, s in enumerate(sig.inputs) if s.kind == "user"][:count]
    return [i for i in users if sig.input_types[i][1] in ("float16", "float32", "float64")]


class LoweredGraph:
    """A Relax `IRModule` whose entry follows `LoweredSignature`; `.compile()` builds it."""

    __slots__ = ("traced", "mod", "signature", "exported", "plan", "train_layout")

    def __init__(self, traced: TracedGraph, mod: tvm.IRModule, signature: lowering.LoweredSignature,
                 exported: torch.export.ExportedProgram, plan: TrainingPlan | None = None,
                 train_layout: TrainStepLayout | None = None):
        self.traced = traced
        self.mod = mod
        self.signature = signature
        self.exported = exported
        self.plan = plan
        self.train_layout = train_layout

    @property
    def entry(self) -> str:
        """Name of the function a call runs: `main`, or `train_step` for a training graph
        (`accumulate_grads`, run once per micro-batch, with gradient accumulation)."""
        return entry_name(self.train_layout)

    def as_text(self) -> str:
        """TVMScript of the Relax module."""
        return self.mod.script(show_meta=False)

    def build(self, target: tvm.target.Target, config: CompileOptions | GraphConfig, pipeline: str = "default",
              report: Callable[[str], None] | None = None, checks: bool | None = None,
              tuning: AppliedLog | None = None) -> tuple[tvm.IRModule, relax.VMExecutable]:
        """Run the pass pipeline for `target` and generate code; needs no device (cross-compiles).
        `tuning`: the records of the graph's tuning log to apply (autotune/log.py).

        With `checks` (default: `settings.check_passes`) every pass's result is checked and an
        optional pass that breaks the module is left out (tvmgraph/pipeline.py). Without, a
        compile that fails is run again with checks, so that such a pass is found and left out.
        """
        graph = self.traced.graph_name
        mod = self.mod
        # Frozen weights: the CPU pipeline lifts what main computes from them alone (pipeline.py).
        if compile_options(config).frozen_weights and self.train_layout is None and target.kind.name == "llvm":
            mod = mark_frozen_state(mod, self.signature)

        def attempt(check: bool) -> tuple[tvm.IRModule, relax.VMExecutable]:
            optimized = get_pipeline(target, config, pipeline, report, graph, check, tuning)(mod)
            return optimized, codegen.build_executable(optimized, target,
                                                       kernel_checks=compile_options(config).kernel_checks)

        if settings.check_passes if checks is None else checks:
            return attempt(True)
        try:
            return attempt(False)
        except Exception as e:  # any failure of a pass or of code generation
            logger.info("%s: compiling failed (%s); compiling again with every pass checked", graph,
                        type(e).__name__)
            return attempt(True)

    def compile(self, target: tvm.target.Target, config: CompileOptions | GraphConfig, pipeline: str = "default",
                report: Callable[[str], None] | None = None, checks: bool | None = None,
                tuning: AppliedLog | None = None) -> CompiledProgram:
        """Build for `target` (any machine's: this needs no device): the device-free program,
        which `.bind(device, modules, traced, plan)` turns into a runner."""
        optimized, executable = self.build(target, config, pipeline, report, checks, tuning)
        return CompiledProgram(executable, self.signature, self.train_layout, target, optimized=optimized)


class CompiledGraph:
    """The runner: a `CompiledProgram` loaded on a device and bound to the graph's modules (and
    optimizers), with everything needed to call it with torch tensors. Made by
    `CompiledProgram.bind`, for a program just compiled or read from the compiled cache."""

    __slots__ = ("traced", "plan", "program", "device", "binder", "training", "_lowered", "_entry",
                 "_num_mutations", "_num_user_outputs", "_has_rng", "_index_guard", "_accumulation", "data_parallel",
                 "packed_weights")

    def __init__(self, traced: TracedGraph, plan: TrainingPlan | None, program: CompiledProgram,
                 device: torch.device, modules: Mapping[str, torch.nn.Module], lowered: LoweredGraph | None = None):
        self.traced = traced
        self.plan = plan
        self.program = program
        signature, train_layout = program.signature, program.train_layout
        self.device = device
        self.binder = TensorBinder(signature.inputs, modules, signature.constants)
        updated = update_plan(plan, traced.signature.options, traced.graph_name) if plan is not None else None
        self.training = TrainingBinding(updated, train_layout, device) if train_layout is not None else None
        self.data_parallel: DataParallel | None = None  # set by the graph in a process group
        self._lowered = lowered
        vm = relax.VirtualMachine(program.library, tvm_device(device), memory_cfg=settings.vm_allocator)
        self._entry: Callable = releasing(vm, self.entry_name)
        # enable_frozen_weights: the weights main takes packed (tvmgraph/frozen_weights.py).
        self.packed_weights = PackedWeights.of(vm) if train_layout is None else None
        self._accumulation = None
        if train_layout is not None and train_layout.split:
            positions = update_positions(plan, updated) if updated is not plan else None
            self._accumulation = Accumulation(vm, train_layout.accumulation_steps, positions)
        self._num_mutations = len(signature.mutations)
        self._num_user_outputs = signature.num_user_outputs
        self._has_rng = any(s.kind == "rng" for s in signature.inputs)
        self._index_guard = IndexGuard.of(traced.graph_name, traced.result.exported)

    # What the program holds, read through it.
    signature = property(lambda self: self.program.signature)
    train_layout = property(lambda self: self.program.train_layout)
    lib = property(lambda self: self.program.library)
    target = property(lambda self: self.program.target)
    optimized = property(lambda self: self.program.optimized)

    @property
    def entry_name(self) -> str:
        """The function of the program that a call runs: `main`, `train_step` for training, or
        `accumulate_grads` (run once per micro-batch) with gradient accumulation."""
        return self.program.entry

    @property
    def accumulation(self) -> Accumulation | None:
        """The runner of `accumulate_grads` and `apply_update` of a split training program."""
        return self._accumulation

    @property
    def lowered(self) -> LoweredGraph:
        """The Relax stage; lowered again on first access when the program came from the cache."""
        if self._lowered is None:
            self._lowered = self.traced.lower(self.plan)
        return self._lowered

    def as_text(self) -> str:
        """TVMScript of the module after the pass pipeline (what was built), when built here."""
        if self.optimized is None:
            return "# loaded from the compiled cache; see .lowered.as_text() for the Relax program\n"
        return self.optimized.script(show_meta=False)

    def run(self, flat_inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Run once: returns the user outputs (flat) and the loss, if build() called backward().

        Index inputs out of range raise IndexOutOfRangeError first (index_guard.py). Tensors the
        kernels cannot read in place (misaligned views, other strides; see inputs.py) are passed
        as copies; what the program writes back goes to the real tensors.
        """
        if self._index_guard is not None:
            self._index_guard.check(flat_inputs)
        if self._accumulation is not None:
            return self._accumulation.run(self, flat_inputs)
        extra = self.training.inputs() if self.training is not None else []
        user, loss, tail, copied = self.run_entry(flat_inputs, extra)
        if self.training is not None:
            self.training.write_back(tail, copied)
        return user, loss

    def run_entry(self, flat_inputs: Sequence[torch.Tensor], extra: Sequence[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], torch.Tensor | None, Sequence[torch.Tensor], set[int]]:
        """One call of the entry function with `extra` inputs after the model's tensors, its
        mutations written back: the user outputs, the loss, the results after the loss, and the
        `id`s of the state tensors the program was given a copy of."""
        state = self.binder.tensors()
        rng = [_draw_seed(self.device)] if self._has_rng else []
        inputs, _ = runnable_all(flat_inputs)
        try:
            passed_state, copied = runnable_all(state, thorough=False)
        except AttributeError:  # not a tensor: a parameter or buffer set to None since the trace
            self._diagnose(state)
            raise
        passed_extra = runnable_all(extra, thorough=False)[0] if extra else ()
        if self.packed_weights is not None:
            passed_extra = (*passed_extra, *self.packed_weights.get(state, passed_state))
        try:
            results = self._entry(*inputs, *rng, *passed_state, *passed_extra)
        except Exception:  # the VM raises plain errors; say which tensor is at fault
            self._diagnose(state)
            raise
        n_mut, n_user = self._num_mutations, self._num_user_outputs
        if n_mut:
            self._write_back(flat_inputs, state, results[:n_mut])
        # tvm-ffi hands results back as torch tensors when a torch tensor went in; a program with
        # no tensor argument at all (build() returning torch.zeros(3)) gets TVM's own tensors.
        user = [r if isinstance(r, torch.Tensor) else torch.from_dlpack(r) for r in results[n_mut:n_mut + n_user]]
        if self.signature.returned_inputs:
            user = returned_tensors(user, (*flat_inputs, *rng, *state), self.signature.returned_inputs)
        loss = results[n_mut + n_user] if self.signature.has_loss else None
        if self.training is None:
            return user, loss, (), set()
        return user, loss, results[n_mut + n_user + 1:], {id(state[i]) for i in copied}

    def _write_back(self, flat_inputs: Sequence[torch.Tensor], state: list[torch.Tensor], new_values) -> None:
        named = dict(zip((s.target for s in self.binder.sources), state))
        with torch.no_grad():
            for source, value in zip(self.signature.mutations, new_values):
                dest = flat_inputs[int(source.target)] if source.kind == "user" else named[source.target]
                dest.copy_(value)

    def _diagnose(self, state: list[torch.Tensor]) -> None:
        graph = self.traced.graph_name
        types = [t for t, s in zip(self.signature.input_types, self.signature.inputs)
                 if s.kind in ("parameter", "buffer", "constant")]
        for source, t, (shape, dtype) in zip(self.binder.sources, state, types):
            if t is None:  # `layer.bias = None`: torch calls no registration hook for it
                raise StaleGraphError(f"{graph}: {source.kind} '{source.target}' is now None; the graph was "
                                      f"compiled with it")
            if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise StaleGraphError(
                    f"{graph}: {source.kind} '{source.target}' is now {TensorSpec.of(t).describe()} but the "
                    f"graph was compiled for {dtype}{list(shape)}; create a new graph object "
                    f"after changing the model's structure."
                )
            if t.device != self.device:
                raise DeviceMismatchError(
                    f"{graph}: {source.kind} '{source.target}' is on {t.device} but the inputs are on "
                    f"{self.device}; move the module with .to({str(self.device)!r}) or the inputs with "
                    f".to({str(t.device)!r})."
                )


def returned_tensors(user: list[torch.Tensor], originals: Sequence[torch.Tensor],
                     returned_inputs: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """The user outputs, where build() returned one of its inputs itself (`return x`, `return
    self.weight`: `returned_inputs` pairs an output with the input's position in `originals`)
    that tensor object, as eager returns it. The VM handed back a new tensor on the same memory:
    a parameter came back as a plain tensor whose in-place changes torch did not count
    (`enable_frozen_weights` then kept the weights from before them)."""
    for i, k in returned_inputs:
        user[i] = originals[k]
    return user


def _draw_seed(device: torch.device) -> torch.Tensor:
    """Two fresh 31-bit integers from torch's default generator (seeded by torch.manual_seed)."""
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64).to(device)

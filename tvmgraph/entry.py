"""How a graph call that misses the signature cache gets its compiled entry.

After tracing: decide whether the graph trains (`training_plan`), then load the program from
the persistent compiled cache or lower and compile it (storing it there), logging each stage
at the graph's debug level (`compile_or_load`).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import artifact, codegen
from . import lower as lowering
from .compiled_program import CompiledProgram
from .config import CompileOptions
from .debug import GraphLog, logger
from .errors import (BackwardError, CompileError, OptimizerError, TvmGraphError, UnsupportedOpError,
                     UnsupportedOptionError, reason_of)
from .stages import CompiledGraph, LoweredGraph, TracedGraph
from .target import target_for
from .training import gradient_check
from .training.plan import TrainingPlan

PIPELINE = "default"


def training_plan(graph_name: str, optimizers: list, traced: TracedGraph,
                  named_parameters: Callable[[], list[tuple[str, torch.nn.Parameter]]],
                  options: CompileOptions, grad_scaler: Any = None,
                  named_modules: Callable[[], list[tuple[str, torch.nn.Module]]] | None = None) -> TrainingPlan | None:
    """The plan of what the graph updates, None for inference; loss.backward() and optimizers
    must come together. `grad_scaler`: an enabled torch.amp.GradScaler, or None."""
    if traced.result.has_backward and not optimizers:
        raise BackwardError(f"{graph_name}: build() called loss.backward() but the graph has no optimizer; "
                            f"add one in __init__: self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))")
    if optimizers and not traced.result.has_backward:
        raise BackwardError(f"{graph_name}: the graph has an optimizer but build() never called "
                            f"loss.backward(); call it on the scalar loss and return the loss")
    if not optimizers:
        if grad_scaler is not None:
            raise OptimizerError(f"{graph_name}: set_grad_scaler() was called but the graph has no optimizer; "
                                 f"loss scaling is for training graphs: add_optimizer() too, or "
                                 f"set_grad_scaler(None)")
        return None
    parameters = named_parameters()
    refuse_backward_hooks(graph_name, named_modules() if named_modules is not None else [], parameters)
    plan = TrainingPlan.build(graph_name, optimizers, parameters, options.recompute_attention,
                              options.activation_checkpointing, grad_scaler, reached=traced.result.reached)
    if not plan.targets:
        if any(p.requires_grad for optimizer, _ in optimizers for g in optimizer.param_groups for p in g["params"]):
            raise OptimizerError(
                f"{graph_name}: the loss build() called backward() on depends on no parameter the optimizers "
                f"update (in eager every .grad would stay None): compute the loss from the model's output "
                f"outside torch.no_grad() and without .detach()")
        raise OptimizerError(f"{graph_name}: the optimizers have no parameter that requires grad")
    return plan


def refuse_backward_hooks(graph_name: str, named_modules: list[tuple[str, torch.nn.Module]],
                          named_parameters: list[tuple[str, torch.nn.Parameter]]) -> None:
    """A backward hook (a module's full backward hook or pre-hook, torch's global ones, a
    parameter's `register_hook` or post-accumulate hook) changes eager's gradients; the graph's
    autodiff never runs it, and trained silently without it (3.3 off eager): refuse it."""
    from torch.nn.modules import module as module_mod

    found = [f"module '{path}'" for path, m in named_modules if m._backward_hooks or m._backward_pre_hooks]
    found += [f"parameter '{name}'" for name, p in named_parameters
              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)]
    if module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks:
        found.append("every module (torch.nn.modules.module.register_module_full_backward_hook)")
    if found:
        raise UnsupportedOptionError(
            f"{graph_name}: {found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''} has a backward "
            f"hook; a training graph computes its gradients with its own autodiff, which runs no hook. Remove "
            f"the hook (handle.remove()) and write what it does in build() (scale the loss, or clip with a param "
            f"group's clip_grad_max_norm), or train that model eagerly")


def module_device(modules: Mapping[str, torch.nn.Module]) -> torch.device:
    """Where the modules' tensors live (for a build() without tensor arguments)."""
    for module in modules.values():
        for t in itertools.chain(module.parameters(), module.buffers()):
            return t.device
    return torch.device("cpu")


def compile_or_load(graph_class: str, traced: TracedGraph, plan: TrainingPlan | None, device: torch.device,
                    options: CompileOptions, modules: Mapping[str, torch.nn.Module], log: GraphLog,
                    build: Any) -> CompiledGraph:
    """Load the program from the persistent compiled cache, or lower and compile it (and store
    it there). A failure inside TVM becomes a `CompileError` naming the graph and the stage."""
    try:
        return _compile_or_load(graph_class, traced, plan, device, options, modules, log, build)
    except TvmGraphError:
        raise
    except Exception as e:  # TVM raises its own InternalError/TVMError/ValueError types
        missing = _NO_GRADIENT.findall(str(e))
        if missing:
            ops = ", ".join(sorted(set(missing)))
            raise UnsupportedOpError(
                f"{traced.graph_name}: build() needs the gradient of {ops}, which tvmgraph cannot compute "
                f"yet. {gradient_check.ADVICE}"
            ) from None
        raise CompileError(
            f"{traced.graph_name}: compiling build() failed inside TVM ({type(e).__name__}: "
            f"{reason_of(e, lines=3)}). This is a tvmgraph bug: please report it with the model. To work "
            f"around it, turn off tvmgraph's passes one at a time (graph.config.allow_fuse_add_to_output"
            f"(False), allow_fuse_model_update_ops(False), enable_compress_memory(False)), or run the "
            f"failing module eagerly outside the graph; graph.debug(1) shows the stages."
        ) from e


_NO_GRADIENT = re.compile(r"FPrimalGradient has not been registered for (relax\.[\w.]+)")


def _compile_or_load(graph_class: str, traced: TracedGraph, plan: TrainingPlan | None, device: torch.device,
                     options: CompileOptions, modules: Mapping[str, torch.nn.Module], log: GraphLog,
                     build: Any) -> CompiledGraph:
    cache = artifact.compiled_cache()
    target = target_for(device, options)
    tuning = applied_tuning_log(graph_class, options, target, log)
    key = artifact.graph_key(graph_class, traced, plan, options, target, PIPELINE,
                             tuning.digest if tuning is not None else "none")
    if cache is not None:
        program = CompiledProgram.from_cache(cache, key)
        if program is not None:
            log.info(0, f"loaded the compiled program from the cache ({key}).")
            return program.bind(device, modules, traced, plan)
    with log.stage("lowering to Relax" + (" with autodiff and optimizer update" if plan else "")):
        lowered = traced.lower(plan, report=lambda msg: log.info(1, msg))
    if log.on(2):
        log_ops(log, lowered, build)
    with log.stage(f"compiling for {device}"):
        # At debug(1) every pass's result is checked (tvmgraph/pipeline.py).
        program = lowered.compile(target, options, PIPELINE, report=lambda msg: log.info(1, msg),
                                  checks=True if log.on(1) else None, tuning=tuning)
    if cache is not None:
        try:
            program = program.store(cache, key, codegen.export_library)
        except Exception as e:  # exporting links with a C compiler; without one, run from memory
            logger.warning("%s: could not export the compiled library (%s: %s); running it from memory "
                           "and not caching it", traced.graph_name, type(e).__name__, e)
    return program.bind(device, modules, traced, plan, lowered=lowered)


def applied_tuning_log(graph_class: str, options: CompileOptions, target: Any, log: GraphLog) -> Any:
    """The records of the graph's tuning log that this compile applies, or None; debug(1) says
    which log."""
    applied = tuning_log_for(graph_class, options, target)
    if applied is None:
        if options.tuning:
            log.info(1, "no tuned kernels for this graph and target (`tvmgraph tune` makes them)")
    else:
        log.info(1, f"tuning log {applied.directory}: {applied.kernels} tuned kernel(s)")
    return applied


def tuning_log_for(graph_class: str, options: CompileOptions, target: Any) -> Any:
    """The records of the tuning log of the graph's name and `target` that a compile applies
    (autotune/log.py), or None: tuning off, no log, or a log that selects nothing."""
    if not options.tuning:
        return None
    from autotune.log import TuningLog

    return TuningLog.for_graph(options.tuning_name or graph_class, target).applied()


def log_ops(log: GraphLog, lowered: LoweredGraph, build: Any) -> None:
    """v_level 2: every binding of the lowered entry; v_level 3: each ATen op with its module
    and source line."""
    from tvm import relax

    for var, value in relax.analysis.get_var2val(lowered.mod[lowered.entry]).items():
        if isinstance(value, relax.Call):
            args = ", ".join(getattr(a, "name", type(a).__name__) for a in value.args)
            op = getattr(value.op, "name", None) or getattr(value.op, "global_symbol", value.op)
            log.info(2, f"(OP:{var.name}) {op}({args}) -> {var.ty}")
    if log.on(3):
        for node in lowered.exported.graph.nodes:
            if node.op == "call_function":
                where = source_of(node.meta.get("stack_trace") or "", build)
                log.info(3, f"(OP:{node.name}) aten.{node.target.__name__} "
                            f"from {lowering.module_path(node)} at {where}")


def source_of(stack_trace: str, build: Any) -> str:
    """The innermost recorded frame that is not tvmgraph's own. torch records the frames of
    forward() methods and of build() (trace.py asks it to); without any, build's location."""
    frames = [line.strip() for line in stack_trace.splitlines() if line.strip().startswith("File ")]
    outside = [f for f in frames if os.sep + "tvmgraph" + os.sep not in f]
    if outside:
        return outside[-1]
    code = build.__func__.__code__
    return f'File "{code.co_filename}", line {code.co_firstlineno}, in build'

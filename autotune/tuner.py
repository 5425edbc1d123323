"""`tune(graph, *example_args)`: MetaSchedule over a graph's kernels, into its tuning log.

    1. lower the graph as its compile does and run the pipeline up to the tuning stage;
    2. give each kernel tvmgraph's default schedule and time it (autotune/tasks.py);
    3. tune the kernels that take most of that time: evolutionary search guided by the XGBoost
       cost model, every measured candidate appended to the log. Trials already in the log
       count, so a run that was killed continues where it stopped;
    4. per kernel, the tuned schedule is used only where it measured faster than the default,
       the two timed again side by side first;
    5. the whole program is timed with and without the tuned kernels; if tuned is slower, the
       log is disabled and compiles keep the default schedules.
Compiles of any graph with the same name and target then apply the log (autotune/apply.py).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tvm
import tvm_ffi
from tvm import relax, s_tir

from tvmgraph.errors import ConfigError, TuningError

from . import measure
from .log import Choices, KernelChoice, TuningLog, best_record, best_seconds, check_log_name
from .measure import RPCTarget
from .report import TuningReport
from .rounds import RoundByRound
from .tasks import Kernel, extract_kernels, worth_tuning

logger = logging.getLogger("tvmgraph.autotune")

TRIALS_PER_KERNEL = 32   # the default budget: enough for the search to beat a default schedule
TRIALS_PER_ROUND = 16    # candidates measured per kernel per round
FASTER = 0.98            # a tuned kernel must beat the default by 2% (timing noise) to be used
RETIME_ROUNDS = 3        # side-by-side timings of a default and its tuned rival before choosing


def tune(graph: Any, *example_args: Any, trials: int | None = None, minutes: float | None = None,
         target: Any = None, name: str | None = None, log_dir: str | os.PathLike | None = None,
         rpc: RPCTarget | None = None, progress: bool = False, check_graph: bool = True,
         eager: bool = False) -> TuningReport:
    """Tune `graph`'s kernels for `target` (default: the device of the inputs) and write its
    tuning log, which every later compile of a graph of that name applies.

    `example_args`: the inputs to tune for; none: those of the graph's last call. `trials`:
    candidates measured in all (default: 32 per kernel worth tuning); `minutes`: stop after
    that long. `name`: the log's graph name (default: graph.config's, else the Graph subclass's
    name); given, the graph also compiles with that log from now on
    (`graph.config.enable_tuning(name=name)`). `log_dir`: a tuning root other than
    $TVMGRAPH_CACHE_DIR/tuning. `rpc`: measure on a remote device through a TVM RPC tracker.
    `check_graph`: time the whole program with and without the tuned kernels (local targets).
    `eager`: also time build() in eager PyTorch.
    """
    from tvmgraph.nn import Graph

    if not isinstance(graph, Graph):
        raise TuningError(f"tune: the graph is a {type(graph).__name__}, not a tvmgraph.nn.Graph; wrap the module "
                          f"in a Graph subclass (its build() calls the module) and tune that")
    if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))
                                or not math.isfinite(minutes) or minutes <= 0):
        raise ConfigError(f"tune({graph.name}): minutes={minutes!r}; pass a number of minutes > 0, or None "
                          f"for no time limit")
    started = time.monotonic()
    lowered, options, device, args = _lowered(graph, example_args)
    graph_class = type(graph).__name__
    log_name = check_log_name(name or options.tuning_name or graph_class)
    tvm_target = _target(target, device, options)
    log = TuningLog.for_graph(log_name, tvm_target, Path(log_dir) if log_dir is not None else None)
    if name is not None:
        graph.config.enable_tuning(graph.config.tuning, name=name)
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 0):
        raise ConfigError(f"tune({graph.name}): trials={trials!r}; pass an int >= 0")

    from tvmgraph.pipeline import get_pipeline

    fused = get_pipeline(tvm_target, options, graph=graph.name, checks=False).until("tvmgraph.ApplyTuningLog")(
        lowered.mod)
    measured_target = measure.tuning_target(tvm_target)
    kernels = extract_kernels(fused, measured_target, options)
    if not kernels:
        raise TuningError(f"tune({graph.name}): the program has no kernel to tune")
    build, run = measure.builder(), measure.runner(rpc)
    for kernel, seconds in zip(kernels, measure.measure_seconds([k.default for k in kernels], measured_target,
                                                                build, run)):
        kernel.default_s = seconds
    chosen = searchable(worth_tuning(kernels), measured_target, graph.name)
    budget = trials if trials is not None else TRIALS_PER_KERNEL * len(chosen)
    defaults = [k.default_s for k in chosen if k.default_s]
    if defaults and rpc is None:  # hopeless candidates cut short (measure.HOPELESS)
        run = measure.runner(None, max(defaults))

    history: list[tuple[int, float]] = []
    with log.lock():
        dropped = log.repair()
        if dropped:
            logger.warning("tuning log %s: rewrote it without %d unreadable line(s)", log.directory, dropped)
        database = _open_database(log)
        done = {k.workload: _records(database, k) for k in chosen}
        remaining = budget - sum(len(r) for r in done.values())
        measured = 0
        if remaining > 0 and chosen:
            measured = _search(chosen, measured_target, database, build, run, remaining, minutes, progress, history,
                               [best_seconds(done[k.workload]) for k in chosen])
        retimed = _retime(chosen, database, measured_target, build, run)
        choices = _choose(kernels, chosen, database, retimed)
        if check_graph and rpc is None:
            choices.graph_untuned_ms, choices.graph_tuned_ms = _time_graph(lowered, tvm_target, options, log, choices)
            choices.enabled = bool(choices.graph_tuned_ms <= choices.graph_untuned_ms)
        log.write_choices(choices)
    report = TuningReport(log_name, str(tvm_target.export().get("mcpu") or tvm_target.kind.name), log.directory,
                          list(choices.kernels), len(kernels) - len(chosen), measured,
                          time.monotonic() - started, choices.graph_untuned_ms, choices.graph_tuned_ms,
                          enabled=choices.enabled, history=history)
    if eager and args is not None:
        report.eager_ms = _eager_ms(graph, args)
    return report


# ---- 1. the program, lowered as a compile would ----

def _lowered(graph: Any, example_args: tuple) -> tuple[Any, Any, torch.device, tuple | None]:
    """(LoweredGraph, CompileOptions, device, the example inputs) for the inputs given, or the
    last call's."""
    from tvmgraph import entry

    if example_args:
        steps = graph.config.gradient_accumulation_steps
        if steps > 1 and graph.training:  # the program runs one micro-batch (training/accumulation.py)
            from torch.utils._pytree import tree_map

            example_args = tree_map(lambda a: a.narrow(0, 0, a.shape[0] // steps)
                                    if isinstance(a, torch.Tensor) and a.dim() else a, example_args)
        traced = graph.trace(*example_args)
        st = graph._state("tuning the graph")  # the optimizers decide train_step vs main
        plan = entry.training_plan(st.name, st.optimizers, traced, graph.named_parameters, traced.signature.options)
        flat = [a for a in example_args if isinstance(a, torch.Tensor)]
        device = flat[0].device if flat else torch.device("cpu")
        return traced.lower(plan), traced.signature.options, device, example_args
    compiled = graph.compiled
    if compiled is None:
        raise TuningError(f"tune({graph.name}): the graph has not been called; call it once or pass example "
                          f"inputs: tvmgraph.tune(graph, x)")
    leaves = [torch.zeros(s.shape, dtype=s.dtype, device=s.device) for s in compiled.traced.signature.leaves]
    args = tuple(compiled.traced.args_tree.unflatten(leaves))
    return compiled.lowered, compiled.traced.signature.options, compiled.device, args


def _target(target: Any, device: torch.device, options: Any) -> tvm.target.Target:
    from tvmgraph.target import host_cpu, target_for

    if target is None or target == "host":
        return target_for(device, options)
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target == "cuda":
        return tvm.target.Target({"kind": "cuda", "arch": "sm_90"},
                                 host={"kind": "llvm", "mcpu": host_cpu()})
    raise ConfigError(f"tune: target={target!r}; use 'host', 'cuda', a dict or a tvm.target.Target")


# ---- 3. the search ----

def _open_database(log: TuningLog):
    from tvm.s_tir import meta_schedule as ms

    return ms.database.JSONDatabase(path_workload=str(log.workloads_path),
                                    path_tuning_record=str(log.records_path), allow_missing=True)


def _records(database: Any, kernel: Kernel) -> list[Any]:
    """Every candidate measured for `kernel`, failed ones included: each is a trial (the
    report's count adds up to the log's lines). `get_top_k` leaves out the candidates that
    failed to build or run, which a loaded machine's timeouts make."""
    if not database.has_workload(kernel.mod):
        return []
    # By the kernel's IR, not the workload object: a record committed with its own Workload
    # (a MemoryDatabase, a record built by hand) names an equal module through another object.
    return [r for r in database.get_all_tuning_records() if tvm_ffi.structural_equal(r.workload.mod, kernel.mod)]


def _tune_context(kernel: Kernel, target: tvm.target.Target, num_threads: int = 1, **more: Any) -> Any:
    """MetaSchedule's TuneContext for `kernel` with tvmgraph's search space (inside
    `measure.without_tensor_intrin()`)."""
    from tvm.s_tir import meta_schedule as ms

    return ms.TuneContext(mod=kernel.mod, target=target, space_generator=measure.search_space(target),
                          task_name=kernel.name, num_threads=num_threads, **more)


def searchable(kernels: list[Kernel], target: tvm.target.Target, graph_name: str) -> list[Kernel]:
    """The kernels MetaSchedule can make a design space for. Its generic rules refuse some of
    tvmgraph's own kernels (the attention kernel: a `reverse-compute-at` its staging does not
    allow), and one refusal ended the whole search, every other kernel's with it; a kernel left
    out keeps tvmgraph's schedule."""
    kept = []
    with measure.without_tensor_intrin():
        for kernel in kernels:
            context = _tune_context(kernel, target)
            try:
                context.space_generator.generate_design_space(context.mod)
            except Exception as e:  # noqa: BLE001  (TVM raises its own error types)
                logger.info("%s: MetaSchedule cannot schedule kernel %s (%s); it keeps tvmgraph's schedule",
                            graph_name, kernel.name, type(e).__name__)
                continue
            kept.append(kernel)
    return kept


def _search(kernels: list[Kernel], target: tvm.target.Target, database: Any, build: Any, run: Any,
            trials: int, minutes: float | None, progress: bool, history: list[tuple[int, float]],
            logged_s: list[float]) -> int:
    """Run MetaSchedule on `kernels` for `trials` candidates (or `minutes`); returns how many
    were measured. Every measured candidate is in `database` (the log) when this returns."""
    from tvm.s_tir import meta_schedule as ms

    quiet = logging.getLogger("tvmgraph.autotune.metaschedule")
    quiet.setLevel(logging.WARNING)
    threads = os.cpu_count() or 1
    with measure.without_tensor_intrin():
        contexts = [_tune_context(k, target, search_strategy=measure.search_strategy(), logger=quiet,
                                  num_threads=threads).clone() for k in kernels]
    bar = _progress_bar(trials) if progress else None

    def on_round(measured: int, estimate_us: float) -> None:
        history.append((measured, estimate_us))
        if bar is not None:
            bar.set_postfix_str(f"tuned kernels {estimate_us:.0f} µs", refresh=False)
            bar.update(measured - bar.n)

    scheduler = RoundByRound([k.calls for k in kernels],
                             [min(k.default_s or math.inf, logged) for k, logged in zip(kernels, logged_s)],
                             deadline=time.monotonic() + 60 * minutes if minutes else None, on_round=on_round)
    try:
        with tempfile.TemporaryDirectory(prefix="tvmgraph-tune-") as work_dir:
            ms.tune_tasks(tasks=contexts, task_weights=[float(k.calls) for k in kernels], work_dir=work_dir,
                          max_trials_global=trials, num_trials_per_iter=TRIALS_PER_ROUND, builder=build,
                          runner=run, database=database, cost_model=ms.cost_model.XGBModel(num_tuning_cores=threads),
                          measure_callbacks=[*ms.measure_callback.MeasureCallback.create("default"),
                                             scheduler.measure_callback()],
                          task_scheduler=scheduler)
    finally:
        if bar is not None:
            bar.close()
    return scheduler.measured


def _progress_bar(trials: int):
    from tqdm import tqdm

    return tqdm(total=trials, unit="trial", desc="tuning", dynamic_ncols=True)


# ---- 4. per kernel: tuned or default ----

def _retime(chosen: list[Kernel], database: Any, target: tvm.target.Target, build: Any,
            run: Any) -> dict[str, float]:
    """Time the default and the best tuned schedule of each kernel whose tuned one looked
    faster, side by side, RETIME_ROUNDS times; updates its `default_s`, returns the tuned
    times by workload. The defaults were timed once, minutes before the search ended, and on a
    shared machine one kernel's time moved up to 3x between runs (the CNN's multiply84: 560 µs
    in one tune, 1589 µs in the next): a default timed slow once could lose to a schedule no
    faster than it."""
    rivals = []
    for k in chosen:
        record = best_record(_records(database, k))
        if record is not None and k.default_s is not None and best_seconds([record]) < FASTER * k.default_s:
            schedule = s_tir.Schedule(k.mod)
            record.trace.apply_to_schedule(schedule, remove_postproc=False)
            rivals.append((k, schedule.mod))
    if not rivals:
        return {}
    times = measure.measure_seconds([m for k, tuned in rivals for m in (k.default, tuned)], target, build, run,
                                    rounds=RETIME_ROUNDS)
    retimed = {}
    for (k, _), default_s, tuned_s in zip(rivals, times[0::2], times[1::2]):
        k.default_s = default_s if default_s is not None else k.default_s
        retimed[k.workload] = tuned_s if tuned_s is not None else math.inf
    return retimed


def _choose(kernels: list[Kernel], chosen: list[Kernel], database: Any,
            retimed: dict[str, float] | None = None) -> Choices:
    """Per kernel: its tuned schedule where that measured FASTER than the default (`retimed`:
    tuned times measured beside the default, in place of the search's)."""
    result = []
    for k in chosen:
        records = _records(database, k)
        tuned = (retimed or {}).get(k.workload, best_seconds(records))
        tuned_s = tuned if math.isfinite(tuned) else None
        use = tuned_s is not None and (k.default_s is None or tuned_s < FASTER * k.default_s)
        result.append(KernelChoice(k.workload, k.name, k.flops, k.calls,
                                   k.default_s * 1e6 if k.default_s is not None else None,
                                   tuned_s * 1e6 if tuned_s is not None else None, len(records), use))
    return Choices(sorted(result, key=lambda c: -(c.calls * (c.default_us or 0))))


# ---- 5. the whole program, untuned vs tuned ----

def _time_graph(lowered: Any, target: tvm.target.Target, options: Any, log: TuningLog,
                choices: Choices) -> tuple[float, float]:
    """Median ms of the program without and with the kernels `choices` selects, interleaved."""
    log.write_choices(Choices(choices.kernels))  # what applied() reads, before the graph verdict
    applied = log.applied()
    # No kernel chose its tuned schedule: both programs are the same one, timed once.
    tunings = (None, applied) if applied is not None else (None,)
    device = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    programs = []
    for tuning in tunings:
        _, executable = lowered.build(target, options, tuning=tuning, checks=False)
        programs.append(relax.VirtualMachine(executable, device))
    args = _random_args(lowered.mod[lowered.entry], device)
    times: list[list[float]] = [[] for _ in programs]
    for _ in range(5):
        for i, vm in enumerate(programs):
            timer = vm.time_evaluator(lowered.entry, device, number=1, repeat=3, min_repeat_ms=100)
            times[i].append(float(timer(*args).median) * 1e3)
    return statistics.median(times[0]), statistics.median(times[-1])


def _random_args(func: relax.Function, device: tvm.runtime.Device) -> list[tvm.runtime.Tensor]:
    """Inputs for timing on `device`: small floats, zero integers (always valid indices)."""
    rng = np.random.default_rng(0)
    args = []
    for param in func.params:
        shape = [int(d) for d in param.ty.shape]
        dtype = param.ty.dtype.dtype
        value = (rng.uniform(-0.1, 0.1, shape) if "float" in dtype else np.zeros(shape)).astype(dtype)
        args.append(tvm.runtime.tensor(value, device))
    return args


def _eager_ms(graph: Any, args: tuple) -> float:
    """Median ms of build() in eager PyTorch (gradients it accumulates are put back)."""
    params = [p for _, p in graph.named_parameters()]
    saved = [p.grad for p in params]
    times = []
    try:
        for _ in range(10):
            start = time.perf_counter()
            with torch.no_grad() if not graph.training else torch.enable_grad():
                graph.build(*args)
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return statistics.median(times[2:])

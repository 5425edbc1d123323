"""How candidates are built and timed: MetaSchedule's builder and runner, set up for this machine.

- Builder: MetaSchedule's default build function imports `tvm.s_tir.tensor_intrin` in every
  worker process (hundreds of TVMScript functions: 23-60 s on 2 cores), so with its 30 s
  timeout every candidate timed out and nothing was measured. `build_candidate` skips that
  import (the llvm and cuda rules used here need no tensor intrinsics) and builds in ~0.3 s.
- Runner: a `LocalRunner` on this machine, or an `RPCRunner` through a tracker
  (`RPCTarget`), e.g. a board or a GPU machine running `python -m tvm.exec.rpc_server`.

`measure_seconds` times modules that are not tuning candidates (tvmgraph's default schedule
of each kernel) through the same builder and runner, so that default and tuned latencies are
measured the same way, on the same device.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

import tvm

BUILD_TIMEOUT_S = 120.0  # a 2-core machine under load builds a big kernel in tens of seconds
RUN_TIMEOUT_S = 60.0
# MetaSchedule's first candidates include schedules hundreds of times slower than the default
# one: on the CNN's training step a batch-norm gradient that runs 1.4 ms by default had
# candidates of 3.2 s and of more than 15 s, each run 4 times (a warm-up, 3 repeats of at least
# 50 ms) under a 60 s timeout. Once the defaults are known (`runner(..., slowest_default_s)`),
# a candidate slower than HOPELESS x the slowest kernel's default is timed once, not repeated,
# and one slower than GIVE_UP x it is stopped (at least MIN_TIMEOUT_S, for loading the module
# and filling its arguments): none of them can replace a default.
HOPELESS, GIVE_UP, MIN_TIMEOUT_S = 10.0, 100.0, 5.0


@dataclass(frozen=True)
class RPCTarget:
    """Where candidates run when not on this machine: a TVM RPC tracker and a device key."""

    host: str
    port: int
    key: str

    @staticmethod
    def parse(address: str, key: str) -> RPCTarget:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            from tvmgraph.errors import ConfigError

            raise ConfigError(f"--rpc takes HOST:PORT of a TVM RPC tracker, got {address!r}")
        return RPCTarget(host, int(port), key)


def build_candidate(mod: tvm.IRModule, target: tvm.target.Target, _params: object = None) -> tvm.runtime.Module:
    """MetaSchedule's default build without importing tvm.s_tir.tensor_intrin (see above)."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target)


def builder(workers: int | None = None):
    from tvm.s_tir import meta_schedule as ms

    return ms.builder.LocalBuilder(max_workers=workers, timeout_sec=BUILD_TIMEOUT_S, f_build=build_candidate)


def runner(rpc: RPCTarget | None = None, slowest_default_s: float | None = None):
    """Each candidate runs at least 50 ms of repeats (short kernels vary a lot on a shared
    machine), 3 times; the record keeps the 3 means. With `slowest_default_s` (the slowest
    default schedule among the kernels tuned), hopeless candidates are cut short on this
    machine (see HOPELESS); over RPC it is ignored."""
    from tvm.s_tir import meta_schedule as ms

    evaluator = ms.runner.EvaluatorConfig(number=1, repeat=3, min_repeat_ms=50, enable_cpu_cache_flush=False)
    if rpc is not None:
        # NOTE: over RPC the candidate runs on another machine, whose speed the defaults measured
        # here do not tell: no cap there.
        config = ms.runner.RPCConfig(tracker_host=rpc.host, tracker_port=rpc.port, tracker_key=rpc.key,
                                     session_timeout_sec=RUN_TIMEOUT_S)
        return ms.runner.RPCRunner(rpc_config=config, evaluator_config=evaluator)
    if not slowest_default_s:
        return ms.runner.LocalRunner(timeout_sec=RUN_TIMEOUT_S, evaluator_config=evaluator)
    return ms.runner.LocalRunner(timeout_sec=min(RUN_TIMEOUT_S, max(MIN_TIMEOUT_S, GIVE_UP * slowest_default_s)),
                                 evaluator_config=evaluator,
                                 f_run_evaluator=CappedEvaluator(HOPELESS * slowest_default_s))


@dataclass(frozen=True)
class CappedEvaluator:
    """MetaSchedule's run evaluator (it runs in the runner's worker process), except that a
    candidate whose first run takes longer than `cap_s` is reported at that time, unrepeated."""

    cap_s: float

    def __call__(self, rt_mod, device, evaluator_config, repeated_args) -> list[float]:
        from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

        once = rt_mod.time_evaluator(func_name=rt_mod.entry_name, dev=device, number=1, repeat=1)
        device.sync()
        first = float(once(*repeated_args[0]).mean)
        if first > self.cap_s:
            return [first] * evaluator_config.repeat
        return run_evaluator_common(rt_mod, device, evaluator_config, repeated_args)


def measure_seconds(mods: list[tvm.IRModule], target: tvm.target.Target, build, run,
                    rounds: int = 1) -> list[float | None]:
    """The median run time of each module's `main` (None where it failed to build or run).
    Each is built once and run `rounds` times, the modules taking turns (a round runs each)."""
    from tvm.s_tir import meta_schedule as ms

    built = build.build([ms.builder.BuilderInput(mod, target) for mod in mods])
    inputs, where = [], []
    for i, (mod, result) in enumerate(zip(mods, built)):
        if result.error_msg is None:
            args = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
            device = "cuda" if target.kind.name == "cuda" else "cpu"
            inputs.append(ms.runner.RunnerInput(result.artifact_path, device, args))
            where.append(i)
    samples: list[list[float]] = [[] for _ in mods]
    try:
        for _ in range(rounds):
            for i, future in zip(where, run.run(inputs)):
                result = future.result()
                if result.error_msg is None and result.run_secs:
                    samples[i].append(statistics.median(float(s) for s in result.run_secs))
    finally:
        for result in built:  # each artifact sits in a temporary directory of its own
            if result.error_msg is None:
                shutil.rmtree(os.path.dirname(result.artifact_path), ignore_errors=True)
    return [statistics.median(s) if s else None for s in samples]


# What MetaSchedule's CUDA rules read from a target; a plain {"kind": "cuda", "arch": ...} lacks
# them. The values hold for every NVIDIA GPU since Kepler (48 KiB is the static shared-memory limit).
CUDA_LIMITS = {"max_threads_per_block": 1024, "max_shared_memory_per_block": 49152, "thread_warp_size": 32,
               "max_num_threads": 1024}


def tuning_target(target: tvm.target.Target) -> tvm.target.Target:
    """`target` with what MetaSchedule's rules require: the core count of a CPU ("num-cores"),
    the thread and shared-memory limits of a GPU."""
    spec = target.export()
    if target.kind.name == "llvm" and "num-cores" not in spec:
        return tvm.target.Target({**spec, "num-cores": os.cpu_count() or 1})
    if target.kind.name == "cuda":
        missing = {k: v for k, v in CUDA_LIMITS.items() if spec.get(k) in (None, -1, 0)}
        if missing:
            return tvm.target.Target({**spec, **missing})
    return target


def search_space(target: tvm.target.Target):
    """MetaSchedule's generic rules for the target's kind. Its per-CPU defaults ("from-target")
    add tensor-intrinsic rules on x86 CPUs with VNNI (int8 dot products), which need
    tvm.s_tir.tensor_intrin; tvmgraph's kernels are floating point and never match them."""
    from tvm.s_tir import meta_schedule as ms

    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    return ms.space_generator.PostOrderApply(sch_rules=ms.schedule_rule.ScheduleRule.create(kind),
                                             postprocs=ms.postproc.Postproc.create(kind),
                                             mutator_probs=ms.mutator.Mutator.create(kind))


# MetaSchedule's evolutionary search by default evolves 512 schedules for 4 generations before
# each round of TRIALS_PER_ROUND (16) measurements: 10-41 s per round of a CNN training step's
# fused kernels on 2 cores, 1.5-6 s with these (tuning measures 16 of them per round anyway).
POPULATION, MIN_UNMEASURED, GENERATIONS = 128, 32, 2


def search_strategy():
    """MetaSchedule's evolutionary search, with a population sized for a few cores."""
    from tvm.s_tir import meta_schedule as ms

    return ms.search_strategy.EvolutionarySearch(population_size=POPULATION, init_min_unmeasured=MIN_UNMEASURED,
                                                 genetic_num_iters=GENERATIONS)


@contextlib.contextmanager
def without_tensor_intrin() -> Iterator[None]:
    """Let MetaSchedule's TuneContext skip its import of tvm.s_tir.tensor_intrin (25-60 s here):
    it registers tensor intrinsics (VNNI, tensor cores, ...) that only the "-vnni"/"-tensorcore"
    rule sets use, not the default llvm and cuda rules tuning runs with. A real import later in
    the process still works: the stand-in is removed on exit."""
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        yield
        return
    sys.modules[name] = types.ModuleType(name)
    try:
        yield
    finally:
        if isinstance(sys.modules.get(name), types.ModuleType) and not hasattr(sys.modules[name], "__file__"):
            del sys.modules[name]

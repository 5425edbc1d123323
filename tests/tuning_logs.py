"""Tuning logs written without measuring anything, for tests of how compiles use them.

Each kernel of a graph gets one record: a schedule sampled from MetaSchedule's search space for
the target, post-processed as the search would, with a run time the test chooses. That is a
valid log for any target, CUDA included on a machine without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import tvm

from autotune import measure
from autotune.log import Choices, KernelChoice, TuningLog
from autotune.tasks import Kernel, extract_kernels
from autotune.tuner import _lowered
from tvmgraph.pipeline import get_pipeline


def kernels_of(graph, args: tuple, target: tvm.target.Target) -> list[Kernel]:
    lowered, options, _, _ = _lowered(graph, args)
    fused = get_pipeline(target, options, checks=False).until("tvmgraph.ApplyTuningLog")(lowered.mod)
    return extract_kernels(fused, measure.tuning_target(target), options)


def sampled_record(kernel: Kernel, target: tvm.target.Target, run_s: float, seed: int = 0):
    """A TuningRecord for `kernel`: the first sampled schedule its post-processors accept."""
    from tvm.s_tir import meta_schedule as ms

    target = measure.tuning_target(target)
    with measure.without_tensor_intrin():
        context = ms.TuneContext(mod=kernel.mod, target=target, space_generator=measure.search_space(target),
                                 search_strategy="evolutionary", num_threads=1, rand_state=seed).clone()
    from tvm.s_tir import Schedule

    for space in context.space_generator.generate_design_space(kernel.mod):
        for attempt in range(64):  # the search's own sampling: replay the space, decisions drawn anew
            sch = Schedule(kernel.mod, seed=seed * 64 + attempt + 1)
            space.trace.apply_to_schedule(sch, remove_postproc=True, decision_provider=lambda *_: None)
            sch.enter_postproc()
            if all(p.apply(sch) for p in context.space_generator.postprocs):
                workload = ms.database.Workload(kernel.mod)
                return ms.database.TuningRecord(sch.trace, workload, [run_s], target)
    raise AssertionError(f"no schedule of {kernel.name} passed the post-processors")


def write_log(graph, args: tuple, name: str, target: tvm.target.Target, root: Path | None = None,
              tuned_us: float = 1.0, default_us: float = 10.0, kernels: int | None = None) -> TuningLog:
    """A log for `graph` under `name` whose records (the first `kernels`, default all) measured
    `tuned_us` against `default_us` for the default schedule."""
    from tvm.s_tir import meta_schedule as ms

    log = TuningLog.for_graph(name, target, root)
    log.directory.mkdir(parents=True, exist_ok=True)
    database = ms.database.JSONDatabase(str(log.workloads_path), str(log.records_path), allow_missing=True)
    choices = []
    for i, kernel in enumerate(kernels_of(graph, args, target)[:kernels]):
        record = sampled_record(kernel, target, tuned_us * 1e-6, seed=i)
        database.commit_workload(kernel.mod)
        database.commit_tuning_record(record)
        choices.append(KernelChoice(kernel.workload, kernel.name, kernel.flops, kernel.calls, default_us,
                                    tuned_us, 1, tuned_us < default_us))
    log.write_choices(Choices(choices))
    return log

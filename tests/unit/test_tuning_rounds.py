"""autotune/rounds.py: the search measures each kernel's round before it searches the next one,
spends rounds where the program has most time to gain, and stops at its deadline with every
measured candidate logged.

The builder and runner here are stand-ins that record what MetaSchedule asks of them and
report a fixed time per kernel: the order of events is the behaviour under test, not the
candidates' speed."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import tvm
from tvm import te
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from autotune import tuner
from autotune.tasks import Kernel

ROUND = tuner.TRIALS_PER_ROUND


def _matmul(n: int) -> tvm.IRModule:
    a = te.placeholder((n, n), name="a")
    b = te.placeholder((n, n), name="b")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="c")
    return tvm.IRModule({"main": te.create_prim_func([a, b, c])})


def _kernel(n: int, calls: int, default_s: float) -> Kernel:
    mod = _matmul(n)
    return Kernel(f"matmul{n}", mod, ms.database.Workload(mod).as_json()[0], calls, 2.0 * n**3, mod, default_s)


def _artifact(mod: tvm.IRModule) -> str:
    """A path in a directory of its own (MetaSchedule deletes it after the run), named after the
    kernel's matrix size."""
    size = int(ms.arg_info.ArgInfo.from_prim_func(mod["main"])[0].shape[0])
    return os.path.join(tempfile.mkdtemp(prefix="tvmgraph-test-"), str(size))


class _Events:
    """What the builder and runner were asked, in order: ("build", n), ("run", n), ("result", kernel)."""

    def __init__(self, seconds: dict[int, float], slow_s: float = 0.0) -> None:
        self.log: list[tuple[str, int]] = []
        self.seconds = seconds  # a kernel's (its matrix size's) time on every candidate
        self.slow_s = slow_s    # how long each result takes to come back

    def builder(self):
        events = self

        @derived_object
        class Builder(ms.builder.PyBuilder):
            def build(self, build_inputs):
                events.log.append(("build", len(build_inputs)))
                return [ms.builder.BuilderResult(_artifact(i.mod), None) for i in build_inputs]

        return Builder()

    def runner(self):
        events = self

        @derived_object
        class Future(ms.runner.PyRunnerFuture):
            def __init__(self, size: int) -> None:
                super().__init__()
                self.size = size

            def done(self) -> bool:
                return True

            def result(self):
                time.sleep(events.slow_s)
                events.log.append(("result", self.size))
                return ms.runner.RunnerResult([events.seconds[self.size]], None)

        @derived_object
        class Runner(ms.runner.PyRunner):
            def run(self, runner_inputs):
                events.log.append(("run", len(runner_inputs)))
                return [Future(int(os.path.basename(i.artifact_path))) for i in runner_inputs]

        return Runner()


def _search(kernels, events, trials, minutes=None):
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    database = ms.database.MemoryDatabase()
    history: list[tuple[int, float]] = []
    measured = tuner._search(kernels, target, database, events.builder(), events.runner(), trials, minutes,
                             False, history, [float("inf")] * len(kernels))
    return measured, database, history


def test_each_round_is_measured_before_the_next_kernel_is_searched() -> None:
    """MetaSchedule's own schedulers built and started a round of every kernel before the first
    result came back (on the CNN, 8 minutes with nothing logged)."""
    kernels = [_kernel(32, 1, 1e-3), _kernel(48, 1, 1e-3), _kernel(64, 1, 1e-3)]
    events = _Events({32: 1e-3, 48: 1e-3, 64: 1e-3})
    measured, database, history = _search(kernels, events, trials=3 * ROUND)
    assert measured == 3 * ROUND and len(database.get_all_tuning_records()) == 3 * ROUND
    rounds = []
    for kind, n in events.log:
        if kind == "build":
            rounds.append([])
        rounds[-1].append((kind, n))
    # every round: its candidates built, run, and all their results back before the next build
    assert [r[:2] for r in rounds] == [[("build", ROUND), ("run", ROUND)]] * 3
    assert [[n for kind, n in r[2:]] for r in rounds] == [[32] * ROUND, [48] * ROUND, [64] * ROUND]
    assert [m for m, _ in history] == [ROUND, 2 * ROUND, 3 * ROUND]


def test_rounds_go_where_the_program_has_most_time_to_gain() -> None:
    """After one round each, the kernel called 10 times gets rounds until, halved for each round
    that did not beat it, its share drops below the other kernel's."""
    kernels = [_kernel(32, 1, 1e-3), _kernel(48, 10, 1e-3)]
    events = _Events({32: 1e-3, 48: 1e-3})  # no candidate beats a default
    _search(kernels, events, trials=7 * ROUND)
    picks = [n for kind, n in events.log if kind == "result"][::ROUND]
    # 48's priority 10 ms x 0.5^stale: 5, 2.5, 1.25, 0.625 > 32's 0.5, then 0.31 < 0.5
    assert picks == [32, 48, 48, 48, 48, 48, 32]


def test_a_faster_round_keeps_the_kernel_first() -> None:
    kernels = [_kernel(32, 1, 1e-3), _kernel(48, 2, 1e-3)]
    events = _Events({32: 1e-3, 48: 0.1e-3})  # 48's candidates are 10x faster than its default
    _search(kernels, events, trials=4 * ROUND)
    picks = [n for kind, n in events.log if kind == "result"][::ROUND]
    # after its first round 48 runs 0.2 ms of the program (stale 0), 32 runs 1 ms (stale 1): 0.5 ms
    assert picks == [32, 48, 32, 32]


def test_the_time_budget_stops_after_the_round_in_flight_with_it_logged() -> None:
    kernels = [_kernel(32, 1, 1e-3), _kernel(48, 1, 1e-3), _kernel(64, 1, 1e-3)]
    events = _Events({32: 1e-3, 48: 1e-3, 64: 1e-3}, slow_s=0.5 / ROUND)  # each round takes 0.5 s
    started = time.monotonic()
    measured, database, _ = _search(kernels, events, trials=30 * ROUND, minutes=0.6 / 60)
    assert time.monotonic() - started < 5
    assert measured in (ROUND, 2 * ROUND)  # the round under way when 0.6 s passed finishes
    assert len(database.get_all_tuning_records()) == measured
    assert sum(kind == "build" for kind, _ in events.log) == measured // ROUND


def test_metaschedules_default_scheduler_starts_every_kernel_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why rounds.py exists: with MetaSchedule's default ("gradient") scheduler the first result
    is read only after every kernel's round was built and started (if this fails, TVM changed
    and rounds.py may go)."""
    real = ms.tune_tasks

    def with_scheduler(**kwargs):
        kwargs["task_scheduler"] = "gradient"
        return real(**kwargs)

    monkeypatch.setattr(ms, "tune_tasks", with_scheduler)
    events = _Events({32: 1e-3, 48: 1e-3, 64: 1e-3})
    _search([_kernel(32, 1, 1e-3), _kernel(48, 1, 1e-3), _kernel(64, 1, 1e-3)], events, trials=3 * ROUND)
    first_result = [kind for kind, _ in events.log].index("result")
    assert events.log[:first_result] == [("build", ROUND), ("run", ROUND)] * 3


def test_a_kernels_failed_candidates_count_as_its_trials() -> None:
    """A candidate that failed to build or run (a timeout on a loaded machine: MetaSchedule logs
    it with 1e10 s) is a trial of its kernel, so the report's per-kernel counts add up to the
    log's records (`get_top_k`, used before, leaves such records out: the full suite's tuning
    test counted 15 of 16 once); the best is the fastest that ran."""
    small, other = _kernel(8, 1, 1e-3), _kernel(16, 1, 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        db = ms.database.JSONDatabase(f"{tmp}/w.json", f"{tmp}/r.json", allow_missing=True)
        target = tvm.target.Target({"kind": "llvm"})
        trace = tvm.s_tir.Schedule(small.mod).trace
        for kernel, seconds in ((small, 2e-3), (small, 1e10), (small, 1e-3), (other, 5e-3)):
            workload = db.commit_workload(kernel.mod)
            db.commit_tuning_record(ms.database.TuningRecord(
                trace, workload, [tvm.tirx.FloatImm("float32", seconds)], target))
        records = tuner._records(db, small)
        assert len(records) == 3 and len(tuner._records(db, other)) == 1
        best = tuner.best_record(records)
        assert best is not None and float(best.run_secs[0]) == 1e-3

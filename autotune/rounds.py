"""Which kernel MetaSchedule searches next: one round at a time, each measured before the next.

MetaSchedule's task schedulers ("gradient", "round-robin") send a round of candidates of every
kernel to the builder and the runner before they wait for any result. On the CNN's training
step (24 kernels x 16 candidates) that meant 8 minutes before the first result reached the
log or the progress bar; a time budget, checked on results, could only act after that; and a
search stopped in between lost every candidate still in flight. It also timed candidates while
the next kernel's compiled on the same cores.

`RoundByRound` waits for each round's results before it picks the next kernel: first every
kernel once, slowest first (the order given), then the kernel with the most time left to
gain, halved for each round in a row that did not make it faster. Past the deadline it
picks none, which ends the search cleanly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .log import mean_seconds

BETTER = 0.98       # a round counts as progress when it beats the kernel's best by 2% (timing noise)
STALE_FACTOR = 0.5  # a kernel's priority is halved for each round in a row without progress


@derived_object
class RoundByRound(ms.task_scheduler.PyTaskScheduler):
    """`calls[i] * best_s[i]`: kernel i's share of the program (best_s: its best time so far,
    default or logged). `on_round(measured, estimate_us)` after each round: candidates
    measured in this search, and the estimated time of all kernels at their best."""

    def __init__(self, calls: Sequence[int], best_s: Sequence[float], deadline: float | None = None,
                 on_round: Callable[[int, float], None] | None = None) -> None:
        super().__init__()
        self.calls = list(calls)
        self.best_s = list(best_s)
        self.deadline = deadline
        self.on_round = on_round
        self.rounds = [0] * len(self.calls)
        self.stale = [0] * len(self.calls)
        self.measured = 0
        self._in_flight: int | None = None

    def next_task_id(self) -> int:
        tasks = self._outer().tasks_
        if self._in_flight is not None:
            # None when MetaSchedule ended the kernel instead (search space or trial cap exhausted).
            if tasks[self._in_flight].measure_candidates is not None:
                self.join_running_task(self._in_flight)  # calls measure_callback(), as every join does
            self._in_flight = None
        if self.deadline is not None and time.monotonic() > self.deadline:
            return -1
        open_tasks = [i for i, task in enumerate(tasks) if not task.is_terminated]
        if not open_tasks:
            return -1
        unseen = [i for i in open_tasks if self.rounds[i] == 0]
        pick = unseen[0] if unseen else max(open_tasks, key=self._priority)
        self.rounds[pick] += 1
        self._in_flight = pick
        return pick

    def measure_callback(self) -> ms.measure_callback.PyMeasureCallback:
        """Pass this among tune_tasks' measure callbacks: it takes in each round's results,
        including the last round's, which MetaSchedule joins itself after the search."""
        return _Results(self)

    def _priority(self, i: int) -> float:
        share = self.calls[i] * self.best_s[i] if math.isfinite(self.best_s[i]) else math.inf
        return share * STALE_FACTOR ** self.stale[i]

    def record(self, i: int, results: Sequence[ms.runner.RunnerResult]) -> None:
        fastest = min((mean_seconds(r.run_secs) if r.error_msg is None else math.inf for r in results),
                      default=math.inf)
        self.stale[i] = 0 if fastest < BETTER * self.best_s[i] else self.stale[i] + 1
        self.best_s[i] = min(self.best_s[i], fastest)
        self.measured += len(results)
        if self.on_round is not None:
            estimate = sum(c * b for c, b in zip(self.calls, self.best_s) if math.isfinite(b))
            self.on_round(self.measured, estimate * 1e6)


@derived_object
class _Results(ms.measure_callback.PyMeasureCallback):
    def __init__(self, rounds: RoundByRound) -> None:
        super().__init__()
        self.rounds = rounds

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        self.rounds.record(task_id, runner_results)

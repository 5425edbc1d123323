"""Auto-tuning: MetaSchedule over a graph's kernels, with logs per graph name reused by compiles.

    log.py      where logs live, reading them defensively, the per-kernel choices, the lock
    tasks.py    the kernels of a graph's program, each with tvmgraph's default schedule
    measure.py  building and timing candidates here or over TVM RPC
    tuner.py    `tune(graph, *example_args)`: the search, the choices, the graph-level check
    apply.py    `ApplyTuningLog`, the tuning stage of the compile pipeline
    report.py   what a run found, as a table and a plot

docs/autotune.md describes the whole; `tvmgraph tune SCRIPT.py:FACTORY` is the command.
"""

from .log import TuningLog, target_key, tuning_root
from .measure import RPCTarget
from .report import TuningReport
from tvmgraph.errors import TuningError

from .tuner import tune

__all__ = ["RPCTarget", "TuningError", "TuningLog", "TuningReport", "target_key", "tune", "tuning_root"]

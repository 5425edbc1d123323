"""`ApplyTuningLog`: the tuning stage of the compile pipeline.

Position: after FuseTIR (the kernels are the fused PrimFuncs that tuning measured) and before
tvmgraph's default schedules, which then skip every kernel that got a tuned schedule here and
schedule the rest as they would without a log.

    before: @T.prim_func fused_matmul_add_relu(...)            # no schedule yet
    after:  @T.prim_func fused_matmul_add_relu(...)            # the log's best trace replayed,
                attrs {"tirx.is_scheduled": True}               # marked as scheduled
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, tirx

from tvmgraph.schedules.apply import is_scheduled

from .log import AppliedLog


def _scheduled(mod: tvm.IRModule) -> int:
    return sum(1 for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc) and is_scheduled(f))


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.ApplyTuningLog")
class ApplyTuningLog:
    """Replay the log's record of each kernel it has one for; without a log, do nothing."""

    def __init__(self, log: AppliedLog | None, report: Callable[[str], None] = lambda msg: None) -> None:
        self.log = log
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if self.log is None:
            return mod
        kernels = sum(1 for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc))
        before = _scheduled(mod)
        with self.log.database:
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        self.report(f"ApplyTuningLog: {_scheduled(mod) - before} of {kernels} kernels scheduled from the "
                    f"tuning log {self.log.directory} ({self.log.kernels} tuned kernel(s) in it)")
        return mod

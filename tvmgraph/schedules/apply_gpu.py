"""`ApplyGPUSchedules`: dlight's default GPU schedules, where a rule that raises costs only itself.

dlight's own `ApplyDefaultSchedule` lets a rule's exception end the compile. In TVM 0.27 its
`Reduction` rule raises inside `rfactor` ("Check failed: block_realize ==
old_block_realize_") on a reduction of a float16 AMP transformer's training step, so that step
did not build for CUDA. Here, as in `ApplyCPUSchedules`, the rules are tried in order on each
unscheduled PrimFunc and the first schedule one returns is kept; a rule that raises is logged and
the next one gets the function (dlight's `Fallback`, last, binds threads to anything with blocks).

A kernel that still writes memory outside any GPU thread binding stops the compile: code
generation would put it on the host, where it dereferences device pointers (a segfault in the
first call, as an embedding gradient written as a bare loop nest did on an H200).
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm_ffi.structural import structural_visit

from ..errors import PassError
from .apply import _target_of, _try_rule, is_scheduled
from .loops import with_functions

logger = logging.getLogger(__name__)


def default_gpu_rules() -> list[ScheduleRule]:
    """dlight's GPU rules, with tvmgraph's for long sums (convolution weight gradients, batch
    statistics) before them and for short sums (depthwise taps) before GeneralReduction."""
    from tvm.s_tir import dlight as dl

    from .gpu_long_reduction import LongReduction, ShortReduction

    return [LongReduction(), dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), ShortReduction(),
            dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.ApplyGPUSchedules")
class ApplyGPUSchedules:
    """Schedule each unscheduled PrimFunc for a GPU target with the first rule that succeeds."""

    def __init__(self, *rules: ScheduleRule) -> None:
        self.rules = list(rules) or default_gpu_rules()

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
                continue
            target = _target_of(func)
            if target is None or "gpu" not in target.keys:
                continue
            for rule in self.rules:
                scheduled = _try_rule(rule, func, target, gvar.name_hint)
                if scheduled is None:
                    continue
                if not _cross_thread_sums_lower(scheduled, target):
                    logger.debug("ApplyGPUSchedules: %s's schedule of %s does not lower", type(rule).__name__,
                                 gvar.name_hint)
                    continue
                updates[gvar] = scheduled.with_attr("tirx.is_scheduled", True)
                break
            else:
                logger.debug("ApplyGPUSchedules: no rule scheduled %s", gvar.name_hint)
        mod = with_functions(mod, updates)
        for gvar, func in mod.functions_items():
            target = _target_of(func) if isinstance(func, tirx.PrimFunc) else None
            if target is not None and "gpu" in target.keys and runs_on_host(func):
                raise PassError(f"kernel {gvar.name_hint} writes memory outside any GPU thread binding: no GPU "
                                f"schedule rule could bind it, and as host code it would read device pointers")
        return mod


def _cross_thread_sums_lower(func: tirx.PrimFunc, target: tvm.target.Target) -> bool:
    """Whether the sums a schedule splits over threads lower (the first lowering pass a
    rule's schedule can fail, at code generation: dlight's reduction rules split a window
    argmax of a dynamic batch across threads into a block LowerCrossThreadReduction refuses)."""
    try:
        s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({"main": func.with_attr("target", target)}))
    except Exception:  # noqa: BLE001  (TVM's errors come as several types)
        return False
    return True


def runs_on_host(func: tirx.PrimFunc) -> bool:
    """True when `func` stores to a buffer but binds no GPU thread (no thread_binding loop, no
    thread_extent attribute): built for a GPU, such a kernel is host code."""
    found = {"store": False, "thread": False}

    def on_store(node: tirx.BufferStore, visitor) -> None:
        found["store"] = True
        visitor.default_visit(node)

    def on_for(node: tirx.For, visitor) -> None:
        found["thread"] |= node.kind == tirx.ForKind.THREAD_BINDING
        visitor.default_visit(node)

    def on_attr(node: tirx.AttrStmt, visitor) -> None:
        found["thread"] |= node.attr_key == "thread_extent"
        visitor.default_visit(node)

    structural_visit(func.body, [(tirx.BufferStore, on_store), (tirx.For, on_for), (tirx.AttrStmt, on_attr)])
    return found["store"] and not found["thread"]

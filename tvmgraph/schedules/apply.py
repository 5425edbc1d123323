"""`ApplyCPUSchedules`: give every unscheduled PrimFunc of a module a default CPU schedule.

Position in the pipeline: after `LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps,
FuseTIR` (so that it sees the fused kernels) and before `RewriteDataflowReshape` and the
memory-planning passes. It runs under the llvm target it schedules for (`with target:`), or
reads the target from a PrimFunc's "target" attribute; without an llvm target it does nothing.

Like `tvm.s_tir.dlight.ApplyDefaultSchedule`, it tries the rules in order on each PrimFunc and
keeps the first schedule a rule returns. Unlike dlight, a rule that raises is logged and
skipped: a missing schedule makes a kernel slow, never the build fail. With `strict` (the tests
set TVMGRAPH_STRICT_SCHEDULES=1) an error of the rule's own Python (a TypeError, NameError,
KeyError... rather than TVM's refusal of a primitive) is raised instead: such a bug once left
kernels on slower schedules, unnoticed, until a benchmark moved.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target
from tvm_ffi.structural import structural_mutate

from .cpu_target import is_cpu
from .fast_math import use_fast_math
from .loops import InliningBlowUp, with_functions

logger = logging.getLogger(__name__)

# TVM 0.27 spells the attribute "tirx.is_scheduled"; older code (and the brief of this
# package) says "tir.is_scheduled". Either one marks a function as done.
SCHEDULED_ATTRS = ("tirx.is_scheduled", "tir.is_scheduled")
# A kernel whose schedule needs more of LLVM than the target's opt-level (tvmgraph builds at
# -O1 for compile time) carries the level it needs; codegen.py builds it at that level. A rule
# asks for it with a class attribute `llvm_opt_level`.
OPT_LEVEL_ATTR = "tvmgraph.llvm_opt_level"


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """True when `func` carries a truthy is_scheduled attribute."""
    attrs = func.attrs
    return attrs is not None and any(bool(attrs.get(key, False)) for key in SCHEDULED_ATTRS)


def _target_of(func: tirx.PrimFunc) -> Target | None:
    target = func.attrs.get("target") if func.attrs is not None else None
    return target if target is not None else Target.current(allow_none=True)


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.ApplyCPUSchedules")
class ApplyCPUSchedules:
    """Schedule each PrimFunc with the first CPU rule that matches it.

    `ApplyCPUSchedules()` uses `default_rules()`: matmul, convolution, reductions,
    element-wise, then a catch-all that parallelizes and vectorizes whatever is left.
    Pass rules explicitly to change the order or drop one. With `fast_math` (the default),
    float32 exp/erf/tanh/sigmoid are first expanded into vectorizable polynomials (see
    `fast_math.py` for their accuracy); the rewrite is kept where a rule schedules the function.
    """

    def __init__(self, *rules: ScheduleRule, fast_math: bool = True, strict: bool = False) -> None:
        if not rules:
            from .rules import default_rules

            rules = tuple(default_rules())
        self.rules = list(rules)
        self.fast_math = fast_math
        self.strict = strict

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        """Return `mod` with every unscheduled PrimFunc replaced by its scheduled version."""
        todo = [(gvar, func, _target_of(func)) for gvar, func in mod.functions_items()
                if isinstance(func, tirx.PrimFunc) and not is_scheduled(func)]
        todo = [item for item in todo if is_cpu(item[2])]
        # NOTE: threads, because TVM releases the GIL inside its schedule primitives: on 2
        # cores the CNN training step's 234 kernels schedule in 3.2 s instead of 3.9 s.
        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1) or 1) as pool:
            results = list(pool.map(lambda item: self._schedule(*item), todo))
        updates: dict[tvm.ir.GlobalVar, tirx.PrimFunc] = {}
        used: Counter[str] = Counter()
        for (gvar, _, _), (rule_name, scheduled) in zip(todo, results):
            if scheduled is not None:
                updates[gvar] = scheduled
                used[rule_name] += 1
        if updates:
            mod = with_functions(mod, updates)
            summary = ", ".join(f"{name} {n}" for name, n in sorted(used.items()))
            logger.debug("ApplyCPUSchedules: scheduled %d PrimFuncs (%s)", len(updates), summary)
        return mod

    def _schedule(self, gvar: tvm.ir.GlobalVar, func: tirx.PrimFunc,
                  target: Target) -> tuple[str, tirx.PrimFunc | None]:
        """(the rule's name, the scheduled function), or ("", None) when no rule matches."""
        if self.fast_math:
            func = use_fast_math(func)
        facts = KernelFacts.of(func)
        for rule in self.rules:
            if not facts.admits(rule):
                continue
            scheduled = _try_rule(rule, func, target, gvar.name_hint, self.strict)
            if scheduled is not None:
                scheduled = scheduled.with_attr("tirx.is_scheduled", True)
                level = getattr(rule, "llvm_opt_level", None)
                if level is not None:
                    scheduled = scheduled.with_attr(OPT_LEVEL_ATTR, level)
                return type(rule).__name__, scheduled
        return "", None


@dataclass(frozen=True)
class KernelFacts:
    """What a kernel's blocks are, read in one walk, so that ApplyCPUSchedules tries no rule
    that could not match (each try made a schedule, 0.7 ms, before giving up: on the CNN
    training step's kernels, rules that gave up took a third of the schedules' time).

    A rule states what it needs with class attributes:
      `needs_reduction`: some block reduces;
      `needs_binary_reduction`: exactly one block reduces, reading two buffers and writing one
        (a matmul's or a convolution's `C += A * B`);
      `needs_block`: a block of this name (a kernel tvmgraph's passes made)."""

    reduces: bool
    binary_reduction: bool
    block_names: frozenset[str]

    @classmethod
    def of(cls, func: tirx.PrimFunc) -> KernelFacts:
        blocks: list[s_tir.SBlock] = []

        def visit(block: s_tir.SBlock, mutator: object) -> s_tir.SBlock:
            blocks.append(block)
            return mutator.default_mutate(block)  # blocks inside it too

        structural_mutate(func.body, [(s_tir.SBlock, visit)])
        blocks = [b for b in blocks if b.name_hint != "root"]
        reductions = [b for b in blocks if any(iv.iter_type == tirx.IterVar.CommReduce for iv in b.iter_vars)]
        binary = len(reductions) == 1 and len(reductions[0].reads) == 2 and len(reductions[0].writes) == 1
        return cls(bool(reductions), binary, frozenset(b.name_hint for b in blocks))

    def admits(self, rule: ScheduleRule) -> bool:
        """Whether `rule` could schedule the kernel, by what it says it needs."""
        if getattr(rule, "needs_reduction", False) and not self.reduces:
            return False
        if getattr(rule, "needs_binary_reduction", False) and not self.binary_reduction:
            return False
        block = getattr(rule, "needs_block", None)
        return block is None or block in self.block_names


def _raised_by_tvm(err: Exception) -> bool:
    """Whether TVM's own checks raised `err` (a primitive refused where a schedule does not fit a
    kernel, an rfactor TVM cannot do), or the rules refused a kernel they would blow up
    (InliningBlowUp): expected, the next rule gets the function. Errors that cross TVM's FFI
    carry `__tvm_ffi_error__`; anything else is a bug of the rule's Python."""
    return isinstance(err, (s_tir.ScheduleError, InliningBlowUp)) or hasattr(err, "__tvm_ffi_error__")


def _try_rule(
    rule: ScheduleRule, func: tirx.PrimFunc, target: Target, name: str, strict: bool = False
) -> tirx.PrimFunc | None:
    try:
        sch = rule.apply(func, target, False)
    # NOTE: a rule is heuristic code over arbitrary TIR; whatever it raises must only cost
    # the schedule, so the next rule gets the function.
    except Exception as err:  # noqa: BLE001
        if strict and not _raised_by_tvm(err):
            raise
        logger.debug("rule %s failed on %s: %s", type(rule).__name__, name, err)
        return None
    if sch is None:
        return None
    logger.debug("%s scheduled %s", type(rule).__name__, name)
    return sch.mod["main"]

"""tvmgraph's Relax passes; the helpers below are what the rewriting passes share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import tvm
from tvm import relax

if TYPE_CHECKING:
    from tvmgraph.schedules.cpu_target import CPUTarget


def graph_functions(mod: tvm.IRModule) -> Iterator[tuple[tvm.ir.GlobalVar, relax.Function]]:
    """Every Relax function of `mod` except fused kernel groups (attribute "Primitive")."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and "Primitive" not in (func.attrs or {}):
            yield gv, func


def report_counts(report: Callable[[str], None], pass_name: str, counts: Mapping[str, int]) -> None:
    """Say what a pass rewrote, `Name: rule x2, other x1`, when it rewrote anything."""
    if counts:
        report(f"{pass_name}: " + ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())))


def current_cpu() -> CPUTarget | None:
    """The vector facts of the llvm target the pass runs under (`with target:`); None under
    any other target or none: the CPU-only passes then leave the module alone."""
    from tvmgraph.schedules.cpu_target import CPUTarget

    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return None
    return CPUTarget.from_target(target)

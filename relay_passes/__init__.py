"""tvmgraph's Relax passes; the helpers below are what the rewriting passes share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import tvm
from tvm import relax


def graph_functions(mod: tvm.IRModule) -> Iterator[tuple[tvm.ir.GlobalVar, relax.Function]]:
    """Every Relax function of `mod` except fused kernel groups (attribute "Primitive")."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and "Primitive" not in (func.attrs or {}):
            yield gv, func


def report_counts(report: Callable[[str], None], pass_name: str, counts: Mapping[str, int]) -> None:
    """Say what a pass rewrote, `Name: rule x2, other x1`, when it rewrote anything."""
    if counts:
        report(f"{pass_name}: " + ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())))

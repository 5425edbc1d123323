"""tvmgraph's Relax passes; the helpers below are what the rewriting passes share."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import tvm
from tvm import relax

if TYPE_CHECKING:
    from tvmgraph.schedules.cpu_target import CPUTarget


# Relax's OpPatternKind kOpaque: FuseOps fuses nothing into or out of a PrimFunc carrying it as
# its "op_pattern" attribute (kernels that must stay apart: im2col, a Gram operand's copy,
# tvmgraph's loop kernels and one-kernel attention, LSTM cells, upsampling).
OPAQUE = 8


def graph_functions(mod: tvm.IRModule) -> Iterator[tuple[tvm.ir.GlobalVar, relax.Function]]:
    """Every Relax function of `mod` except fused kernel groups (attribute "Primitive")."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and "Primitive" not in (func.attrs or {}):
            yield gv, func


def mutate_graph_functions(mutator: relax.PyExprMutator, mod: tvm.IRModule,
                           drop_unused: bool = False) -> tvm.IRModule:
    """The module `mutator` (a PyExprMutator made over `mod`) builds by visiting each of `mod`'s
    graph functions; with `drop_unused`, the dataflow bindings left unread go (`bindings.drop_unread`,
    which keeps the boundary between a training step's forward and backward blocks)."""
    from relay_passes.bindings import drop_unread  # bindings imports this module

    for gv, func in graph_functions(mod):
        new = mutator.visit_expr(func)
        mutator.builder_.update_func(gv, drop_unread(new) if drop_unused else new)
    return mutator.builder_.get()


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


class CountingMutator(Protocol):
    """A PyExprMutator that counts what it rewrote (`counts`, for `report_counts`)."""

    counts: Mapping[str, int]


def rewrite_on_cpu(mod: tvm.IRModule, pass_name: str, report: Callable[[str], None],
                   make: Callable[[CPUTarget], CountingMutator], drop_unused: bool = False) -> tvm.IRModule:
    """What a CPU-only rewriting pass does with `mod`: nothing outside an llvm target; else
    `make(cpu)`'s rewrite of the graph functions (the bindings left unread dropped with
    `drop_unused`), reported, or `mod` itself when nothing was rewritten."""
    cpu = current_cpu()
    if cpu is None:
        return mod
    rewriter = make(cpu)
    out = rewrite_graph_functions(mod, pass_name, report, rewriter, drop_unused=drop_unused)
    return out if rewriter.counts else mod


def rewrite_graph_functions(mod: tvm.IRModule, pass_name: str, report: Callable[[str], None],
                            rewriter: CountingMutator, drop_unused: bool = False) -> tvm.IRModule:
    """What a rewriting pass does with `mod`: `rewriter`'s (made over `mod`) rewrite of the graph
    functions (the bindings left unread dropped with `drop_unused`), reported."""
    out = mutate_graph_functions(rewriter, mod, drop_unused=drop_unused)
    report_counts(report, pass_name, rewriter.counts)
    return out

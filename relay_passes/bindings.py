"""What a binding reads: the one helper the passes that walk bindings share."""

from __future__ import annotations

from tvm import relax


def vars_in(expr: relax.Expr) -> list[relax.Var]:
    """The variables `expr` refers to, in visiting order (with repeats)."""
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None)
    return found

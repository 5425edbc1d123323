"""Refuse a training program whose loss needs gradients TVM lacks, naming all of them at once.

`relax.transform.Gradient` stops at the first op without an `FPrimalGradient`, so a user would
fix one op, compile again and hit the next. This check walks the bindings the loss depends on
first and lists every such op, each with the torch op, module and source line it came from.

What it walks is what Gradient differentiates (checked on TVM 0.27): every binding the loss
depends on through floating-point values, whether a trained parameter feeds it or not (an op
applied to an input alone fails autodiff too). Integer and boolean values are not walked: the
ops that consume them as indices or conditions (take, index_tensor, where, ...) give them no
gradient, so their producers (argmax used as an index) are never differentiated. One exception:
TVM's `astype` passes its gradient back to an integer input, so Gradient does differentiate an
integer value cast to float (`argmax(x).float()`); that producer is not listed here, and if it
has no gradient (an integer-valued op should have a no-gradient one), autodiff fails on it and
tvmgraph/entry.py names it alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import tvm
from tvm import relax

from ..errors import UnsupportedOpError

#: Ops Gradient treats apart from their FPrimalGradient (they have none): whether it gets through.
_SPECIAL = {
    "relax.call_tir_with_grad": True,  # differentiated by the TE gradient its attributes name (dropout)
    "relax.call_tir": False,  # refused outright
    "relax.grad.start_checkpoint": True,  # recomputation markers (relay_passes/recompute_attention.py),
    "relax.grad.end_checkpoint": True,  # removed before differentiating
}

_NO_GRAD = tvm.ir.Op.get("relax.grad.no_grad")

#: What to do about a missing gradient (shared with the error raised when autodiff itself fails).
ADVICE = ("Rewrite that code with ops that have gradients (docs/gradients.md lists them), or compute it "
          "outside the graph and pass the result in. TVM's autodiff differentiates everything the loss "
          "depends on, even what no trained parameter feeds, so freezing parameters does not help.")


def has_gradient(op_name: str) -> bool:
    """Whether relax.transform.Gradient can differentiate calls of `op_name`."""
    if op_name in _SPECIAL:
        return _SPECIAL[op_name]
    return tvm.ir.Op.get(op_name).get_attr("FPrimalGradient") is not None


def check_gradients(func: relax.Function, loss_index: int, origins: Mapping[str, str], graph_name: str) -> None:
    """Raise UnsupportedOpError listing every op without a gradient that the loss (field
    `loss_index` of `func`'s result) needs. `origins` maps a Relax variable's name to the torch
    op it came from (`tvmgraph.lower.relax_origins`)."""
    bindings = _bindings(func)
    missing = [var for var in _differentiated(func, bindings, loss_index)
               if isinstance(bindings[var], relax.Call) and isinstance(bindings[var].op, tvm.ir.Op)
               and not has_gradient(bindings[var].op.name)]
    if not missing:
        return
    owners = _owners(bindings, origins)
    ops = dict.fromkeys(bindings[var].op.name for var in missing)
    lines = dict.fromkeys(f"  * {bindings[var].op.name}" + (f": {owners[var]}" if var in owners else "")
                          for var in missing)  # one per op and place
    raise UnsupportedOpError(
        f"{graph_name}: build() needs the gradient of {', '.join(ops)}, which tvmgraph cannot compute "
        f"yet:\n" + "\n".join(lines) + f"\n{ADVICE}"
    )


def _bindings(func: relax.Function) -> dict[relax.Var, relax.Expr]:
    """Each variable bound in `func`, in program order, with its value."""
    return {b.var: b.value for block in func.body.blocks for b in block.bindings}


def _is_float(ty: relax.Type) -> bool:
    if isinstance(ty, relax.TupleType):
        return any(_is_float(field) for field in ty.fields)
    dtype = getattr(ty, "dtype", None)
    return dtype is not None and str(getattr(dtype, "dtype", dtype)).startswith(("float", "bfloat"))


def _vars_in(expr: relax.Expr) -> list[relax.Var]:
    if isinstance(expr, relax.Var):
        return [expr]
    if isinstance(expr, relax.Tuple):
        return [v for field in expr.fields for v in _vars_in(field)]
    return []


def _inputs(value: relax.Expr) -> list[relax.Var]:
    """The variables a binding's value reads."""
    if isinstance(value, relax.Call):
        return [v for arg in value.args for v in _vars_in(arg)]
    if isinstance(value, relax.TupleGetItem):
        return _vars_in(value.tuple_value)
    return _vars_in(value)  # Tuple, Var


def _differentiated(func: relax.Function, bindings: dict[relax.Var, relax.Expr], loss_index: int) -> list[relax.Var]:
    """The bound variables Gradient differentiates, in program order."""
    body = func.body.body
    loss = body.fields[loss_index] if isinstance(body, relax.Tuple) else body
    reached, stack = set(), _vars_in(loss)
    while stack:
        var = stack.pop()
        if var in reached or var not in bindings:  # function parameters end the walk
            continue
        reached.add(var)
        value = bindings[var]
        if isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op):
            continue  # Gradient skips calls of functions
        if isinstance(value, relax.Call) and value.op.same_as(_NO_GRAD):
            continue  # its input gets no gradient (a detach, a random op: random_ops.py)
        stack += [v for v in _inputs(value) if _is_float(v.ty)]
    return [var for var in bindings if var in reached]


def _owners(bindings: dict[relax.Var, relax.Expr], origins: Mapping[str, str]) -> dict[relax.Var, str]:
    """The origin of each variable: its own, or else that of a later binding that reads it (a
    converter emits a node's intermediate bindings just before the node's result)."""
    owners: dict[relax.Var, str] = {}
    for var in reversed(list(bindings)):
        if var.name in origins:
            owners[var] = origins[var.name]
        if var in owners:
            for read in _inputs(bindings[var]):
                if read in bindings and read.name not in origins:
                    owners.setdefault(read, owners[var])
    return owners

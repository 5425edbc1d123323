"""Every converter's results checked against the shapes and dtypes tracing recorded.

torch.export records each op's result (`meta["val"]`); a converter that builds a result of
another shape is a converter bug, and the program would have run on it: the stock
`index.Tensor` converter made `x[:, i, j]` a [2, 3, 3, 5] tensor where torch gives [2, 3, 5]
(an outer product of the indices instead of their pairs), and the graph returned it. Here the
importer's result for each op is compared, static dimensions and dtype, with the traced one, and
a difference stops the compile with a CompileError naming the op, its module and the source line
instead of returning wrong numbers. Symbolic dimensions (a dynamic batch, a data-dependent count)
are not compared.
"""

from __future__ import annotations

import operator

import torch
import tvm
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converter_wrapping import Converter, traced_results
from .errors import CompileError


def _relax_results(out: relax.Expr) -> list[relax.Type] | None:
    ty = out.ty if isinstance(out, relax.Expr) else None
    if isinstance(out, relax.Tuple):
        return [f.ty for f in out.fields]
    if isinstance(ty, relax.TupleType):
        return list(ty.fields)
    return [ty] if ty is not None else None


def _dtype(value: torch.Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


def _read_results(node: torch.fx.Node, count: int) -> set[int]:
    """Which of a node's `count` results the program reads: every one of a single result; of a
    tuple, those a `getitem` with users takes (converters leave the others as placeholders: the
    `(y, y, y)` of a layer norm whose mean and rstd nothing reads)."""
    if not isinstance(node.meta.get("val"), (list, tuple)):
        return set(range(count))
    read = set()
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            if user.users:
                read.add(user.args[1])
        else:
            return set(range(count))  # the tuple itself is used (returned): all of it
    return read


def mismatch(node: torch.fx.Node, out: relax.Expr) -> str | None:
    """How `out` differs from what tracing recorded for `node`, or None."""
    traced = traced_results(node)
    built = _relax_results(out)
    if built is None or len(built) != len(traced):
        return None  # not a tensor-for-tensor result (lists of ints, None fields): nothing to compare
    read = _read_results(node, len(traced))
    for i, (value, ty) in enumerate(zip(traced, built)):
        if i not in read or not isinstance(value, torch.Tensor) or not isinstance(ty, relax.TensorType):
            continue
        if value.is_complex():
            continue
        where = f"result {i}: " if len(traced) > 1 else ""
        if ty.ndim >= 0 and ty.ndim != value.dim():
            return f"{where}{ty.ndim} dimensions, torch gives {value.dim()} ({list(value.shape)})"
        if ty.dtype.dtype != _dtype(value) and ty.dtype.dtype != "void":
            return f"{where}dtype {ty.dtype.dtype}, torch gives {_dtype(value)}"
        if ty.shape is None or not isinstance(ty.shape, relax.ShapeExpr):
            continue
        for d, (built_dim, traced_dim) in enumerate(zip(ty.shape.values, value.shape)):
            if isinstance(built_dim, tvm.tirx.IntImm) and isinstance(traced_dim, int) and int(built_dim) != traced_dim:
                built_shape = [int(v) if isinstance(v, tvm.tirx.IntImm) else str(v) for v in ty.shape.values]
                return f"{where}shape {built_shape}, torch gives {list(value.shape)}"
    return None


def checked(convert: Converter, graph_name: str, describe) -> Converter:
    """`convert`, raising CompileError when its result disagrees with the traced one."""

    def run(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        out = convert(node, importer)
        if isinstance(out, relax.Call):
            # Bound, so that its type is known here and to the converters reading it: TVM's
            # binary ops return `lhs * rhs` unbound when both are constants (`w * w` of a
            # linspace), and `sum` of it read no dimensions (AttributeError).
            out = importer.block_builder.emit(out)
        problem = mismatch(node, out)
        if problem is not None:
            raise CompileError(
                f"{graph_name}: {describe(node)} was lowered to a result unlike the one torch traced ({problem}): "
                f"a tvmgraph converter bug, stopped here instead of computing wrong numbers. Please report it "
                f"with the model; to work around it, run that module eagerly outside the graph, or write the "
                f"op another way (for indexing: one index tensor at a time, or torch.gather / index_select).")
        return out

    return run


def with_checked_results(converters: dict[str, Converter], graph_name: str, describe) -> dict[str, Converter]:
    """Every converter of `converters` with its results checked."""
    return {key: checked(fn, graph_name, describe) for key, fn in converters.items()}

"""What the converter wrappers share (type_promotion.py, zero_dim.py, half_in_float32.py): run a
converter on replaced inputs, and rewrite each of its results.

A wrapper gives an op's converter other versions of some inputs (cast, reshaped) by swapping them
in the importer's environment for the call only, then fixes each result (a tensor, or the
fields of a tuple) to what torch returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import stock_converter

Converter = Callable[[torch.fx.Node, ExportedProgramImporter], relax.Expr]


def converter_for(key: str, inner: Converter | None) -> Converter:
    """`inner`, or the importer's own converter for `key` when it is None."""
    return inner if inner is not None else lambda node, importer: stock_converter(importer, key)(node)


def wrap_ops(converters: dict[str, Converter], keys: set[str],
             wrapper: Callable[[str, Converter | None], Converter]) -> dict[str, Converter]:
    """`converters` with each op of `keys` replaced by `wrapper(key, its converter or None)`."""
    return {**converters, **{key: wrapper(key, converters.get(key)) for key in keys}}


def traced_results(node: torch.fx.Node) -> list[object]:
    """What tracing recorded as `node`'s results (`meta["val"]`): one per result, fake tensors
    for tensors, in order."""
    val = node.meta.get("val")
    return list(val) if isinstance(val, (list, tuple)) else [val]


def with_inputs(importer: ExportedProgramImporter, replacements: dict[torch.fx.Node, relax.Expr],
                run: Callable[[], relax.Expr]) -> relax.Expr:
    """`run()` while the nodes of `replacements` read their replacement expressions."""
    saved = {node: importer.env[node] for node in replacements}
    importer.env.update(replacements)
    try:
        return run()
    finally:
        importer.env.update(saved)


def per_result(bb: relax.BlockBuilder, out: relax.Expr, fix: Callable[[relax.Expr, int], relax.Expr]) -> relax.Expr:
    """`out` with `fix(result, i)` applied to each of its results (one tensor, or a tuple's fields)."""
    if isinstance(out, relax.Tuple):
        return relax.Tuple([fix(f, i) for i, f in enumerate(out.fields)])
    if isinstance(out.ty, relax.TupleType):
        return relax.Tuple([fix(bb.emit(relax.TupleGetItem(out, i)), i) for i in range(len(out.ty.fields))])
    return fix(out, 0)

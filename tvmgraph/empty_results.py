"""Ops whose results are all empty (a zero among their static dimensions) become zeros.

torch runs any op on empty tensors; TVM's kernels often do not: a cumprod over an empty
tensor crashed the process (SIGSEGV), an argsort or a take of one failed inside LegalizeOps
(OpInfo's all-dtype samples). An empty result holds no values, so each op whose every traced
result is an empty tensor of a static shape is imported as `zeros` of that shape and dtype, its
converter never run.
"""

from __future__ import annotations

import functools

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converter_wrapping import Converter, converter_for, traced_results, wrap_ops


@functools.cache
def stock_keys() -> frozenset[str]:
    """Every op the Relax importer converts itself (`add.Tensor`, ...)."""
    return frozenset(ExportedProgramImporter().create_convert_map())


def _empty_shapes(node: torch.fx.Node) -> list[tuple[list[int], str]] | None:
    """(shape, dtype) of each of `node`'s results when every one is an empty tensor of a static
    shape and a dtype TVM has; else None."""
    results = []
    for value in traced_results(node):
        if not isinstance(value, torch.Tensor) or value.is_complex():
            return None
        shape = list(value.shape)
        if not all(isinstance(d, int) for d in shape) or 0 not in shape:
            return None
        results.append((shape, str(value.dtype).removeprefix("torch.")))
    return results or None


def empty_safe(key: str, inner: Converter | None) -> Converter:
    """`inner` (None: the importer's own converter for `key`), unless its results are all empty."""
    run = converter_for(key, inner)

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        empty = _empty_shapes(node)
        if empty is None:
            return run(node, importer)
        bb = importer.block_builder
        zeros = [bb.emit(relax.op.zeros(shape, dtype)) for shape, dtype in empty]
        single = not isinstance(node.meta.get("val"), (list, tuple))
        return zeros[0] if single else relax.Tuple(zeros)

    return convert


def with_empty_results(converters: dict[str, Converter]) -> dict[str, Converter]:
    """`converters`, and every op the importer knows, made safe for empty results."""
    return wrap_ops(converters, set(converters) | stock_keys(), empty_safe)

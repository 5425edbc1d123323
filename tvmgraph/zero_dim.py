"""Ops along a dimension of a 0-d tensor, which torch allows and TVM's ops refuse.

torch reads a 0-d tensor as one element along dim 0 (or -1): `torch.softmax(t, 0)` is 1.0,
`t.cumsum(0)` and `t.mean(0)` are `t`, `t.var(0, correction=0)` is 0. TVM's softmax,
reductions and scans reject a 0-d input, and the compile failed inside TVM (a CompileError or
a PassError naming no op). Here each op of `DIM_OPS` with a 0-d tensor input runs on that
input seen as shape [1], and its results are reshaped to the shapes torch gives.
"""

from __future__ import annotations

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converter_wrapping import Converter, converter_for, per_result, traced_results, with_inputs, wrap_ops

# Seen failing on a 0-d input (tested in tests/numeric/test_silent_ops.py; scatter in
# test_ops_reduce_index.py).
DIM_OPS = {
    "_softmax.default", "_log_softmax.default", "_safe_softmax.default", "cumsum.default",
    "cumprod.default", "mean.dim", "var.correction", "var_mean.correction", "prod.dim_int",
    "any.dim", "any.dims", "gather.default", "scatter.src", "scatter.value",
}


def _is_0d(expr: object) -> bool:
    return isinstance(expr, relax.Expr) and isinstance(expr.ty, relax.TensorType) and expr.ty.ndim == 0


def _torch_shapes(node: torch.fx.Node) -> list[tuple[int, ...]] | None:
    vals = traced_results(node)
    if not all(isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape) for v in vals):
        return None  # a symbolic size (a count from a boolean mask): not a 0-d case
    return [tuple(v.shape) for v in vals]


def zero_dim_safe(key: str, inner: Converter | None) -> Converter:
    """`inner` (None: the importer's own converter for `key`), run on [1]-shaped views of its 0-d
    tensor inputs when it has any."""
    run = converter_for(key, inner)

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        zero_d = [a for a in dict.fromkeys(node.args) if isinstance(a, torch.fx.Node) and _is_0d(importer.env.get(a))]
        shapes = _torch_shapes(node)
        if not zero_d or shapes is None:
            return run(node, importer)
        views = {a: bb.emit(relax.op.reshape(importer.env[a], [1])) for a in zero_d}
        out = with_inputs(importer, views, lambda: run(node, importer))
        return per_result(bb, out, lambda result, i: bb.emit(relax.op.reshape(result, shapes[i])))

    return convert


def with_zero_dim(converters: dict[str, Converter]) -> dict[str, Converter]:
    """`converters` with every op of `DIM_OPS` made safe for 0-d inputs."""
    return wrap_ops(converters, DIM_OPS, zero_dim_safe)

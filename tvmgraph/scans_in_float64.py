"""float32 `cumsum` and `cumprod` accumulated in float64, as torch's CPU kernels do.

torch's CPU scans keep their running value in `acc_type<float>`, a double, and round each
output once. TVM's scan kept it in float32, rounding at every step: the last cumsum of 200000
values of 1e3 + randn was 2e-5 off (eager 4e-8), a cumprod over 1e6 values 2.5e-4. Here a scan
whose result is float32 reads its input cast to float64 (a `dtype=` argument reads float64
too) and its result is cast back, once per value.

Innermost of the converter wrappers (lower.py): a 16-bit scan (half_in_float32.py: float32, as
torch) and an integer one (type_promotion.py: int64) keep their own dtypes.
"""

from __future__ import annotations

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converter_wrapping import Converter, converter_for, traced_results, with_inputs, wrap_ops

SCANS = {"cumsum.default", "cumprod.default"}


def in_float64(key: str, inner: Converter | None) -> Converter:
    """`inner` (None: the importer's own converter for `key`) on a float64 copy of its input
    when torch's result is float32, the result cast back to float32."""
    run = converter_for(key, inner)

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        x = node.args[0]
        result = traced_results(node)[0]
        if not (isinstance(x, torch.fx.Node) and isinstance(result, torch.Tensor)
                and result.dtype == torch.float32 and isinstance(importer.env.get(x), relax.Expr)):
            return run(node, importer)
        bb = importer.block_builder
        wide = {x: bb.emit(relax.op.astype(importer.env[x], "float64"))}
        saved = node.kwargs
        if "dtype" in saved:
            node.kwargs = {**saved, "dtype": torch.float64}
        try:
            out = with_inputs(importer, wide, lambda: run(node, importer))
        finally:
            node.kwargs = saved
        return bb.emit(relax.op.astype(out, "float32"))

    return convert


def with_float64_scans(converters: dict[str, Converter]) -> dict[str, Converter]:
    """`converters` with every scan of `SCANS` accumulated in float64 for a float32 result."""
    return wrap_ops(converters, SCANS, in_float64)

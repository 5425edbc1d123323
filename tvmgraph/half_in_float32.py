"""Ops that compute float16/bfloat16 tensors in float32, as torch's CPU kernels do.

torch computes these ops on 16-bit floats in float32 (its "opmath" type) and rounds the result
once. TVM 0.27 either refuses them in 16 bits or rounds at every step:
- `native_group_norm` and a batch norm without running statistics (`F.batch_norm(x, None,
  None, training=True)`) failed to compile ("relax.nn.group_norm" type error; LegalizeOps takes
  float32/float16 only): under AMP every GroupNorm model failed;
- `fmod` failed to compile (a bfloat16 store into a uint16 buffer);
- the max pools with indices and `adaptive_max_pool` failed (TVM has no bfloat16 `isnan`);
- float16 `acos`, `asin`, `atan`, `atan2`, `acosh`, `asinh` failed to compile (LLVM has no
  float16 intrinsic for them);
- `grid_sampler` returned float32 for a bfloat16 input, and a batch norm's saved mean and
  invstd float32 where torch keeps the statistics' dtype;
- `cumsum` and `cumprod` accumulated in the 16-bit dtype, rounding at every step (a bfloat16
  cumsum of 20 terms was 1 ulp off torch's, which accumulates in float32);
- a float16 `linalg_vector_norm` (`x.norm()`, `F.normalize`, `torch.dist`) rounded its sum of
  squares to float16 before the root: over 10000 values of 3, 90000 became inf (torch: 300),
  and `F.normalize` and `F.cosine_similarity` gave 0;
- a float16 softmax and log_softmax summed their exponentials in float16: over 100003 values
  a softmax row summed to 1.27, a cross entropy over a 50257-word vocabulary was 2e-3 off;
- a bfloat16 layer norm rounded its mean, centred values, variance and scale to bfloat16 one
  by one (OpInfo's sample with eps = -0.5: 2 ulps off torch's float32-then-rounded result).
- `x * 1e-8`, `x / 70000`, `x * 0.1` of float16 (`SCALAR_OPS` with a Python number): the
  number became a float16 constant first (0, inf, and 1 ulp off for a third of the values).
Each op of `FLOAT32_OPS` (and of `SCALAR_OPS` with a number) reads its 16-bit float inputs cast
to float32, and each result is cast to the dtype torch gives it. Found by the 16-bit OpInfo sweeps
(`TVMGRAPH_TEST_OPINFO=ci:bfloat16`, `ci:float16`) and tested in tests/numeric/test_amp.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converter_wrapping import Converter, converter_for, per_result, traced_results, with_inputs, wrap_ops

FLOAT32_OPS = {
    "native_group_norm.default", "native_layer_norm.default",
    "_native_batch_norm_legit.no_stats", "_native_batch_norm_legit.default",
    "_native_batch_norm_legit_functional.default", "_batch_norm_with_update_functional.default",
    "native_batch_norm.default",
    "fmod.Tensor", "fmod.Scalar",
    "max_pool2d_with_indices.default", "max_pool3d_with_indices.default",
    "adaptive_max_pool2d.default", "adaptive_max_pool3d.default",
    "grid_sampler_2d.default", "grid_sampler_3d.default",
    "acos.default", "asin.default", "atan.default", "atan2.default", "acosh.default", "asinh.default",
    "cumsum.default", "cumprod.default",
    "linalg_vector_norm.default",
    "_softmax.default", "_log_softmax.default", "_safe_softmax.default",
}
_HALF = ("float16", "bfloat16")


def _is_half(expr: object) -> bool:
    return isinstance(expr, relax.Expr) and isinstance(expr.ty, relax.TensorType) and expr.ty.dtype.dtype in _HALF


def _torch_dtypes(node: torch.fx.Node) -> list[str | None]:
    return [str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else None for v in traced_results(node)]


def _cast(bb: relax.BlockBuilder, expr: relax.Expr, dtype: str | None) -> relax.Expr:
    if dtype is None or not isinstance(expr.ty, relax.TensorType) or expr.ty.dtype.dtype == dtype:
        return expr
    return bb.emit(relax.op.astype(expr, dtype))


def in_float32(key: str, inner: Converter | None) -> Converter:
    """`inner` (None: the importer's own converter for `key`) on float32 copies of its 16-bit
    float tensor inputs, its results cast to torch's dtypes."""
    run = converter_for(key, inner)

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        bb = importer.block_builder
        args = [a for a in dict.fromkeys([*node.args, *node.kwargs.values()]) if isinstance(a, torch.fx.Node)]
        asked = _half_dtype_argument(node)
        if asked is not None:  # torch rounds the inputs to that dtype, then computes in float32
            tensors = [a for a in args if isinstance(importer.env.get(a), relax.Expr)]
            wide = {a: bb.emit(relax.op.astype(_cast(bb, importer.env[a], asked), "float32")) for a in tensors}
        else:
            wide = {a: bb.emit(relax.op.astype(importer.env[a], "float32"))
                    for a in args if _is_half(importer.env.get(a))}
        if not wide:
            return run(node, importer)
        with _dtype_argument(node, torch.float32 if asked is not None else None):
            out = with_inputs(importer, wide, lambda: run(node, importer))
        dtypes = _torch_dtypes(node)
        return per_result(bb, out, lambda result, i: _cast(bb, result, dtypes[i]))

    return convert


def _half_dtype_argument(node: torch.fx.Node) -> str | None:
    """The 16-bit float dtype a `dtype=` argument asks for (`x.cumsum(0, dtype=torch.bfloat16)`)."""
    dtype = node.kwargs.get("dtype")
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None
    return name if name in _HALF else None


@contextlib.contextmanager
def _dtype_argument(node: torch.fx.Node, dtype: torch.dtype | None) -> Iterator[None]:
    """While converting, the node's `dtype=` argument reads `dtype` (None: unchanged): the
    inner converter would otherwise cast the float32 copies back to 16 bits."""
    if dtype is None:
        yield
        return
    saved = node.kwargs
    node.kwargs = {**saved, "dtype": dtype}
    try:
        yield
    finally:
        node.kwargs = saved


# Arithmetic with a Python number: torch computes `x * 1e-8` of a float16 x in float32 and
# rounds once; the importer made the number a float16 constant first (1e-8 and 1e-6 became 0,
# 70000 inf; `x * 0.1` was 1 ulp off eager for a third of the values).
SCALAR_OPS = {
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "div.Tensor_mode", "rsub.Scalar",
    "add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar", "div.Scalar_mode", "rsub.Tensor",
}


def with_number_in_float32(key: str, inner: Converter | None) -> Converter:
    """`inner` in float32 (`in_float32`) when an argument is a Python number."""
    wide, run = in_float32(key, inner), converter_for(key, inner)

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        return (wide if numbers else run)(node, importer)

    return convert


def with_float32(converters: dict[str, Converter]) -> dict[str, Converter]:
    """`converters` with every op of `FLOAT32_OPS`, and of `SCALAR_OPS` with a Python number,
    computed in float32 on 16-bit inputs."""
    return wrap_ops(wrap_ops(converters, FLOAT32_OPS, in_float32), SCALAR_OPS, with_number_in_float32)

"""torch's type promotion for elementwise ops, which the ATen graph leaves implicit.

`int_tensor / 2`, `torch.arange(n) * 0.5`, `mask.sum() / n` and `torch.sqrt(int_tensor)` give
float32 in torch. ATen records no cast: the op promotes its inputs itself. TVM's importer
computed these in the integer dtype (3 / 2 gave 1, x * 0.5 gave 0, silently) and failed to
compile `bool + bool`. Here the tensor inputs of each op in `PROMOTING` are cast to torch's
computation dtype first (the output's dtype; for comparisons `torch.result_type` of the inputs;
int8 for arithmetic on bools), so the importer's constants take that dtype too, and the result
is cast to the dtype torch gives where they still differ; `cat` and `stack` cast every tensor of
their list. A Python int past an integer dtype's range wraps into it, as C's cast (torch's) does.
A dynamic batch's size among the inputs (a symbolic int) becomes a 0-d tensor of that dtype
(symbolic_scalars.py). `cumsum`, `cumprod` and `prod` of int32, int8 or bool count in int64, as
torch's do (they overflowed in int32, or failed).
"""

from __future__ import annotations

import torch
from tvm import relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converter_wrapping import Converter, converter_for, with_inputs, wrap_ops
from .converters_nn import result_dtype
from .symbolic_scalars import is_symbolic_scalar, scalar_tensor

_COMPARISONS = {f"{op}.{kind}" for op in ("eq", "ne", "lt", "le", "gt", "ge") for kind in ("Tensor", "Scalar")}
_ARITHMETIC = {
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Tensor", "rsub.Scalar",
    "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode", "div.Scalar_mode",
    "floor_divide.default", "remainder.Tensor", "remainder.Scalar", "fmod.Tensor", "fmod.Scalar",
    "pow.Tensor_Tensor", "pow.Tensor_Scalar", "maximum.default", "minimum.default", "fmax.default",
    "fmin.default", "atan2.default", "hypot.default", "copysign.Tensor", "where.self",
}
# Ops that give a float for an integer input.
_FLOAT_MATH = {f"{name}.default" for name in (
    "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf",
    "erfc", "erfinv", "reciprocal", "lgamma", "digamma")}
# Reductions and scans that accumulate small integers and bools in int64 (and honour `dtype=`):
# only their input is cast.
_ACCUMULATING = {"cumsum.default", "cumprod.default", "prod.default", "prod.dim_int"}
# Ops of a list of tensors (`torch.cat([f32, f64])`: torch promotes them; Relax's concat refused).
_LISTS = {"cat.default", "stack.default"}
PROMOTING = _COMPARISONS | _ARITHMETIC | _FLOAT_MATH | _ACCUMULATING | _LISTS


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _value(arg: object) -> object:
    """What `torch.result_type` reads for an argument: a tensor's dtype, or the number."""
    if not isinstance(arg, torch.fx.Node):
        return arg
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return torch.empty((1,) if val.dim() else (), dtype=val.dtype)  # a 0-d tensor promotes less


def computation_dtype(node: torch.fx.Node, key: str) -> torch.dtype | None:
    """The dtype torch computes `node` in, or None when it cannot tell."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return None
    if key in _COMPARISONS:
        values = [_value(a) for a in node.args[:2]]
        if any(v is None for v in values) or not any(isinstance(v, torch.Tensor) for v in values):
            return None
        common = torch.result_type(*values)
        return torch.int8 if common == torch.bool else common  # TVM cannot compare bools
    if out.dtype == torch.bool and key not in _LISTS:  # add/mul/max of bools: integer arithmetic, then back
        return torch.int8
    return out.dtype


def _wrapped(value: object, dtype: torch.dtype) -> object:
    """A Python int as C's cast to an integer `dtype` makes it (torch: `int32_tensor + 2**31`
    wraps, `uint8_tensor > -1` compares with 255); other values as they are."""
    if type(value) is not int or dtype.is_floating_point or dtype == torch.bool:
        return value
    info = torch.iinfo(dtype)
    if info.min <= value <= info.max:
        return value
    span = info.max - info.min + 1
    return (value - info.min) % span + info.min


def promoting(key: str, inner: Converter | None) -> Converter:
    """`inner` (None: the importer's own converter for `key`) with torch's promotion around it."""
    run = converter_for(key, inner)

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        compute = computation_dtype(node, key)
        if compute is None:
            return run(node, importer)
        target = _torch_dtype_name(compute)
        bb = importer.block_builder
        args = node.args[1:] if key == "where.self" else node.args[:1] if key in _ACCUMULATING else \
            node.args[0] if key in _LISTS else node.args
        if any(_wrapped(a, compute) is not a for a in node.args):  # an int past the dtype's range
            node.args = tuple(_wrapped(a, compute) for a in node.args)
        cast = {}
        for arg in args:
            if isinstance(arg, torch.fx.Node) and arg not in cast:
                expr = importer.env.get(arg)
                if isinstance(expr, relax.Expr) and isinstance(expr.ty, relax.TensorType) \
                        and expr.ty.dtype.dtype != target:
                    cast[arg] = bb.emit(relax.op.astype(expr, target))
                elif is_symbolic_scalar(expr):  # a dynamic batch's size (`loss / x.shape[0]`)
                    cast[arg] = scalar_tensor(bb, expr, target)
        out = with_inputs(importer, cast, lambda: run(node, importer))
        want = result_dtype(node)
        if isinstance(out, relax.Expr) and isinstance(out.ty, relax.TensorType) and out.ty.dtype.dtype != want:
            out = bb.emit(relax.op.astype(out, want))
        return out

    return convert


def with_promotion(converters: dict[str, Converter]) -> dict[str, Converter]:
    """`converters` plus torch's promotion for every op in `PROMOTING`."""
    return wrap_ops(converters, PROMOTING, promoting)

"""AccumulateFloat32: a reduction over bfloat16/float16 values accumulates in float32.

torch computes a half-precision matmul, convolution or sum with a float32 accumulator and rounds
the result once (oneDNN, cuBLAS, ATen's reduction kernels). TOPI accumulates in the output dtype:
a bfloat16 sum of 64 terms keeps 8 bits of mantissa at every addition, and mixed precision (AMP)
training drifts away from eager. TVM's bfloat16 legalization also fails to compile a vectorized
bfloat16 accumulator (a vector zero stored into the uint16 buffer it becomes). This pass rewrites

    matmul(a, b)                        -> astype(matmul(a, b, out_dtype="float32"), dt)
    nn.conv*d(x, w), conv*d_transpose   -> astype(nn.conv*d(x, w, out_dtype="float32"), dt)
    sum/mean/variance/collapse_sum_*(x) -> astype(op(astype(x, "float32")), dt)
    avg_pool*d/adaptive_avg_pool*d(x)   -> the same
    max/avg_pool2d_backward(dy, x)      -> astype(op(astype(dy, "float32"), astype(x, "float32")), dt)
    gelu/silu/softmax/exp/erf/tanh/...  -> astype(op(astype(x, "float32")), dt)
    power(x, e)                         -> astype(power(astype(x, "float32"), astype(e, "float32")), dt)

for every such call whose result dtype `dt` is bfloat16 or float16 (autocast's ops, and the
backward pass's bias gradients of them). Results are those of a float32 accumulator rounded once.
(The pooling gradients sum overlapping windows; TVM 0.27 also fails to compile the bfloat16
argmax of max_pool2d_backward: a bfloat16 `let` that BF16ComputeLegalize retypes halfway.)
torch's 16-bit activations and softmax compute in float32 too ("opmath") and round once. TVM
computes them in the 16-bit dtype, one rounding per step, and a bfloat16 `erf` or `exp` is a
scalar library call per element: an AMP transformer's GELU ran at 1.2 GB/s. In float32 they
get the vectorized fast-math kernels (tvmgraph/schedules/fast_math.py).

Position: after autodiff (the train step's collapse_sums are there) and SimplifyBroadcastMatmul
(whose patterns its casts would hide), before LegalizeOps.
Limits: other reductions (max/min are exact; cumsum) keep their dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter

LOW_PRECISION = ("bfloat16", "float16")
_CAST_INPUT = ("relax.sum", "relax.mean", "relax.variance", "relax.collapse_sum_to", "relax.collapse_sum_like",
               "relax.nn.avg_pool1d", "relax.nn.avg_pool2d", "relax.nn.avg_pool3d", "relax.nn.adaptive_avg_pool1d",
               "relax.nn.adaptive_avg_pool2d", "relax.nn.adaptive_avg_pool3d",
               "relax.grad.max_pool2d_backward", "relax.grad.avg_pool2d_backward",
               # computed in float32 (opmath), not accumulated
               "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.nn.softplus", "relax.nn.softmax",
               "relax.nn.log_softmax", "relax.erf", "relax.exp", "relax.log", "relax.tanh", "relax.sigmoid",
               "relax.sqrt", "relax.rsqrt",
               # TVM's power legalization refuses bfloat16 ("power only applies to float")
               "relax.power")


def _dtype(expr: relax.Expr) -> str | None:
    ty = expr.ty
    return ty.dtype.dtype if isinstance(ty, relax.TensorType) and ty.dtype is not None else None


@mutator
class _Accumulator(BoundRewriter):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or _dtype(call) not in LOW_PRECISION:
            return call
        low, name, op = _dtype(call), call.op.name, relax.op
        if name == "relax.matmul":
            wide = op.matmul(*call.args, out_dtype="float32")
        elif name in ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d"):
            a = call.attrs
            conv = getattr(op.nn, name.rsplit(".", 1)[1])
            wide = conv(*call.args, a.strides, a.padding, a.dilation, a.groups, a.data_layout, a.kernel_layout,
                        a.out_layout, "float32")
        elif name in ("relax.nn.conv1d_transpose", "relax.nn.conv2d_transpose"):  # conv's input gradient
            a = call.attrs
            conv = getattr(op.nn, name.rsplit(".", 1)[1])
            wide = conv(*call.args, a.strides, a.padding, a.output_padding, a.dilation, a.groups, a.data_layout,
                        a.kernel_layout, a.out_layout, "float32")
        elif name in _CAST_INPUT:
            args = [self.builder_.emit(op.astype(a, "float32")) if _dtype(a) == low else a for a in call.args]
            wide = relax.Call(call.op, args, call.attrs)
        else:
            return call
        self.counts[name.removeprefix("relax.")] += 1
        return op.astype(self.builder_.emit(wide), low)


@tvm.transform.module_pass(opt_level=0, name="AccumulateFloat32")
class AccumulateFloat32:
    """Half-precision matmuls, convolutions, sums and activations compute in float32, rounded once."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "AccumulateFloat32", self.report, _Accumulator(mod))

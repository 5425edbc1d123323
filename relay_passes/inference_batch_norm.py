"""InferenceBatchNormAsScale: an eval-mode batch norm is a per-channel multiply-add.

    bn = R.nn.batch_norm(x, gamma, beta, mean, var, axis=1, epsilon=e, training=False)
    y = bn[0]
        ->
    alpha = gamma * (1 / R.sqrt(var + e))
    scale = R.reshape(alpha, [1, C, 1, 1])
    shift = R.reshape(beta + -(mean * alpha), [1, C, 1, 1])
    y = x * scale + shift

the form torch's CPU kernel computes it in (ATen's batch_norm inference precomputes
`alpha = weight * invstd` and `beta = bias - mean * alpha`). Legalized, the batch norm is a
kernel of its own that reads and writes the whole activation; as a multiply-add FuseEpilogue
takes it into the convolution or matmul before it (with the ReLU/ReLU6 and residual add after
it), computed on the accumulators before the one store. The scale and shift are C-element
kernels. The MobileNet-style CNN's inference spent about 3 of its 13.6 ms in such kernels.

Rewritten: `bn[0]` of a batch_norm with training=False over a float32/float64 input of known
rank (the moving statistics `bn[1]`, `bn[2]` keep reading the batch norm, which goes only when
nothing reads it). Position: before FuseEpilogue.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter

R = relax.op


def _inference_batch_norm(expr: relax.Expr) -> relax.Call | None:
    """The eval-mode batch_norm call `expr` is, else None."""
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.name == "relax.nn.batch_norm" and not bool(expr.attrs.training)):
        return None
    x = expr.args[0].ty
    if not isinstance(x, relax.TensorType) or x.ndim < 1 or str(x.dtype) not in ("float32", "float64"):
        return None
    return expr


@mutator
class _Rewriter(BoundRewriter):
    def visit_tuple_getitem_(self, op: relax.TupleGetItem) -> relax.Expr:
        op = super().visit_tuple_getitem_(op)
        if op.index != 0 or not isinstance(op.tuple_value, relax.Var):
            return op
        bound = self.lookup_binding(op.tuple_value)
        bn = _inference_batch_norm(bound) if bound is not None else None
        if bn is None:
            return op
        self.counts["eval-mode batch_norm as multiply-add"] += 1
        return self._multiply_add(bn)

    def _multiply_add(self, bn: relax.Call) -> relax.Expr:
        bb = self.builder_
        x, gamma, beta, mean, var = bn.args
        attrs = bn.attrs
        dtype = str(x.ty.dtype)
        ndim = x.ty.ndim
        axis = int(attrs.axis) % ndim
        eps = relax.const(float(attrs.epsilon), dtype)
        scale = bb.emit(R.divide(relax.const(1.0, dtype), R.sqrt(R.add(var, eps))))
        if bool(attrs.scale):
            scale = bb.emit(R.multiply(gamma, scale))
        shift = bb.emit(R.negative(R.multiply(mean, scale)))
        if bool(attrs.center):
            shift = bb.emit(R.add(beta, shift))
        shape: list = [1] * ndim
        shape[axis] = var.ty.shape.values[0]
        scale = bb.emit(R.reshape(scale, shape))
        shift = bb.emit(R.reshape(shift, shape))
        return R.add(bb.emit(R.multiply(x, scale)), shift)


@tvm.transform.module_pass(opt_level=0, name="InferenceBatchNormAsScale")
class InferenceBatchNormAsScale:
    """Rewrite each eval-mode batch norm's output as `x * scale + shift`."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "InferenceBatchNormAsScale", self.report, _Rewriter(mod), drop_unused=True)

"""GroupNormByParts: a group norm's forward pass as a mean, a variance and one element-wise kernel.

    y = R.nn.group_norm(x, gamma, beta, G)           g = R.reshape(x, [N, G, -1])
                                              ->     m = R.mean(g, axis=[2], keepdims=True)
                                                     r = R.rsqrt(R.variance(g, axis=[2], keepdims=True) + eps)
                                                     y = R.reshape((g - m) * r, x.shape) * gamma' + beta'

TOPI's group_norm is one kernel of three parts: a copy of x into [N, G, C / G, H, W], the sums
of x and x * x per group in a serial scalar loop (a chain of dependent adds, not vectorized), and
the normalization through index arithmetic. A U-Net's 4 x 32 x 64 x 64 group norm took 448 us
there against torch's 90 (2-vCPU Xeon, 2026-12-05). By parts, the mean and the variance are
reductions along the last axis, which the CPU reduction rule vectorizes, and the rest fuses into
one element-wise kernel.

Only the forward op: the pass runs after autodiff, so a training step's gradient is still
group_norm's own (tvmgraph/gradients/norm.py). Taken: float32 and float64, channels on axis 1,
normalized over every axis after it (torch's layout), a static channel count. Exact up to the
order of the sums.

Position: before LegalizeOps (after autodiff), on CPU targets.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_graph_functions
from relay_passes.rebind import BoundRewriter
from tvmgraph.converters_nn import _mean_rstd

_GROUP_NORM = tvm.ir.Op.get("relax.nn.group_norm")


def _takes(call: relax.Call) -> bool:
    x = call.args[0].ty
    if (not isinstance(x, relax.TensorType) or x.dtype not in ("float32", "float64")
            or not isinstance(x.shape, relax.ShapeExpr)):
        return False
    attrs = call.attrs
    ndim = len(x.shape.values)
    channels = x.shape.values[1] if ndim >= 3 else None
    return (int(attrs.channel_axis) == 1 and [int(a) for a in attrs.axes] == list(range(2, ndim))
            and isinstance(channels, tvm.tirx.IntImm) and int(channels) % int(attrs.num_groups) == 0
            and bool(attrs.center) and bool(attrs.scale))


@mutator
class _Rewriter(BoundRewriter):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(_GROUP_NORM) and _takes(call)):
            return call
        self.counts["group_norm as mean, variance and one element-wise kernel"] += 1
        return self._by_parts(call)

    def _by_parts(self, call: relax.Call) -> relax.Expr:
        bb = self.builder_
        x, gamma, beta = call.args
        shape = x.ty.shape.values
        grouped = bb.emit(relax.op.reshape(x, [shape[0], int(call.attrs.num_groups), -1]))
        # The converter's statistics of a group norm, as it computes them for torch's mean/rstd.
        mean, rstd = _mean_rstd(bb, grouped, [2], float(call.attrs.epsilon))
        normed = bb.emit(relax.op.reshape(relax.op.multiply(relax.op.subtract(grouped, mean), rstd), list(shape)))
        per_channel = [1, int(shape[1])] + [1] * (len(shape) - 2)
        scaled = relax.op.multiply(normed, relax.op.reshape(gamma, per_channel))
        return relax.op.add(scaled, relax.op.reshape(beta, per_channel))


@tvm.transform.module_pass(opt_level=0, name="GroupNormByParts")
class GroupNormByParts:
    """Rewrite each float32/float64 group_norm (channels on axis 1) as its parts."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_graph_functions(mod, "GroupNormByParts", self.report, _Rewriter(mod))

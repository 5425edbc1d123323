"""FuseCastScale: `R.astype(x, dtype) * scale` with a scalar scale becomes one kernel.

    y = R.astype(x, "float32")                  fused_cast_scale(x, s):
    z = R.multiply(y, s)          ->                (both ops, one group that FuseTIR
                                                     turns into one PrimFunc)

The loss-scaling / mixed-precision pattern (OneFlow's fuse_cast_scale): a tensor cast to
another dtype and multiplied by a scalar, a 0-d tensor or a constant of one element, on either
side. Grouped, the cast result is not stored and read back: one read of `x`, one write of the
result. A cast that other ops also read is left alone: its group would have to run where the
cast is first needed, so the product would be computed early and kept. In a training step that
place is the forward pass and the product a backward term: under AMP each batch norm's
`astype(x) * 2/N` (its variance gradient) was computed in the forward pass and kept to the
backward, a float32 activation per layer (the benchmark CNN planned 235 MiB, eager's bfloat16
step far less).

Position: after FuseEpilogue (an epilogue chain keeps a cast that follows its matmul) and
before LegalizeOps. A group is a function with the attributes "Primitive" and "Composite"
(= PATTERN_NAME), which LegalizeOps legalizes and FuseTIR fuses.
Turned off (GraphConfig.allow_fuse_cast_scale(False)) it does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.dpl import is_op, wildcard
from tvm.relax.transform import FusionPattern, PatternCheckContext

from tvmgraph.debug import logger

from .bindings import Acyclic

PATTERN_NAME = "tvmgraph.fuse_cast_scale"


def _is_scalar(expr: relax.Expr) -> bool:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return False
    dims = ty.shape.values
    return all(isinstance(d, tvm.tirx.IntImm) for d in dims) and math.prod(int(d) for d in dims) == 1


def _check(context: PatternCheckContext) -> bool:
    """The scale is a scalar, the product has the cast's shape (no broadcast to more), and the
    multiply is the cast's only reader."""
    cast, scale = context.annotated_expr["cast"], context.annotated_expr["scale"]
    if not (_is_scalar(scale) and tvm_ffi.structural_equal(cast.ty.shape, context.matched_expr.ty.shape)):
        return False
    cast_var = context.value_to_bound_var.get(cast)
    return cast_var is None or len(context.var_usages.get(cast_var, [])) <= 1


def pattern() -> FusionPattern:
    """`astype(x) * scale` or `scale * astype(x)`."""
    cast = is_op("relax.astype")(wildcard())
    scale = wildcard()
    out = is_op("relax.multiply")(cast, scale) | is_op("relax.multiply")(scale, cast)
    return FusionPattern(PATTERN_NAME, out, {"cast": cast, "scale": scale}, _check)


@tvm.transform.module_pass(opt_level=0, name="FuseCastScale")
class FuseCastScale:
    """Group every cast followed by a scalar multiply into one kernel (allow_fuse_cast_scale)."""

    def __init__(self, enabled: bool = True, report: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        self.report = report or (lambda msg: logger.info("%s", msg))

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if not self.enabled:
            return mod
        before = {gv.name_hint for gv, _ in mod.functions_items()}
        base = pattern()
        # A scale computed from the cast itself (relax's max gradient: astype(mask) * (g / sum(mask)))
        # would make the group read its own output.
        acyclic = Acyclic(mod)
        checked = FusionPattern(PATTERN_NAME, base.pattern, base.annotation_patterns,
                                lambda context: _check(context) and acyclic(context))
        mod = relax.transform.FuseOpsByPattern([checked], bind_constants=False)(mod)
        fused = sum(1 for gv, f in mod.functions_items()
                    if gv.name_hint not in before and isinstance(f, relax.Function))
        if fused:
            self.report(f"FuseCastScale: {fused} cast + scale kernel(s)")
        return mod

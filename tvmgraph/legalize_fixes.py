"""Legalizations of TVM 0.27 replaced where they fail on programs torch produces.

- `relax.full`, `relax.full_like` with an infinite or NaN fill (`torch.full((T, T),
  float("-inf")).triu(1)`, the causal mask of `nn.Transformer.generate_square_subsequent_mask`):
  TOPI's `full` checks `"float" in dtype` and gets a dtype object, so LegalizeOps raised
  "argument of type 'PrimType' is not iterable". Here the dtype goes as a string.

Importing this module registers them (at a level above TVM's own).
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx, topi
from tvm.relax.transform.legalize_ops.common import _try_convert_to_scalar_const

_LEVEL = 11  # TVM registers its legalizations at level 10


def _full(is_like: bool):
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        fill = _try_convert_to_scalar_const(call.args[1], python_native=True)
        shape = call.args[0].ty.shape if is_like else call.args[0]
        if isinstance(shape, relax.ShapeExpr):
            dims = shape.values
        else:  # a shape computed at run time
            shape = bb.emit(shape)
            dims = [tirx.Var(f"s{i}", "int64") for i in range(shape.ty.ndim)]
            bb.match_cast(shape, relax.ShapeType(dims))
        return bb.call_te(topi.full, dims, str(call.ty.dtype.dtype), fill, primfunc_name_hint="full")

    return legalize


tvm.ir.register_op_attr("relax.full", "FLegalize", _full(is_like=False), level=_LEVEL)
tvm.ir.register_op_attr("relax.full_like", "FLegalize", _full(is_like=True), level=_LEVEL)

"""A max pooling whose one window covers the whole plane legalizes as a max reduction.

The converters emit such a pooling (`adaptive_max_pool2d(x, 1)`, a global max pooling) as
`relax.nn.max_pool{2,3}d`, not `relax.max`, for its gradient: a pooling's gives a window's tied
maxima to the first one, as torch does (max_pool_backward.py, gradients/pool3d.py); `max`'s
shares them, as `torch.amax`. Its forward, though, is a reduction, and TOPI's window loops ran
2-5x slower than the reduction schedule (16 x 256 x 32 x 32: 3.4 against 0.68 ms on the Intel
Xeon). Any other pooling keeps TVM's legalization. Both start from the lowest finite float;
schedules/minus_infinity_pool.py makes it -inf after scheduling.

Importing this module registers it (at a level above TVM's own).
"""

from __future__ import annotations

import tvm
from tvm import relax, te
from tvm.relax.transform.legalize_ops.nn import _nn_max_pool2d, _nn_max_pool3d

_LEVEL = 11  # TVM registers its legalizations at level 10
_LAYOUTS = {2: "NCHW", 3: "NCDHW"}
GLOBAL_MAX_POOL = "global_max_pool"  # the kernel's block name, which minus_infinity_pool.py finds


def whole_plane(call: relax.Call) -> bool:
    """Whether the pooling `call` has one window over its static plane (NCHW/NCDHW, no padding,
    no dilation, so that its output is the plane's max)."""
    attrs = call.attrs
    rank = len(attrs.pool_size)
    shape = call.args[0].ty.shape
    if shape is None or str(attrs.layout) != _LAYOUTS[rank] or str(attrs.out_layout) != _LAYOUTS[rank]:
        return False
    plane = list(shape)[-rank:]
    return (all(isinstance(d, tvm.tirx.IntImm) for d in plane)
            and [int(k) for k in attrs.pool_size] == [int(d) for d in plane]
            and not any(int(p) for p in attrs.padding) and all(int(d) == 1 for d in attrs.dilation))


def plane_max(x: te.Tensor, rank: int) -> te.Tensor:
    """max over the last `rank` axes of x, kept as ones."""
    axes = [te.reduce_axis((0, d), name=f"r{i}") for i, d in enumerate(x.shape[-rank:])]
    return te.compute([*x.shape[:-rank], *[1] * rank],
                      lambda *index: te.max(x[(*index[:-rank], *axes)], axis=axes), name=GLOBAL_MAX_POOL)


def _legalize(stock):  # noqa: ANN001, ANN202  (TVM's legalization function)
    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        if not whole_plane(call):
            return stock(bb, call)
        return bb.call_te(plane_max, call.args[0], len(call.attrs.pool_size), primfunc_name_hint=GLOBAL_MAX_POOL)

    return legalize


tvm.ir.register_op_attr("relax.nn.max_pool2d", "FLegalize", _legalize(_nn_max_pool2d), level=_LEVEL)
tvm.ir.register_op_attr("relax.nn.max_pool3d", "FLegalize", _legalize(_nn_max_pool3d), level=_LEVEL)

"""MinusInfinityPool: max pooling starts from -inf and pads with -inf, as torch does.

TOPI's pool2d/pool3d (and `topi.max`, behind max_pool_forward.py's whole-plane pooling) start
each window's max at the lowest finite float and pad with it, so a window holding only -inf (a
sequence masked with `masked_fill(mask, -inf)` before a max over time, padding included) came
out as -3.4e38 where torch gives -inf. The identity cannot be -inf before scheduling: TVM's
rfactor knows the max reducer by that lowest identity, and a reducer from -inf left a whole-plane
pooling serial (5x slower).

So, after the schedules: in every pooling block (TOPI's carry the `meta_schedule.pool_max`
schedule rule, the whole-plane one is named max_pool_forward.GLOBAL_MAX_POOL, the blocks
rfactor made from it included) and in every block that writes a buffer such a block reads (the
padded input), a float constant equal to its type's lowest value becomes -inf. Nothing else in
those blocks holds that constant: the init and the padding are all there is. A clamp to
`finfo.min` fused into the same kernel lives in blocks of its own, untouched.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm_ffi.structural import StructuralMutator, structural_mutate

from ..max_pool_forward import GLOBAL_MAX_POOL
from .loops import rewrite_prim_funcs

_POOL_RULE = "meta_schedule.pool_max"
# what TOPI writes (tirx.min_value; bfloat16's is float32's, rounded on the way to memory)
_LOWEST = {dtype: tirx.min_value(dtype).value for dtype in ("bfloat16", "float16", "float32", "float64")}


def _is_pooling(block: s_tir.SBlock) -> bool:
    rule = block.annotations.get("schedule_rule")
    return (rule is not None and str(rule) == _POOL_RULE) or block.name_hint.startswith(GLOBAL_MAX_POOL)


def _blocks(func: tirx.PrimFunc) -> list[s_tir.SBlock]:
    found = []

    def visit(node: s_tir.SBlock, mutator: StructuralMutator):
        found.append(node)
        return mutator.default_mutate(node)

    structural_mutate(func.body, [(s_tir.SBlock, visit)])
    return found


def _minus_infinity(node: tirx.FloatImm, mutator: StructuralMutator) -> tirx.PrimExpr:
    dtype = str(node.ty)
    if dtype in _LOWEST and node.value == _LOWEST[dtype]:
        return tirx.FloatImm(dtype, -math.inf)
    return node


def minus_infinity_pool(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its poolings' lowest-float inits and padding made -inf."""
    pooling = [b for b in _blocks(func) if _is_pooling(b)]
    if not pooling:
        return func
    read = [region.source for b in pooling for region in b.reads]

    def rewrite(node: s_tir.SBlock, mutator: StructuralMutator):
        node = mutator.default_mutate(node)
        if _is_pooling(node) or any(w.source.same_as(r) for w in node.writes for r in read):
            return structural_mutate(node, [(tirx.FloatImm, _minus_infinity)])
        return node

    return structural_mutate(func, [(s_tir.SBlock, rewrite)])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.MinusInfinityPool")
class MinusInfinityPool:
    """Apply `minus_infinity_pool` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, minus_infinity_pool)

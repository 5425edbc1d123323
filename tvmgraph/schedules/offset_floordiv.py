"""OffsetFloorDiv: `(x + k) // d` with `k` not a multiple of `d` written without the offset inside
the division, so that TVM's FlattenBuffer cannot simplify it wrongly.

TVM 0.27's `IterMapSimplify`, which FlattenBuffer runs on every flattened index, rewrites
`(x % c + k) // d` (d dividing c, k not a multiple of d) as `(x + k) % c // d`, which is wrong
wherever `x % c + k` leaves [0, c): `(f % 8 + 1) // 2` at f = 7 gives 0 instead of 4, and summed
with `f // 8 * 4` (a fused loop over a [6, 8] tensor) the whole index came out 4 elements early.
A kernel meets it when a schedule fuses loops (`x % c` is then a block's binding) and an index
divides with an offset: TOPI's `slice_scatter` with a step reads `src[.., (i - start + step - 1)
// step]`, and `t[:, ::2]`'s gradient is such a slice_scatter: a strided slice trained with the
rows of its gradient shifted by one, the first row read from outside the tensor.

Here, with k = q * d + r (0 < r < d), for any integer x (floor division):

    (x + k) // d  =  x // d + q + (1 if x % d >= d - r else 0)

which is exact, and whose select makes the index non-affine: IterMapSimplify leaves it as it is.
Only divisions that can meet a `%` once the block's bindings are substituted are rewritten: a
`%` in the dividend, or a block variable bound to an expression with one (a fused loop); the
others keep their form (a strided convolution's gradient has hundreds of offset divisions of
plain iterators). Any target, after the schedules (which keep seeing TVM's own expressions).
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx
from tvm_ffi.structural import StructuralMutator, structural_mutate

from .loops import contains, rewrite_prim_funcs, vars_in


def _offset(expr: tirx.PrimExpr) -> tuple[tirx.PrimExpr, int] | None:
    """(x, k) for `x + k` or `x - k` with k a constant, else None."""
    if isinstance(expr, tirx.Add) and isinstance(expr.b, tirx.IntImm):
        return expr.a, int(expr.b.value)
    if isinstance(expr, tirx.Add) and isinstance(expr.a, tirx.IntImm):
        return expr.b, int(expr.a.value)
    if isinstance(expr, tirx.Sub) and isinstance(expr.b, tirx.IntImm):
        return expr.a, -int(expr.b.value)
    return None


def _carry_form(node: tirx.FloorDiv) -> tirx.PrimExpr | None:
    """`x // d + q + carry` for `(x + k) // d` with k % d != 0 (k = q * d + r), else None."""
    if not (isinstance(node.b, tirx.IntImm) and node.b.value > 1):
        return None
    split = _offset(node.a)
    d = int(node.b.value)
    if split is None or split[1] % d == 0:
        return None
    x, k = split
    q, r = divmod(k, d)  # Python's floor division: 0 < r < d
    dtype = str(node.ty)
    carry = tirx.Select(tirx.floormod(x, node.b) >= tirx.const(d - r, dtype), tirx.const(1, dtype),
                        tirx.const(0, dtype))
    return tirx.floordiv(x, node.b) + tirx.const(q, dtype) + carry


def offset_floordiv(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with each `(x + k) // d` (k % d != 0) that can meet a `%` as `x // d + k // d + carry`."""
    bound_to_floormod: list[set[tirx.Var]] = [set()]  # per enclosing block

    def realize(node: s_tir.SBlockRealize, mutator: StructuralMutator):
        block = node.block
        risky = {iv.var for iv, value in zip(block.iter_vars, node.iter_values) if contains(value, tirx.FloorMod)}
        bound_to_floormod.append(risky | bound_to_floormod[-1])
        try:
            return mutator.default_mutate(node)
        finally:
            bound_to_floormod.pop()

    def floordiv(node: tirx.FloorDiv, mutator: StructuralMutator):
        node = mutator.default_mutate(node)
        if not isinstance(node, tirx.FloorDiv):
            return node
        if not (contains(node.a, tirx.FloorMod) or vars_in(node.a) & bound_to_floormod[-1]):
            return node
        rewritten = _carry_form(node)
        return node if rewritten is None else rewritten

    return structural_mutate(func, [(s_tir.SBlockRealize, realize), (tirx.FloorDiv, floordiv)])


@tvm.transform.module_pass(opt_level=0, name="tvmgraph.OffsetFloorDiv")
class OffsetFloorDiv:
    """Apply `offset_floordiv` to every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_prim_funcs(mod, offset_floordiv)

"""SimplifyBroadcastMatmul: a matmul reads a broadcast operand in place instead of copying it.

torch.export spells a 3-D input times a 2-D weight (what `nn.MultiheadAttention`'s in-projection
does with `batch_first` inputs) as `expand` + `bmm`, which Relax imports as

    w3 = R.broadcast_to(w, (B, K, N));  y = R.matmul(x, w3)          # x: (B, M, K), w: (K, N)

copying the weight B times (128 copies of 256 x 768 floats: 100 MB per call), and autodiff
turns that into a batched weight gradient of B full weight copies, summed afterwards:

    dw = R.collapse_sum_to(R.matmul(R.permute_dims(x, [0, 2, 1]), dy), (K, N))

This pass rewrites each call, after its arguments, until no rule applies:

    broadcast_to(x, x.shape)                  -> x
    permute_dims(permute_dims(x, p), q)       -> permute_dims(x, p o q), or x
    permute_dims(broadcast_to(w, S), p)       -> broadcast_to(permute_dims(w, p'), p(S))
                                                 (p keeps the axes the broadcast added in front)
    matmul(a, broadcast_to(w, S))             -> matmul(a, w)   (matmul broadcasts by itself;
    matmul(broadcast_to(x, S), b)             -> matmul(x, b)    the result shape must not change)
    matmul(a, b) over K = 1                   -> multiply(a, b)  ((M, 1) * (1, N): autodiff's
                                                 weight gradient dy.T @ x at batch 1)
    collapse_sum_to(matmul(a, b), (M, N))     -> matmul(A, B)    (a: (B.., M, K), b: (B.., K, N);
                                                 one product over the batch and K together)

In the last rule B = reshape(b, (B*K, N)) and A = permute_dims(reshape(a', (B*K, M))), with
a' = a with its last two axes swapped: for autodiff's a = permute_dims(x, [.., -1, -2]) that is
x itself, so A is a reshape (free) and a transpose the matmul kernel reads in place
(FuseEpilogue groups it); other permutes of x leave a copy that moves whole rows.

Every rule computes the same numbers, except that the last one sums over the batch in another
order (float32 rounding). `y = x` bindings left by a rule are dropped (relay_passes/rebind.py).

Position: before LegalizeOps and before FuseEpilogue (which then sees plain 2-D weights).
Limits: a broadcast that also stretches size-1 axes of `w` (not only new leading axes) stays;
collapse_sum_to only to the trailing two axes (leading 1s allowed), of a product used once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.transform import PassContext
from tvm.relax.expr_functor import PyExprMutator, mutator

from relay_passes import graph_functions, report_counts
from relay_passes.rebind import rebind

Shape = list[tvm.ir.expr.Expr]  # dimensions (PrimExprs)


def _shape(expr: relax.Expr) -> Shape | None:
    """The static-rank shape of a tensor expression, or None."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _same(a: Shape, b: Shape) -> bool:
    return len(a) == len(b) and all(tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


def _axes(call: relax.Call, ndim: int) -> list[int]:
    """permute_dims's axes; None means reversed."""
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) for a in axes]


def _product(dims: Shape) -> tvm.ir.expr.Expr:
    out: tvm.ir.expr.Expr = tirx.IntImm("int64", 1)
    for d in dims:
        out = out * d
    return out


def _count_uses(func: relax.Function) -> Counter[relax.Var]:
    uses: Counter[relax.Var] = Counter()

    def visit(expr: relax.Expr) -> None:
        if isinstance(expr, relax.Call):
            for arg in expr.args:
                if isinstance(arg, relax.Var):
                    uses[arg] += 1

    relax.analysis.post_order_visit(func.body, visit)
    return uses


@mutator
class _Simplifier(PyExprMutator):
    """Applies the rules to each call after its arguments, looking through var bindings."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.counts: Counter[str] = Counter()
        self.uses: Counter[relax.Var] = Counter()  # of the function being visited
        # permute_dims values bound so far, so that a rule re-creating one reuses its variable
        self.permutes: dict[int, list[tuple[relax.Call, relax.Var]]] = {}

    def simplify_function(self, func: relax.Function) -> relax.Function:
        """`func` rewritten, without the bindings the rewrites left unused."""
        self.uses, self.permutes = _count_uses(func), {}
        return relax.analysis.remove_all_unused(self.visit_expr(func))

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        return self._simplify(self.builder_.normalize(super().visit_call_(call)))

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        var = rebind(self, binding, value)
        if isinstance(value, relax.Call) and value.op.same_as(_PERMUTE_DIMS):
            self.permutes.setdefault(tvm_ffi.structural_hash(value), []).append((value, var))

    def _simplify(self, expr: relax.Expr) -> relax.Expr:
        changed = True
        while changed and isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            changed = False
            for rule in _RULES.get(expr.op.name, ()):
                new = rule(self, expr)
                if new is not None:
                    new = self.builder_.normalize(new)
                    self.counts[rule.__name__.strip("_").replace("_", " ")] += 1
                    expr, changed = new, True
                    break
        return expr

    def value(self, expr: relax.Expr) -> relax.Expr:
        """The expression a dataflow var is bound to (itself for anything else)."""
        if isinstance(expr, relax.Var):
            bound = self.lookup_binding(expr)
            if bound is not None:
                return bound
        return expr

    def call_of(self, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
        value = self.value(expr)
        return value if isinstance(value, relax.Call) and value.op.same_as(op) else None

    def emit(self, expr: relax.Expr) -> relax.Var:
        """Bind a new (simplified) sub-expression; one that simplified to a var, or to a
        transpose bound before, is that var."""
        value = self._simplify(self.builder_.normalize(expr))
        if isinstance(value, relax.Var):
            return value
        for seen, var in self.permutes.get(tvm_ffi.structural_hash(value), []):
            if tvm_ffi.structural_equal(seen, value):
                return var
        return self.builder_.emit(value)


def _identity_broadcast(s: _Simplifier, call: relax.Call) -> relax.Expr | None:
    x = call.args[0]
    src, dst = _shape(x), _shape(call)
    return x if src is not None and dst is not None and _same(src, dst) else None


def _leading_axes(call: relax.Call) -> int | None:
    """For broadcast_to(w, S) that only prepends axes (S[lead:] == w.shape): lead."""
    src, dst = _shape(call.args[0]), _shape(call)
    if src is None or dst is None or len(dst) < len(src):
        return None
    lead = len(dst) - len(src)
    return lead if _same(src, dst[lead:]) else None


def _permute_of_permute(s: _Simplifier, call: relax.Call) -> relax.Expr | None:
    inner = s.call_of(call.args[0], _PERMUTE_DIMS)
    if inner is None:
        return None
    x = inner.args[0]
    shape = _shape(x)
    if shape is None:
        return None
    p = _axes(inner, len(shape))
    q = _axes(call, len(shape))
    composed = [p[a] for a in q]
    if composed == list(range(len(shape))):
        return x
    return relax.op.permute_dims(x, composed)


def _permute_of_broadcast(s: _Simplifier, call: relax.Call) -> relax.Expr | None:
    bcast = s.call_of(call.args[0], _BROADCAST_TO)
    if bcast is None:
        return None
    lead = _leading_axes(bcast)
    dst = _shape(bcast)
    if lead is None or dst is None:
        return None
    axes = _axes(call, len(dst))
    if axes[:lead] != list(range(lead)):
        return None
    inner = [a - lead for a in axes[lead:]]
    w = bcast.args[0]
    if inner != list(range(len(inner))):
        w = s.emit(relax.op.permute_dims(w, inner))
    return relax.op.broadcast_to(w, relax.ShapeExpr([dst[a] for a in axes]))


def _matmul_of_broadcast(s: _Simplifier, call: relax.Call) -> relax.Expr | None:
    args = list(call.args)
    for n, arg in enumerate(call.args):
        bcast = s.call_of(arg, _BROADCAST_TO)
        if bcast is not None and _leading_axes(bcast) is not None:
            args[n] = bcast.args[0]
    if all(new.same_as(old) for new, old in zip(args, call.args)):
        return None
    candidate = relax.op.matmul(*args, out_dtype=call.attrs.out_dtype)
    try:
        ty = s.builder_.normalize(candidate).ty
    except (ValueError, tvm.error.InternalError):  # the operands no longer broadcast
        return None
    old = _shape(call)
    if not isinstance(ty.shape, relax.ShapeExpr) or old is None:
        return None
    if not _same(list(ty.shape.values), old):
        return None
    return candidate


def _outer_product(s: _Simplifier, call: relax.Call) -> relax.Expr | None:
    """matmul(a, b) with K = 1 is a broadcast multiply (a weight gradient at batch 1)."""
    a, b = call.args
    sa, sb = _shape(a), _shape(b)
    if sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
        return None
    k = sa[-1]
    if not (isinstance(k, tirx.IntImm) and k.value == 1 and str(call.ty.dtype) == str(a.ty.dtype)
            == str(b.ty.dtype)):
        return None
    return relax.op.multiply(a, b)


def _collapse_of_matmul(s: _Simplifier, call: relax.Call) -> relax.Expr | None:
    product = s.call_of(call.args[0], _MATMUL)
    if product is None or s.uses[call.args[0]] > 1:
        return None  # a product used elsewhere too would be computed twice
    a, b = product.args
    out, target = _shape(product), _shape(call)
    sa, sb = _shape(a), _shape(b)
    if out is None or target is None or sa is None or sb is None:
        return None
    nb = len(out) - 2
    if nb < 1 or len(sa) != len(out) or len(sb) != len(out):
        return None
    batch = out[:nb]
    if not (_same(sa[:nb], batch) and _same(sb[:nb], batch)):
        return None  # an operand is broadcast itself: not the autodiff form this targets
    lead = target[:-2]
    if len(target) < 2 or not _same(target[-2:], out[-2:]) or len(lead) > nb:
        return None
    if not all(isinstance(d, tirx.IntImm) and d.value == 1 for d in lead):
        return None
    m, k, n = sa[-2], sa[-1], sb[-1]
    bk = _product([*batch, k])
    # A = (a with its last two axes swapped, as rows (B*K, M)) transposed. Autodiff's `a` is
    # permute_dims(x) of some x; the swap then cancels into one permute_dims of x, which is x
    # itself or, at worst, a copy that moves whole rows of M floats.
    swapped = s.emit(relax.op.permute_dims(a, [*range(nb), nb + 1, nb]))
    rows = s.emit(relax.op.reshape(swapped, relax.ShapeExpr([bk, m])))
    lhs = s.emit(relax.op.permute_dims(rows, [1, 0]))
    rhs = s.emit(relax.op.reshape(b, relax.ShapeExpr([bk, n])))
    result = relax.op.matmul(lhs, rhs, out_dtype=product.attrs.out_dtype)
    if lead:
        result = relax.op.reshape(s.emit(result), relax.ShapeExpr(target))
    return result


_BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")
_PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")
_MATMUL = tvm.ir.Op.get("relax.matmul")
Rule = Callable[[_Simplifier, relax.Call], "relax.Expr | None"]
_RULES: dict[str, tuple[Rule, ...]] = {
    "relax.broadcast_to": (_identity_broadcast,),
    "relax.permute_dims": (_permute_of_permute, _permute_of_broadcast),
    "relax.matmul": (_matmul_of_broadcast, _outer_product),
    "relax.collapse_sum_to": (_collapse_of_matmul,),
}


@tvm.transform.module_pass(opt_level=0, name="SimplifyBroadcastMatmul")
class SimplifyBroadcastMatmul:
    """Apply the rules of this module's docstring to every Relax function."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: PassContext) -> tvm.IRModule:
        simplifier = _Simplifier(mod)
        for gv, func in graph_functions(mod):
            simplifier.builder_.update_func(gv, simplifier.simplify_function(func))
        report_counts(self.report, "SimplifyBroadcastMatmul", simplifier.counts)
        return simplifier.builder_.get()

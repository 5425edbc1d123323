"""Autodiff of a program with a symbolic dim (a dynamic batch) past three limits of TVM 0.27's
`relax.transform.Gradient`.

With a symbolic dim, Gradient copies the forward bindings into the backward pass
(`lv_cp = R.matmul(x, w)` beside `lv = R.matmul(x, w)`), and

1. fails ("key is not in Map") copying a binding whose call takes a symbolic shape
   (`R.reshape(x, R.shape([n, 108]))` of `x.flatten(1)`, `R.ones(R.shape([n]))`): `lift_shapes`
   makes each such shape a parameter of `main` before, `bind_shapes` puts it back into
   `main_adjoint` after; a `broadcast_to` of a tensor to the shape it has (attention's `expand`)
   is dropped instead, since the copy of a broadcast to a shape parameter has no static shape
   and the gradients of what reads it fail; and a broadcast of a [1, d...] or [d...] tensor
   over the batch (a ViT's class token, `cls.expand(n, -1, -1)`; a weight broadcast for a
   batched matmul, a Linear on a strided 3-D view) becomes a product with ones of shape
   [n, 1, ...] sliced from an input, whose type keeps n; a range of length n
   (`logits[torch.arange(n), y]`) becomes a running count of such ones;
2. would run the forward pass twice: `bind_shapes` merges the copies (common subexpressions);
   attention that RecomputeAttention marks for recomputation is then kept instead;
3. builds the gradients' shapes with the forward program's symbolic variables, other objects
   of the same name than the adjoint's: `unify_symbolic_vars` makes them one variable again
   once the adjoint is inlined into the train step.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.sym import Analyzer

SHAPE_PARAM_PREFIX = "tvmgraph_shape_"


def is_symbolic(func: relax.Function) -> bool:
    return bool(relax.analysis.defined_symbolic_vars(func))


def lift_shapes(mod: tvm.IRModule) -> tuple[tvm.IRModule, list[str]]:
    """`mod` whose `main` takes each symbolic shape argument of a call as a new last parameter;
    the names of those parameters."""
    main = mod["main"]
    lifter = _ShapeLifter(main.params)
    body = lifter.visit_expr(main.body)
    if tvm_ffi.structural_equal(body, main.body, map_free_vars=True):
        return mod, []
    mod = mod.clone()
    mod["main"] = relax.Function([*main.params, *lifter.params], body, main.ret_ty, main.is_pure, main.attrs)
    return mod, [p.name for p in lifter.params]


@mutator
class _ShapeLifter(PyExprMutator):
    def __init__(self, inputs: list[relax.Var]) -> None:
        super().__init__()
        self.inputs = inputs
        self.params: list[relax.Var] = []
        self.tensors: list[relax.Var] = [p for p in inputs if _dims(p) is not None]  # for _fill_like

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        # The bound variable keeps its type: inferred from a shape parameter, the result's shape
        # would be that parameter (`R.Tensor(tvmgraph_shape_0)`), not the dims the gradients read.
        value = self.visit_expr(binding.value)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))
        if _dims(binding.var) is not None:
            self.tensors.append(binding.var)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        counted = self._batch_arange(call)
        if counted is not None:
            # `torch.arange(x.shape[0])` (picking each row's label: `logits[arange(n), y]`): a
            # range of symbolic length, which autodiff's copy fails on ("key is not in Map"),
            # as a running count of ones of the batch's shape.
            return counted
        if not any(_symbolic_shape(a) for a in call.args):
            return call
        like = self._fill_like(call)
        if like is not None:
            # ones/zeros/full of a symbolic shape that a tensor before it has: the same fill
            # "like" that tensor keeps its dims in autodiff's copy (a padding embedding's scale,
            # `torch.ones(x.shape[0])`), where a fill of a shape parameter has none.
            return like
        if _identity_broadcast(call):
            # attention's `expand` to the shape its input has: with the shape lifted, autodiff's
            # copy of it would have no static shape, nor would the matmul that reads it.
            return call.args[0]
        ones = self._batch_of_ones(call)
        if ones is not None:
            # A ViT's class token expanded over the batch: x * ones of shape [n, 1, ...] has
            # the batch in its type, where the copy of a broadcast to a shape parameter has none.
            return relax.op.multiply(call.args[0], ones)
        args = []
        for arg in call.args:
            if _symbolic_shape(arg):
                param = relax.Var(f"{SHAPE_PARAM_PREFIX}{len(self.params)}", relax.ShapeType(arg.values))
                self.params.append(param)
                arg = param
            args.append(arg)
        return relax.Call(call.op, args, call.attrs, call.ty_args)

    def _fill_like(self, call: relax.Call) -> relax.Expr | None:
        """`ones(shape)`, `zeros(shape)`, `full(shape, v)` as the same fill like a tensor bound
        before it whose dims are `shape`'s; None if there is none."""
        name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
        if name not in ("relax.ones", "relax.zeros", "relax.full"):
            return None
        target = list(call.args[0].values)
        like = next((t for t in reversed(self.tensors) if len(_dims(t)) == len(target)
                     and all(tvm_ffi.structural_equal(a, b) for a, b in zip(_dims(t), target))), None)
        if like is None:
            return None
        dtype = str(call.attrs.dtype)
        if name == "relax.full":
            return relax.op.full_like(like, call.args[1], dtype)
        return (relax.op.ones_like if name == "relax.ones" else relax.op.zeros_like)(like, dtype)

    def _batch_arange(self, call: relax.Call) -> relax.Expr | None:
        """For `arange(start, end, step)` with constant start and step and a symbolic length n,
        the dim 0 of an input of `main`: start + step * (the running count of ones of shape [n],
        sliced from that input, minus one)."""
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.arange") or len(call.args) != 3:
            return None
        start, end, step = call.args  # integer expressions: IntImm, or built from the batch's variable
        if isinstance(end, tvm.tirx.IntImm) or not all(isinstance(b, tvm.tirx.IntImm) for b in (start, step)) \
                or int(step) <= 0:
            return None
        length = Analyzer().simplify(tvm.tirx.floordiv(end - start + (int(step) - 1), int(step)))
        dtype = str(call.attrs.dtype)
        ones = self._ones_over(length, [length], dtype)
        if ones is None:
            return None
        count = self.builder_.emit(relax.op.cumsum(ones, axis=0, dtype=dtype))
        return relax.op.add(relax.op.multiply(relax.op.subtract(count, relax.const(1, dtype)),
                                              relax.const(int(step), dtype)), relax.const(int(start), dtype))

    def _ones_over(self, n: tvm.tirx.PrimExpr, target: list, dtype: str) -> relax.Expr | None:
        """Ones of shape [n, 1, ...] (as many dims as `target`), sliced from an input of `main`
        whose dim 0 is n; None if there is none."""
        source = next((p for p in self.inputs if isinstance(p.ty, relax.TensorType)
                       and isinstance(p.ty.shape, relax.ShapeExpr) and len(p.ty.shape.values) >= 1
                       and tvm_ffi.structural_equal(p.ty.shape.values[0], n)), None)
        if source is None:
            return None
        rank = len(source.ty.shape.values)
        column = source
        if rank > 1:
            column = self.builder_.emit(relax.op.strided_slice(source, list(range(1, rank)), [0] * (rank - 1),
                                                               [1] * (rank - 1)))
        ones = self.builder_.emit(relax.op.ones_like(column, dtype))
        if rank > len(target):
            ones = self.builder_.emit(relax.op.squeeze(ones, list(range(len(target), rank))))
        for axis in range(rank, len(target)):
            ones = self.builder_.emit(relax.op.expand_dims(ones, axis))
        return ones

    def _batch_of_ones(self, call: relax.Call) -> relax.Expr | None:
        """For `broadcast_to(x, [n, d...])` with x of shape [1, d...] or [d...] and n the dim 0
        of an input of `main`: ones of shape [n, 1, ...] (x's dtype), sliced from that input."""
        if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.broadcast_to"):
            return None
        x, shape = call.args
        if not (isinstance(x.ty, relax.TensorType) and isinstance(x.ty.shape, relax.ShapeExpr)):
            return None
        dims, target = list(x.ty.shape.values), list(shape.values)
        if len(dims) == len(target) - 1:  # a weight broadcast over the batch for a batched
            dims = [tvm.tirx.IntImm("int64", 1), *dims]  # matmul (Linear on a strided 3-D view)
        if len(dims) != len(target) or not isinstance(dims[0], tvm.tirx.IntImm) or int(dims[0]) != 1 \
                or not all(tvm_ffi.structural_equal(a, b) for a, b in zip(dims[1:], target[1:])):
            return None
        return self._ones_over(target[0], target, str(x.ty.dtype))


def _dims(var: relax.Expr) -> list | None:
    """A tensor's dims, when its type has them."""
    ty = var.ty if isinstance(var, relax.Expr) else None
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _identity_broadcast(call: relax.Call) -> bool:
    """`broadcast_to(x, shape)` with `shape` the shape x has."""
    if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.broadcast_to"):
        return False
    x, shape = call.args
    return isinstance(x.ty, relax.TensorType) and isinstance(x.ty.shape, relax.ShapeExpr) \
        and tvm_ffi.structural_equal(x.ty.shape, shape)


def _symbolic_shape(arg: relax.Expr) -> bool:
    return isinstance(arg, relax.ShapeExpr) and not all(isinstance(d, tvm.tirx.IntImm) for d in arg.values)


def bind_shapes(mod: tvm.IRModule, names: list[str]) -> tvm.IRModule:
    """`main_adjoint` with the lifted shapes written back in place (each is its parameter's
    type) and the forward pass's copies merged."""
    adjoint = mod["main_adjoint"]
    if names:
        params = {p.name: p for p in adjoint.params}
        adjoint = adjoint.bind_params({params[n]: relax.ShapeExpr(params[n].ty.values) for n in names})
    mod = mod.clone()
    del mod["main_adjoint"]  # a new GlobalVar: the old one's type lists the lifted parameters
    builder = relax.BlockBuilder(mod)
    builder.add_func(adjoint, "main_adjoint")
    return relax.transform.EliminateCommonSubexpr()(builder.get())


def unify_symbolic_vars(func: relax.Function) -> relax.Function:
    """One variable per symbolic dim: the parameters take the variable that the inlined
    gradients' shapes use (the only binding TVM offers is of the parameters' variables)."""
    free = {v.name: v for v in relax.analysis.free_symbolic_vars(func)}
    renamed = {v: free[v.name] for v in relax.analysis.defined_symbolic_vars(func) if v.name in free}
    return func.bind_symbolic_vars(renamed) if renamed else func

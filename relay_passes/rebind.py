"""`rebind`: emit a binding whose value a mutator rewrote, dropping `y = x` aliases.

A rewrite that simplifies a value to an existing variable (`broadcast_to(x, x.shape)` -> `x`)
would leave `y = x` behind; uses of `y` should read `x` instead. PyExprMutator's default
binding visitor cannot be reused for this (it visits the value itself), so the mutators of
simplify_broadcast_matmul.py and simplify_power.py override `visit_var_binding_` with

    def visit_var_binding_(self, binding):
        rebind(self, binding, self.visit_expr(binding.value))

which does what ExprMutator::ReEmitBinding does, except for aliases of dataflow variables.
`BoundRewriter` is that override with a rewrite counter and a binding lookup, the base of the
attention and safe-softmax fusers.
"""

from __future__ import annotations

from collections import Counter

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator


def rebind(mutator: PyExprMutator, binding: relax.VarBinding, value: relax.Expr) -> relax.Var:
    """Emit `binding.var = value`, or remap `binding.var` to `value` when it is a variable;
    return the variable that now names the value."""
    if isinstance(value, relax.Var) and isinstance(binding.var, relax.DataflowVar):
        mutator.set_var_remap(binding.var, value)
        return value
    var = mutator.visit_var_def(binding.var)
    if var.same_as(binding.var) and value.same_as(binding.value):
        mutator.builder_.emit_normalized(binding)
        return var
    typed = mutator.with_type(var, value.ty)
    if not typed.same_as(binding.var):
        mutator.set_var_remap(binding.var, typed)
    mutator.builder_.emit_normalized(relax.VarBinding(typed, value))
    return typed


class BoundRewriter(PyExprMutator):
    """A rewriting mutator's common part: each binding re-emitted with `rebind`, `counts` of what
    was rewritten (for `report_counts`), and `_bound`, the value a variable is bound to.
    Subclasses carry TVM's `@mutator` decorator (this base must not: a decorated class cannot
    be subclassed)."""

    def __init__(self, mod: tvm.IRModule) -> None:
        super().__init__(mod)
        self.counts: Counter[str] = Counter()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        rebind(self, binding, self.visit_expr(binding.value))

    def _bound(self, expr: relax.Expr) -> relax.Expr | None:
        return self.lookup_binding(expr) if isinstance(expr, relax.Var) else None

"""The little language optimizer formulas are written in, and its Relax backend.

A formula (optimizers.py) combines `Value`s with + - * / and unary minus, and calls
`ops.const`, `ops.sqrt`, `ops.pow`, `ops.abs`, `ops.sign`, `ops.maximum`, `ops.minimum`,
`ops.where_gt` and `ops.output`. Values are elementwise (shaped like the parameter) or scalar
(hyperparameters, per-parameter scalar state such as Adam's step, constants); mixing them
broadcasts. Reductions (`ops.mean` along one dim, `ops.norm` of a whole tensor, a scalar) and
`ops.rsqrt` exist in the Relax backend only: a rule that uses them is not `in_place`
(Adafactor's factored moments, shaped like the parameter with one dim reduced, broadcast too).

Scalar arithmetic is float64, as torch's is (its optimizers compute bias corrections, NAdam's
momentum cache, RAdam's rectification in Python floats): hyperparameters travel as float64, and
scalar state (float32 tensors in torch) is widened where it is read. A scalar meeting an
elementwise value is cast to the parameter's dtype, as torch casts a Python scalar to the
tensor's. Elementwise arithmetic is in the parameter's dtype.

`RelaxUpdateOps` evaluates a formula into Relax bindings; relay_passes/fuse_model_update.py
has the TE backend that builds one in-place kernel per param group.
"""

from __future__ import annotations

from typing import Protocol

from tvm import relax

SCALAR_DTYPE = "float64"  # of hyperparameters and of scalar arithmetic


class Value(Protocol):
    def __add__(self, other: Value) -> Value: ...
    def __sub__(self, other: Value) -> Value: ...
    def __mul__(self, other: Value) -> Value: ...
    def __truediv__(self, other: Value) -> Value: ...
    def __neg__(self) -> Value: ...


class UpdateOps(Protocol):
    def const(self, value: float) -> Value: ...
    def sqrt(self, x: Value) -> Value: ...
    def pow(self, base: Value, exponent: Value) -> Value: ...
    def abs(self, x: Value) -> Value: ...
    def sign(self, x: Value) -> Value: ...  # -1, 0 or 1, as torch.sign
    def maximum(self, a: Value, b: Value) -> Value: ...
    def minimum(self, a: Value, b: Value) -> Value: ...
    def where_gt(self, x: Value, threshold: Value, then: Value, otherwise: Value) -> Value: ...
    def output(self, key: str, value: Value) -> Value: ...


class RelaxValue:
    """A Relax expression, its dtype and whether it is scalar, with arithmetic operators."""

    __slots__ = ("expr", "dtype", "scalar", "ops")

    def __init__(self, expr: relax.Expr, dtype: str, scalar: bool, ops: RelaxUpdateOps):
        self.expr = expr
        self.dtype = dtype
        self.scalar = scalar
        self.ops = ops

    def _binary(self, other: RelaxValue, fn) -> RelaxValue:
        return self.ops.apply(fn, self, other)

    def __add__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.add)

    def __sub__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.subtract)

    def __mul__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.multiply)

    def __truediv__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.divide)

    def __neg__(self) -> RelaxValue:
        return self.ops.apply(relax.op.negative, self)


class RelaxUpdateOps:
    """Evaluates a formula into Relax bindings of `bb`; elementwise values compute in `dtype`
    (the parameter's); `outputs` collects the results by key."""

    def __init__(self, bb: relax.BlockBuilder, dtype: str, out_dtypes: dict[str, str]):
        self.bb = bb
        self.dtype = dtype
        self.out_dtypes = out_dtypes  # each result is stored in the dtype of what it replaces
        self.outputs: dict[str, relax.Var] = {}

    def wrap(self, var: relax.Var, scalar: bool = False) -> RelaxValue:
        return RelaxValue(var, var.ty.dtype.dtype, scalar, self)

    def apply(self, fn, *args: RelaxValue) -> RelaxValue:
        """`fn` of `args`, in float64 if all are scalar, else in the parameter's dtype."""
        scalar = all(a.scalar for a in args)
        dtype = SCALAR_DTYPE if scalar else self.dtype
        exprs = [a.expr if a.dtype == dtype else relax.op.astype(a.expr, dtype) for a in args]
        return RelaxValue(fn(*exprs), dtype, scalar, self)

    def const(self, value: float) -> RelaxValue:
        return RelaxValue(relax.const(value, SCALAR_DTYPE), SCALAR_DTYPE, True, self)

    def sqrt(self, x: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.sqrt, x)

    def pow(self, base: RelaxValue, exponent: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.power, base, exponent)

    def abs(self, x: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.abs, x)

    def sign(self, x: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.sign, x)

    def maximum(self, a: RelaxValue, b: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.maximum, a, b)

    def minimum(self, a: RelaxValue, b: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.minimum, a, b)

    def where_gt(self, x: RelaxValue, threshold: RelaxValue, then: RelaxValue, otherwise: RelaxValue) -> RelaxValue:
        # The condition is passed as an operand so that it counts in the scalar-ness of the result.
        return self.apply(lambda a, b, c, d: relax.op.where(relax.op.greater(a, b), c, d),
                          x, threshold, then, otherwise)

    def shape(self, x: RelaxValue) -> tuple[int, ...]:
        return tuple(int(d) for d in x.expr.ty.shape.values)

    def rsqrt(self, x: RelaxValue) -> RelaxValue:
        return self.apply(relax.op.rsqrt, x)

    def mean(self, x: RelaxValue, axis: int) -> RelaxValue:
        """The mean along `axis`, kept as a dim of 1 (broadcasts against x)."""
        return RelaxValue(self.bb.emit(relax.op.mean(x.expr, axis=[axis], keepdims=True)), x.dtype, False, self)

    def norm(self, x: RelaxValue) -> RelaxValue:
        """The 2-norm of the whole tensor, a scalar (torch's `x.norm(2).item()`)."""
        total = relax.op.sum(relax.op.multiply(x.expr, x.expr))
        return RelaxValue(self.bb.emit(relax.op.sqrt(total)), x.dtype, True, self)

    def output(self, key: str, value: RelaxValue) -> RelaxValue:
        """Bind `value` as result `key`, in the dtype of the state (or parameter) it replaces."""
        dtype = self.out_dtypes[key]
        expr = value.expr if value.dtype == dtype else relax.op.astype(value.expr, dtype)
        var = self.bb.emit(expr)
        self.outputs[key] = var
        return RelaxValue(var, dtype, value.scalar, self)

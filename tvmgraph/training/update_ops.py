"""The little language optimizer formulas are written in, and its Relax backend.

A formula (optimizers.py) combines `Value`s with + - * / and unary minus, and calls
`ops.const`, `ops.sqrt`, `ops.pow`, `ops.maximum`, `ops.where_gt` and `ops.output`. Values
are elementwise (shaped like the parameter) or scalar (hyperparameters, Adam's step); mixing
them broadcasts. Hyperparameters and scalar state are float32; they are cast to the
parameter's dtype where they meet it.

`RelaxUpdateOps` evaluates a formula into Relax bindings; relay_passes/fuse_model_update.py
has the TE backend that builds one in-place kernel per param group.
"""

from __future__ import annotations

from typing import Protocol

from tvm import relax


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
    def maximum(self, a: Value, b: Value) -> Value: ...
    def where_gt(self, x: Value, threshold: Value, then: Value, otherwise: Value) -> Value: ...
    def output(self, key: str, value: Value) -> Value: ...


class RelaxValue:
    """A Relax expression and its dtype, with arithmetic operators; a float32 scalar meeting a
    value of the parameter's dtype is cast to it."""

    __slots__ = ("expr", "dtype", "ops")

    def __init__(self, expr: relax.Expr, dtype: str, ops: RelaxUpdateOps):
        self.expr = expr
        self.dtype = dtype
        self.ops = ops

    def _binary(self, other: RelaxValue, fn) -> RelaxValue:
        return self.ops.result(fn(self.ops.cast(self), self.ops.cast(other)))

    def __add__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.add)

    def __sub__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.subtract)

    def __mul__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.multiply)

    def __truediv__(self, other: RelaxValue) -> RelaxValue:
        return self._binary(other, relax.op.divide)

    def __neg__(self) -> RelaxValue:
        return self.ops.result(relax.op.negative(self.ops.cast(self)))


class RelaxUpdateOps:
    """Evaluates a formula into Relax bindings of `bb`, computing in `dtype` (the parameter's);
    `outputs` collects the results by key."""

    def __init__(self, bb: relax.BlockBuilder, dtype: str, out_dtypes: dict[str, str]):
        self.bb = bb
        self.dtype = dtype
        self.out_dtypes = out_dtypes  # each result is stored in the dtype of what it replaces
        self.outputs: dict[str, relax.Var] = {}

    def wrap(self, var: relax.Var) -> RelaxValue:
        return RelaxValue(var, var.ty.dtype.dtype, self)

    def result(self, expr: relax.Expr) -> RelaxValue:
        return RelaxValue(expr, self.dtype, self)

    def cast(self, value: RelaxValue) -> relax.Expr:
        return value.expr if value.dtype == self.dtype else relax.op.astype(value.expr, self.dtype)

    def const(self, value: float) -> RelaxValue:
        return self.result(relax.const(value, self.dtype))

    def sqrt(self, x: RelaxValue) -> RelaxValue:
        return self.result(relax.op.sqrt(self.cast(x)))

    def pow(self, base: RelaxValue, exponent: RelaxValue) -> RelaxValue:
        return self.result(relax.op.power(self.cast(base), self.cast(exponent)))

    def maximum(self, a: RelaxValue, b: RelaxValue) -> RelaxValue:
        return self.result(relax.op.maximum(self.cast(a), self.cast(b)))

    def where_gt(self, x: RelaxValue, threshold: RelaxValue, then: RelaxValue, otherwise: RelaxValue) -> RelaxValue:
        cond = relax.op.greater(self.cast(x), self.cast(threshold))
        return self.result(relax.op.where(cond, self.cast(then), self.cast(otherwise)))

    def output(self, key: str, value: RelaxValue) -> RelaxValue:
        """Bind `value` as result `key`, in the dtype of the state (or parameter) it replaces."""
        dtype = self.out_dtypes[key]
        expr = value.expr if value.dtype == dtype else relax.op.astype(value.expr, dtype)
        var = self.bb.emit(expr)
        self.outputs[key] = var
        return RelaxValue(var, dtype, self)

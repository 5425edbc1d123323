"""Shared helpers for the gradient registrations: one registration rule, static shapes, constants.

Level semantics of ``FPrimalGradient`` (checked on TVM 0.27, ``tvm.ir.register_op_attr``):

* a registration at a *higher* level than the one present replaces it;
* one at a *lower* level is silently ignored;
* one at the *same* level raises ``InternalError: ... already registered with same plevel``.

TVM registers its own gradients (``tvm/relax/op/_op_gradient.py``) at the default level 10.
:func:`register` therefore adds a missing gradient at level 10 only when the op has none, so a
gradient that a later TVM ships wins over ours, and overrides a wrong TVM gradient at level 11.
Registering the same op again (a second import, ``importlib.reload``) is a logged no-op.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Sequence

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.op.base import register_gradient

logger = logging.getLogger(__name__)

#: The level TVM registers its own gradients at; gradients TVM lacks are added at this level.
TVM_LEVEL = 10
#: The level of our overrides of TVM gradients that are wrong (see ``fixes.py``).
FIX_LEVEL = TVM_LEVEL + 1

FGradient = Callable[[relax.Var, relax.Call, relax.Var, relax.BlockBuilder], list[relax.Expr]]

#: op name -> level of every gradient this package registered (for tests and docs).
REGISTERED: dict[str, int] = {}


def register(op_name: str, *, fixes_tvm: bool = False) -> Callable[[FGradient], FGradient]:
    """Register the decorated function as the ``FPrimalGradient`` of ``op_name``.

    With ``fixes_tvm=False`` the op must lack a gradient; if it has one (TVM now ships it, or an
    earlier import registered ours), that one is kept. With ``fixes_tvm=True`` the function
    replaces TVM's gradient (level :data:`FIX_LEVEL`); say why in the function's docstring.
    """

    def decorator(fgradient: FGradient) -> FGradient:
        op = tvm.ir.Op.get(op_name)
        if not fixes_tvm and op.get_attr("FPrimalGradient") is not None:
            logger.debug("%s already has a gradient; keeping it", op_name)
            return fgradient
        level = FIX_LEVEL if fixes_tvm else TVM_LEVEL

        def named(*args):  # a gradient that cannot handle its input says which op it is
            try:
                return fgradient(*args)
            except NotImplementedError as e:
                if op_name in str(e):
                    raise
                raise NotImplementedError(f"{op_name}: {e}") from None

        try:
            register_gradient(op_name, named, level=level)
        except tvm.error.InternalError as err:
            if "already registered with same plevel" not in str(err):
                raise
            logger.debug("%s: our level-%d gradient is already registered", op_name, level)
        REGISTERED[op_name] = level
        return fgradient

    return decorator


##################### Static shapes and dtypes #####################


def shape_of(expr: relax.Expr) -> list[int]:
    """The static shape of a tensor-typed expression, as Python ints."""
    shape = list(expr.ty.shape)
    if not all(isinstance(dim, tvm.tirx.IntImm) for dim in shape):
        raise NotImplementedError(
            f"tvmgraph.gradients need static shapes (as TVM's own gradients do), got {shape} (a "
            f"symbolic dim is a dynamic batch: train this graph with a static batch)"
        )
    return [int(dim) for dim in shape]


def spatial_shape_of(expr: relax.Expr, count: int = 2) -> list[int]:
    """The last `count` dims (an image's H and W) as Python ints: static even where a dynamic
    batch makes the leading dim symbolic."""
    shape = list(expr.ty.shape)[-count:]
    if not all(isinstance(dim, tvm.tirx.IntImm) for dim in shape):
        raise NotImplementedError(f"tvmgraph.gradients need static spatial dims, got {list(expr.ty.shape)}")
    return [int(dim) for dim in shape]


def dims_of(expr: relax.Expr) -> list[int | tvm.tirx.PrimExpr]:
    """The shape of a tensor-typed expression: ints, and a symbolic dim (a dynamic batch) as
    it is, for gradients that only pass the shape on to Relax ops (broadcast, reshape, zeros)."""
    shape = expr.ty.shape
    if isinstance(shape, relax.Var) and getattr(shape.ty, "values", None) is not None:
        shape = shape.ty.values  # a shape parameter (training/symbolic_shapes.py): its dims
    if shape is None or isinstance(shape, relax.Var):
        raise NotImplementedError(f"tvmgraph.gradients need known shapes, got {expr.ty}")
    return [int(dim) if isinstance(dim, tvm.tirx.IntImm) else dim for dim in shape]


def same_dims(a: list[int | tvm.tirx.PrimExpr], b: list[int | tvm.tirx.PrimExpr]) -> bool:
    """Whether two `dims_of` shapes are the same (symbolic dims compared structurally)."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else tvm_ffi.structural_equal(x, y)
        for x, y in zip(a, b))


def dtype_of(expr: relax.Expr) -> str:
    """The dtype of a tensor-typed expression, e.g. ``"float32"``."""
    dtype = expr.ty.dtype
    return dtype if isinstance(dtype, str) else str(dtype.dtype)


def const(value: float, like: relax.Expr) -> tvm.ir.expr.Constant:
    """A scalar constant with the dtype of ``like``."""
    return relax.const(value, dtype_of(like))


def scalar_operand(value: int | relax.Expr, dtype: str) -> relax.Expr:
    """An operand of Relax arithmetic: a constant of `dtype` for an int, else `value` as it is
    (a symbolic dim, or a 0-d tensor counted at run time)."""
    return relax.const(value, dtype) if isinstance(value, int) else value


def in_float32(ctx: relax.BlockBuilder, formula: Callable[..., relax.Expr], *tensors: relax.Expr) -> relax.Expr:
    """`formula(*tensors)` computed in float32 when they are bfloat16/float16 and rounded once
    to their dtype, as torch's 16-bit kernels compute ("opmath"); plain otherwise."""
    low = dtype_of(tensors[0])
    if low not in ("bfloat16", "float16"):
        return formula(*tensors)
    return relax.op.astype(formula(*[ctx.normalize(relax.op.astype(t, "float32")) for t in tensors]), low)


def prod(values: Sequence[int]) -> int:
    """The product of a sequence of ints (1 when empty)."""
    return functools.reduce(operator.mul, values, 1)


def normalize_axes(axes: Sequence[int] | None, ndim: int) -> list[int]:
    """Axes as sorted non-negative ints; ``None`` means all axes."""
    if axes is None:
        return list(range(ndim))
    return sorted(int(axis) % ndim for axis in axes)


def scalar_of(value: object) -> float:
    """A Python float from a ``PrimValue``, ``IntImm``/``FloatImm`` or number argument."""
    while hasattr(value, "value"):
        value = value.value
    return float(value)  # type: ignore[arg-type]


##################### Tuple-valued calls #####################


def tuple_field_grad(
    ctx: relax.BlockBuilder, output_grad: relax.Expr, index: int
) -> relax.Expr | None:
    """The adjoint of field ``index`` of a tuple-valued call, or ``None`` if it is all zeros.

    ``relax.transform.Gradient`` hands a tuple-valued call the adjoint of the whole tuple: a
    ``Var`` bound to ``Tuple(...)`` whose unused fields are ``relax.zeros(shape, dtype)``. Fields
    that are zeros by construction are reported as ``None`` so the caller can skip their terms.
    """
    binding = ctx.lookup_binding(output_grad) if isinstance(output_grad, relax.Var) else output_grad
    if isinstance(binding, relax.Tuple):
        field = binding.fields[index]
        if isinstance(field, relax.Var) and ctx.lookup_binding(field) is not None:
            field = ctx.lookup_binding(field)
        if isinstance(field, relax.Call) and field.op.same_as(tvm.ir.Op.get("relax.zeros")):
            return None
    return relax.TupleGetItem(output_grad, index)


def sum_to_shape(expr: relax.Expr, axes: Sequence[int], shape: Sequence[int]) -> relax.Expr:
    """``sum(expr, axes)`` reshaped to ``shape``; no reduction when ``axes`` is empty."""
    if axes:
        expr = relax.op.sum(expr, list(axes))
    return relax.op.reshape(expr, list(shape))

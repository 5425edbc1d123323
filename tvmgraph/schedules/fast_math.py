"""Vectorizable float32 exp, erf, tanh and sigmoid for CPU kernels.

LLVM has no vector `exp`/`erf`/`tanh` on x86 without a vector math library, so a vectorized
loop that calls one is split back into scalar libm calls: a softmax or GELU then runs at 2-10
ns per element, 20-100x slower than the loads and stores around it. `use_fast_math` rewrites
each float32 call into the polynomial TVM's TOPI uses for `fast_exp`/`fast_erf`/`fast_tanh`
(Cephes exp with a bit-built power of two; Eigen's rational erf and tanh), which vectorize.

Accuracy, measured against numpy float64 over [-20, 20] (see tests/numeric/test_cpu_schedules):
exp within 2 ulp-ish (relative 3e-7) for x in [-87, 88.72], 0 below (exact 0 for -inf, which
masked softmax relies on), inf above as in torch; erf and tanh within 1e-6 absolute;
sigmoid within 1e-6 absolute. A NaN input gives NaN as in torch, through the clamps' max/min,
once PropagateNaN (propagate_nan.py) has made those NaN-propagating.

The rewrite works block by block: a block whose body is a store of an expression containing
such calls is replaced by the same block with the calls expanded.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm.ir.expr as E
from tvm import s_tir, tirx

from .unchecked import Schedule
from .loops import contains, root_blocks

_F32 = "float32"


def _c(value: float) -> tirx.PrimExpr:
    return tirx.const(value, _F32)


def _horner(x: tirx.PrimExpr, coefficients: tuple[float, ...]) -> tirx.PrimExpr:
    """coefficients[0] * x^(n-1) + ... + coefficients[-1], highest power first."""
    acc = _c(coefficients[0])
    for coef in coefficients[1:]:
        acc = acc * x + _c(coef)
    return acc


def _let(value: tirx.PrimExpr, body: Callable[[tirx.PrimExpr], tirx.PrimExpr], name: str,
         bind: bool) -> tirx.PrimExpr:
    """`body(value)`, with `value` bound to a variable first if `bind` and it is not a variable
    or a constant. The polynomials read their argument up to 20 times: written out, a tanh of a
    sigmoid's product (a GRU cell) held each sigmoid's argument hundreds of times over, and such
    kernels took 1.5 s each to build (a 2-layer GRU over 32 steps: 35 s to its first call)."""
    if not bind or isinstance(value, (tirx.Var, tirx.FloatImm, tirx.IntImm)):
        return body(value)
    var = tirx.Var(name, str(value.ty))
    return tirx.Let(var, value, body(var))


def fast_exp(x: tirx.PrimExpr, bind: bool = True) -> tirx.PrimExpr:
    """exp(x) = 2^n * exp(f), f = x - n ln 2 in [-ln2/2, ln2/2] (TOPI's fast_exp)."""
    # Up to ln(3.4028235e38), float32's largest finite value: TOPI's 88.376 sent exp(88.5)
    # (2.7e38) to inf. Above it, inf as in torch (2^n * y passes the largest float).
    return _let(tirx.max(tirx.min(x, _c(88.72283935546875)), _c(-88.3762626647949)), _exp_of, "exp_x", bind)


def _exp_of(x: tirx.PrimExpr) -> tirx.PrimExpr:
    n = tirx.floor(x * _c(1.44269504088896341) + _c(0.5))
    f = x - n * _c(0.6931471805599453)
    poly = _horner(
        f,
        (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
         5.0000001201e-1),
    )
    y = poly * f * f + f + _c(1.0)
    # For n > 0, 2^n as 2^(n - 1) * 2, the 2 taken with y: n reaches 128 near the top, and a
    # bit-built 2^128 is inf. At the bottom n = -127 builds 0 (and 2^(n - 1) a negative exponent).
    top = n > _c(0.0)
    biased = n + _c(127.0) - tirx.Select(top, _c(1.0), _c(0.0))
    two_n = tirx.reinterpret(_F32, tirx.shift_left(tirx.Cast("int32", biased), 23))
    return tirx.max(two_n * (y * tirx.Select(top, _c(2.0), _c(1.0))), x)


def fast_erf(x: tirx.PrimExpr, bind: bool = True) -> tirx.PrimExpr:
    """Eigen's rational approximation of erf on [-4, 4] (TOPI's fast_erf)."""
    return _let(tirx.max(tirx.min(x, _c(4.0)), _c(-4.0)), _erf_of, "erf_x", bind)


def _erf_of(x: tirx.PrimExpr) -> tirx.PrimExpr:
    x2 = x * x
    p = _horner(
        x2,
        (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
         -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
         -1.60960333262415e-02),
    )
    q = _horner(
        x2,
        (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
         -7.37332916720468e-03, -1.42647390514189e-02),
    )
    return x * p / q


def fast_tanh(x: tirx.PrimExpr, bind: bool = True) -> tirx.PrimExpr:
    """Eigen's rational approximation of tanh on [-9, 9] (TOPI's fast_tanh)."""
    return _let(tirx.max(tirx.min(x, _c(9.0)), _c(-9.0)), _tanh_of, "tanh_x", bind)


def _tanh_of(x: tirx.PrimExpr) -> tirx.PrimExpr:
    x2 = x * x
    p = _horner(
        x2,
        (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
         5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
         4.89352455891786e-03),
    )
    q = _horner(x2, (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                     4.89352518554385e-03))
    return x * p / q


def fast_sigmoid(x: tirx.PrimExpr, bind: bool = True) -> tirx.PrimExpr:
    """1 / (1 + exp(-x)) with the fast exp."""
    return _c(1.0) / (_c(1.0) + fast_exp(_c(0.0) - x, bind))


FAST_FUNCTIONS: dict[str, Callable[[tirx.PrimExpr, bool], tirx.PrimExpr]] = {
    "tirx.exp": fast_exp,
    "tirx.erf": fast_erf,
    "tirx.tanh": fast_tanh,
    "tirx.sigmoid": fast_sigmoid,
}

_BINARY = tuple(
    getattr(tirx, name)
    for name in ("Add", "Sub", "Mul", "Div", "Min", "Max", "EQ", "NE", "LT", "LE", "GT", "GE",
                 "And", "Or", "FloorDiv", "FloorMod", "Mod")
)


def rewrite_expr(expr: tirx.PrimExpr, bind: bool = True) -> tirx.PrimExpr | None:
    """`expr` with fast float32 transcendental calls, or None if nothing changed; `bind`: their
    arguments bound to variables (see `_let`).

    Node kinds it does not know are left alone (and not looked into).
    """
    if isinstance(expr, E.Call):
        new_args = [rewrite_expr(a, bind) for a in expr.args]
        args = [n if n is not None else a for n, a in zip(new_args, expr.args)]
        name = getattr(expr.op, "name", None)
        if name in FAST_FUNCTIONS and str(expr.ty) == _F32 and len(args) == 1:
            return FAST_FUNCTIONS[name](args[0], bind)
        if any(n is not None for n in new_args):
            return E.Call(expr.op, args, ret_ty=expr.ty)
        return None
    if isinstance(expr, _BINARY):
        a, b = rewrite_expr(expr.a, bind), rewrite_expr(expr.b, bind)
        if a is None and b is None:
            return None
        return type(expr)(a if a is not None else expr.a, b if b is not None else expr.b)
    if isinstance(expr, tirx.Select):
        parts = [expr.condition, expr.true_value, expr.false_value]
        new = [rewrite_expr(p, bind) for p in parts]
        if all(n is None for n in new):
            return None
        return tirx.Select(*[n if n is not None else p for n, p in zip(new, parts)])
    if isinstance(expr, tirx.Cast):
        value = rewrite_expr(expr.value, bind)
        return None if value is None else tirx.Cast(str(expr.ty), value)
    return None


def use_fast_math(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with every root-level block's float32 exp/erf/tanh/sigmoid made vectorizable.

    In a kernel that holds any bfloat16 the arguments are not bound to variables: TVM 0.27's
    bfloat16 legalization and a Let made LLVM codegen fail ("BF16 needs to be storaged lowered
    first") or compute wrong numbers (CPU autocast graphs)."""
    if not contains(func.body, E.Call, lambda call: getattr(call.op, "name", None) in FAST_FUNCTIONS):
        return func  # most kernels call none: no schedule to make (0.9 ms a kernel)
    bind: bool | None = None  # read from the printed kernel once a block has such a call
    sch = Schedule(func)
    changed = False
    for block in root_blocks(sch):
        stmt = sch.get(block)
        body = stmt.body
        if not isinstance(body, tirx.BufferStore):
            continue
        value = rewrite_expr(body.value, False)
        if value is None:
            continue
        if bind is None:
            bind = "bfloat16" not in func.script()
        if bind:
            value = rewrite_expr(body.value, True)
        new_block = s_tir.SBlock(
            stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint,
            tirx.BufferStore(body.buffer, value, body.indices),
            stmt.init, stmt.alloc_buffers, stmt.match_buffers, stmt.annotations,
        )
        sch.state.replace(sch.get_sref(block), new_block, {stmt: new_block})
        changed = True
    return sch.mod["main"] if changed else func

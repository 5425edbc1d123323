"""torch.special's orthogonal polynomials of x and a degree tensor n, as ATen's Math.h
evaluates them: Chebyshev T, U, V, W and their shifted forms, Hermite H and He, Laguerre L,
Legendre P.

Each is a kernel with a loop per element: the degree is data, so the number of steps of the
three-term recurrence is known only when the program runs. First, in torch's order, the cases
that return early (n < 0 gives 0, the values at the ends of the interval, a closed form in
cos/sin of acos(x) for a large degree inside it, n == 0 and n == 1), then the recurrence from
P0 = 1 and P1, stopping at NaN where torch's does. n is truncated to an integer as C's cast
does; a floating result only (torch promotes integer arguments to float). At x = NaN the
result is NaN; torch's U, W, L and P return an uninitialized value there (1.0 in its build).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tvm import relax, tirx
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter
from tvm.script import tirx as T

from relay_passes import OPAQUE

from .converters_integer_power import call_elementwise
from .converters_nn import as_dtype, operand, result_dtype

Expr = Any  # a TIR expression (PrimExpr), built with tvm.tirx


@dataclass(frozen=True)
class Recurrence:
    """One polynomial: its early cases and its recurrence (k from `start` by `stride` while
    `runs(k, n)`; next = `step(k, x, p, q)` from the two before, p then q)."""

    cases: Callable[[Expr, Expr, Callable], list[tuple[Expr, Expr]]]  # (x, n, const) -> [(cond, value)]
    first: Callable[[Expr, Callable], Expr]  # P1(x)
    start: int
    runs: Callable[[Expr, Expr], Expr]
    step: Callable[[Expr, Expr, Expr, Expr, Callable], Expr]  # (k as a float, x, p, q, const)
    stride: int = 1
    stops_at_nan: bool = True


def _even(n: Expr) -> Expr:
    return tirx.EQ(tirx.floormod(n, tirx.const(2, "int64")), tirx.const(0, "int64"))


def _as(n: Expr, c: functools.partial) -> Expr:
    """An int64 count as the kernel's float (`c`: tirx.const in that dtype)."""
    return tirx.Cast(c.keywords["dtype"], n)


def _ends(at_one: Callable, at_minus_one: Callable, shifted: bool) -> Callable:
    """The case at the ends of the interval: |x| == 1 (x == 1 / x == 0 for a shifted one)."""
    def case(x: Expr, n: Expr, c: Callable) -> tuple[Expr, Expr]:
        top = tirx.EQ(x, c(1.0))
        bottom = tirx.EQ(x, c(0.0)) if shifted else tirx.EQ(x, c(-1.0))
        return tirx.Or(top, bottom), tirx.Select(top, at_one(n, c), at_minus_one(n, c))
    return case


def _sign_by_parity(value: Callable) -> Callable:
    return lambda n, c: tirx.Select(_even(n), value(n, c), -value(n, c))


_ONE = lambda n, c: c(1.0)  # noqa: E731
_N_PLUS_ONE = lambda n, c: _as(n + 1, c)  # noqa: E731
_TWO_N_PLUS_ONE = lambda n, c: _as(n + n + 1, c)  # noqa: E731


def _chebyshev(first: Callable, ends: Callable, closed: Callable, above: int, shifted: bool = False) -> Recurrence:
    """T, U, V, W (shifted: of y = 2x - 1): r = 2y q - p from k = 2 while k <= n; for n > `above`
    and |y| < 1 the closed form `closed(y, n, c)`."""
    def y_of(x: Expr, c: Callable) -> Expr:
        return x + x - c(1.0) if shifted else x

    def cases(x: Expr, n: Expr, c: Callable) -> list[tuple[Expr, Expr]]:
        y = y_of(x, c)
        inside = tirx.And(tirx.GT(n, tirx.const(above, "int64")), tirx.LT(tirx.abs(y), c(1.0)))
        return [ends(x, n, c), (inside, closed(y, n, c))]

    return Recurrence(cases, lambda x, c: first(y_of(x, c), c), 2, lambda k, n: tirx.LE(k, n),
                      lambda k, x, p, q, c: (y_of(x, c) + y_of(x, c)) * q - p)


def _closed_t(y: Expr, n: Expr, c: Callable) -> Expr:
    return tirx.cos(_as(n, c) * tirx.acos(y))


def _closed_u(y: Expr, n: Expr, c: Callable) -> Expr:
    angle = tirx.acos(y)
    return tirx.Select(tirx.NE(tirx.sin(angle), c(0.0)), tirx.sin(_as(n + 1, c) * angle) / tirx.sin(angle),
                       _as(n + 1, c) * tirx.cos(_as(n + 1, c) * angle) / y)


def _closed_v(y: Expr, n: Expr, c: Callable) -> Expr:
    angle = tirx.acos(y)
    return tirx.Select(tirx.NE(tirx.sin(angle / c(2.0)), c(1.0)),
                       tirx.cos((_as(n, c) + c(0.5)) * angle) / tirx.cos(angle / c(2.0)),
                       _sign_by_parity(_TWO_N_PLUS_ONE)(n, c))


def _closed_w(edge: Callable) -> Callable:
    def closed(y: Expr, n: Expr, c: Callable) -> Expr:
        angle = tirx.acos(y)
        return tirx.Select(tirx.NE(tirx.cos(angle / c(2.0)), c(1.0)),
                           tirx.sin((_as(n, c) + c(0.5)) * angle) / tirx.sin(angle / c(2.0)), edge(y, n, c))
    return closed


def _hermite(first: Callable, step: Callable, start: int, stride: int, runs: Callable) -> Recurrence:
    """H and He: NaN above torch's degree limit (128 in float32, 512 in float64)."""
    def cases(x: Expr, n: Expr, c: Callable) -> list[tuple[Expr, Expr]]:
        limit = 128 if c.keywords["dtype"] == "float32" else 512
        return [(tirx.GT(n, tirx.const(limit, "int64")), c(float("nan")))]
    return Recurrence(cases, first, start, runs, step, stride, stops_at_nan=False)


POLYNOMIALS: dict[str, Recurrence] = {
    "chebyshev_polynomial_t": _chebyshev(
        lambda y, c: y, _ends(_ONE, _sign_by_parity(_ONE), False), _closed_t, 6),
    "chebyshev_polynomial_u": _chebyshev(
        lambda y, c: y + y, _ends(_N_PLUS_ONE, _sign_by_parity(_N_PLUS_ONE), False), _closed_u, 8),
    "chebyshev_polynomial_v": _chebyshev(
        lambda y, c: y + y - c(1.0), _ends(_ONE, _sign_by_parity(_TWO_N_PLUS_ONE), False), _closed_v, 8),
    "chebyshev_polynomial_w": _chebyshev(
        lambda y, c: y + y + c(1.0), _ends(_TWO_N_PLUS_ONE, _sign_by_parity(_ONE), False),
        _closed_w(lambda y, n, c: tirx.Select(tirx.GT(y, c(0.0)), _TWO_N_PLUS_ONE(n, c),
                                              _sign_by_parity(_ONE)(n, c))), 8),
    "shifted_chebyshev_polynomial_t": _chebyshev(
        lambda y, c: y, _ends(_ONE, _sign_by_parity(_ONE), True), _closed_t, 6, shifted=True),
    "shifted_chebyshev_polynomial_u": _chebyshev(
        lambda y, c: y + y, _ends(_N_PLUS_ONE, _sign_by_parity(_N_PLUS_ONE), True), _closed_u, 6, shifted=True),
    "shifted_chebyshev_polynomial_v": _chebyshev(
        lambda y, c: y + y - c(1.0), _ends(_ONE, _sign_by_parity(_TWO_N_PLUS_ONE), True), _closed_v, 6,
        shifted=True),
    "shifted_chebyshev_polynomial_w": _chebyshev(
        lambda y, c: y + y + c(1.0), _ends(_TWO_N_PLUS_ONE, _sign_by_parity(_ONE), True),
        _closed_w(lambda y, n, c: _sign_by_parity(_ONE)(n, c)), 4, shifted=True),
    "hermite_polynomial_h": _hermite(
        lambda x, c: x + x, lambda k, x, p, q, c: (x + x) * q - k * p, 2, 2, lambda k, n: tirx.LT(k, n + n)),
    "hermite_polynomial_he": _hermite(
        lambda x, c: x, lambda k, x, p, q, c: x * q - k * p, 1, 1, lambda k, n: tirx.LT(k, n)),
    "laguerre_polynomial_l": Recurrence(
        lambda x, n, c: [(tirx.EQ(tirx.abs(x), c(0.0)), c(1.0))], lambda x, c: c(1.0) - x, 1,
        lambda k, n: tirx.LT(k, n), lambda k, x, p, q, c: ((k + k + (c(1.0) - x)) * q - k * p) / (k + c(1.0))),
    "legendre_polynomial_p": Recurrence(
        lambda x, n, c: [_ends(_ONE, _sign_by_parity(_ONE), False)(x, n, c)], lambda x, c: x, 1,
        lambda k, n: tirx.LT(k, n), lambda k, x, p, q, c: ((k + k + c(1.0)) * x * q - k * p) / (k + c(1.0))),
}


def _kernel(poly: Recurrence, dtype: str) -> tirx.PrimFunc:
    """(x[m], n[m]) -> P_n(x) elementwise, a recurrence loop per element. Marked scheduled: the
    loops depend on the values, which no schedule rule handles."""
    c = functools.partial(tirx.const, dtype=dtype)
    zero, one = tirx.const(0, "int64"), tirx.const(1, "int64")

    def cases(x: Expr, n: Expr) -> list[tuple[Expr, Expr]]:  # torch's order
        return [(tirx.LT(n, zero), c(0.0)), *poly.cases(x, n, c),
                (tirx.EQ(n, zero), c(1.0)), (tirx.EQ(n, one), poly.first(x, c))]

    def exits(x: Expr, n: Expr) -> Expr:
        return functools.reduce(tirx.Or, [cond for cond, _ in cases(x, n)])

    def value(x: Expr, n: Expr) -> Expr:
        found = cases(x, n)
        result = found[-1][1]
        for cond, then in reversed(found[:-1]):
            result = tirx.Select(cond, then, result)
        return result

    def keep_going(k: Expr, n: Expr, q: Expr) -> Expr:
        runs = poly.runs(k, n)
        return tirx.And(runs, tirx.Not(tirx.isnan(q))) if poly.stops_at_nan else runs

    def step(k: Expr, x: Expr, p: Expr, q: Expr) -> Expr:
        return poly.step(tirx.Cast(dtype, k), x, p, q, c)

    first, start, stride = poly.first, tirx.const(poly.start, "int64"), tirx.const(poly.stride, "int64")

    @T.prim_func(private=True, s_tir=True)
    def polynomial(a: T.handle, b: T.handle, d: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True, "op_pattern": OPAQUE})
        m = T.int64()
        xs = T.match_buffer(a, (m,), dtype)
        ns = T.match_buffer(b, (m,), dtype)
        out = T.match_buffer(d, (m,), dtype)
        with T.sblock("root"):
            for i in range(m):
                with T.sblock("polynomial"):
                    v = T.axis.spatial(m, i)
                    T.reads(xs[v], ns[v])
                    T.writes(out[v])
                    x: T.let = xs[v]
                    n: T.let = T.Cast("int64", ns[v])
                    pq = T.sblock_alloc_buffer((3,), dtype, scope="local")  # p, q, the next
                    k = T.sblock_alloc_buffer((1,), "int64", scope="local")
                    if exits(x, n):
                        out[v] = value(x, n)
                    else:
                        pq[0] = c(1.0)
                        pq[1] = first(x, c)
                        pq[2] = pq[1]
                        k[0] = start
                        while keep_going(k[0], n, pq[1]):
                            pq[2] = step(k[0], x, pq[0], pq[1])
                            pq[0] = pq[1]
                            pq[1] = pq[2]
                            k[0] = k[0] + stride
                        out[v] = pq[2]

    return polynomial


def polynomial(name: str):
    """The converter of torch.special.`name` (x and n tensors, or one a number)."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        dtype = result_dtype(node)
        if dtype not in ("float32", "float64"):
            raise NotImplementedError(f"{name} in {dtype}: compute it in float32 (x.float())")
        bb = importer.block_builder
        x, n = (as_dtype(bb, operand(importer, value, dtype), dtype) for value in node.args[:2])
        return call_elementwise(bb, _kernel(POLYNOMIALS[name], dtype), name, name, x, n)

    return convert


CONVERTERS = {f"special_{name}.{overload}": polynomial(name) for name in POLYNOMIALS
              for overload in ("default", "x_scalar", "n_scalar")}

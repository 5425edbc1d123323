"""Elementwise math functions (tvmgraph/converters_special.py, gradients/elementwise.py) against
torch eager: forward in float32 and float64 over their domains (special values included), and
gradients against torch.autograd.

Many ops share one graph: each compile costs seconds, one per op would cost minutes.
Tolerances: float32 as conftest; float64 1e-9 relative (the kernels compute in float64 to
~1e-14) except where torch's own float64 kernels are less accurate (noted at the op).
Gradients: one SGD step with lr=1 moves each parameter by minus the gradient of
sum(op(x) * w).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from tests.conftest import ModuleGraph, SGDStep

S = torch.special
INF, NAN = math.inf, math.nan


def grid(low: float, high: float, extra: tuple[float, ...] = (), count: int = 97) -> torch.Tensor:
    return torch.cat([torch.linspace(low, high, count, dtype=torch.float64), torch.tensor(extra, dtype=torch.float64)])


REAL = grid(-30, 30, (0.0, -0.0, 1e-8, -1e-8, 0.5, 1.0, 2.0, 9.0, 20.0, 25.0, 26.0, 100.0, 700.0, -700.0,
                      -3.0, -2.5, INF, -INF, NAN))
POSITIVE = grid(1e-6, 40, (0.0, -1.0, 8.999, 9.0, 9.001, 700.0, INF, NAN))
UNIT = grid(-1, 1, (0.999999, -0.9999999, 1e-10, 1.5, NAN))
# trigamma's poles: torch returns pi^2 / sin(pi x)^2 of sin's rounding error there, which depends
# on the dtype sin is computed in (float64 here)
OFF_POLES = REAL[(REAL > 0) | (REAL != REAL.floor())]
# (below 4e-9 ndtri's first guess is the tail's asymptotic iteration: Giles' polynomial made
# ndtri(1e-20) -7.8 for -9.3, ndtri(1e-30) NaN)
PROBABILITY = grid(0, 1, (1e-10, 1e-15, 1e-18, 1e-20, 1e-25, 1e-30, 1e-37, 1e-300, 0.999999, 0.5, NAN))

# name: (function, inputs, float64 tolerance override)
UNARY: dict[str, tuple[Callable, torch.Tensor, dict]] = {
    "cosh": (torch.cosh, REAL, {}),
    "sinh": (torch.sinh, REAL, {}),
    "exp2": (torch.exp2, REAL, {}),
    "erfc": (torch.erfc, REAL, {}),
    "erfcx": (S.erfcx, REAL, {}),
    "log_ndtr": (S.log_ndtr, REAL, {}),
    "erfinv": (torch.erfinv, UNIT, {}),
    "ndtri": (S.ndtri, PROBABILITY, {}),
    "lgamma": (torch.lgamma, REAL, {}),
    "mvlgamma": (lambda x: torch.mvlgamma(x, 3), grid(1.01, 30), {}),
    "digamma": (torch.digamma, REAL, {}),
    # torch's trigamma is a short series: ~5e-10 relative
    "polygamma1": (lambda x: torch.polygamma(1, x), OFF_POLES, dict(rtol=1e-8)),
    "polygamma2": (lambda x: torch.polygamma(2, x), REAL, {}),
    "polygamma3": (lambda x: torch.polygamma(3, x), REAL, {}),
    "i0": (torch.i0, REAL, {}),
    "i0e": (S.i0e, REAL, {}),
    "i1": (S.i1, REAL, {}),
    "i1e": (S.i1e, REAL, {}),
    "modified_bessel_i0": (S.modified_bessel_i0, REAL, {}),
    "modified_bessel_i1": (S.modified_bessel_i1, REAL, {}),
    # the series meets the asymptotic expansion at x = 9, where both are good to ~1e-8
    "modified_bessel_k0": (S.modified_bessel_k0, POSITIVE, dict(rtol=1e-7)),
    "modified_bessel_k1": (S.modified_bessel_k1, POSITIVE, dict(rtol=1e-7)),
    "scaled_modified_bessel_k0": (S.scaled_modified_bessel_k0, POSITIVE, dict(rtol=1e-7)),
    "scaled_modified_bessel_k1": (S.scaled_modified_bessel_k1, POSITIVE, dict(rtol=1e-7)),
    # torch's float64 J and Y are off by up to ~5e-7 near their zeros (libm's, used here, agree
    # with mpmath to 1e-16)
    "bessel_j0": (S.bessel_j0, REAL, dict(atol=1e-6)),
    "bessel_j1": (S.bessel_j1, REAL, dict(atol=1e-6)),
    "bessel_y0": (S.bessel_y0, POSITIVE, dict(atol=1e-6)),
    "bessel_y1": (S.bessel_y1, POSITIVE, dict(atol=1e-6)),
    "spherical_bessel_j0": (S.spherical_bessel_j0, REAL, {}),
    "angle": (torch.angle, REAL, {}),
    "signbit": (torch.signbit, REAL, {}),
    "frexp": (torch.frexp, REAL, {}),
}

LEFT = torch.tensor([[-8.5, -1.0, -0.0, 0.0, 0.5, 3.0, 7.25, NAN, INF, 2.0]], dtype=torch.float64)
RIGHT = torch.tensor([[3.5], [-2.0], [0.0], [NAN]], dtype=torch.float64)
BINARY: dict[str, tuple[Callable, torch.Tensor, torch.Tensor]] = {
    "hypot": (torch.hypot, LEFT, RIGHT),
    "fmax": (torch.fmax, LEFT, RIGHT),
    "fmin": (torch.fmin, LEFT, RIGHT),
    "copysign": (torch.copysign, LEFT, RIGHT),
    "ldexp": (torch.ldexp, LEFT, torch.tensor([[3.0], [-2.0], [0.0], [10.0]], dtype=torch.float64)),
    "nextafter": (torch.nextafter, LEFT, RIGHT),
    "heaviside": (torch.heaviside, LEFT, RIGHT),
    "zeta": (S.zeta, torch.tensor([[1.0, 1.5, 2.0, 3.0, 4.5, 0.5, 7.0]], dtype=torch.float64),
             torch.tensor([[0.25], [1.0], [3.5], [-2.5], [-2.0], [40.0]], dtype=torch.float64)),
}


class Apply(nn.Module):
    """functions[k] of the next arity[k] inputs, for every k."""

    def __init__(self, functions: list[Callable], arity: list[int]):
        super().__init__()
        self.functions, self.arity = functions, arity

    def forward(self, *inputs: torch.Tensor):
        it = iter(inputs)
        return tuple(f(*(next(it) for _ in range(n))) for f, n in zip(self.functions, self.arity))


def _run(functions: list[Callable], arguments: list[tuple[torch.Tensor, ...]]) -> list:
    module = Apply(functions, [len(a) for a in arguments])
    return list(ModuleGraph(module)(*(x for a in arguments for x in a)))


def _check(name: str, actual, expected, tolerance: dict) -> None:
    for a, e in zip(actual if isinstance(actual, tuple) else (actual,),
                    expected if isinstance(expected, tuple) else (expected,)):
        assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != {e.dtype}"
        if not e.is_floating_point():
            assert torch.equal(a, e), f"{name}: {a} != {e}"
            continue
        torch.testing.assert_close(a, e, equal_nan=True, msg=lambda m: f"{name}: {m}", **tolerance)


DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float64, id="float64")]


def _tolerance(dtype: torch.dtype, override: dict) -> dict:
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-4)
    return {**dict(atol=1e-9, rtol=1e-9), **override}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_unary_forward_matches_eager(dtype: torch.dtype) -> None:
    names = list(UNARY)
    arguments = [(UNARY[n][1].to(dtype),) for n in names]
    actual = _run([UNARY[n][0] for n in names], arguments)
    for name, (x,), out in zip(names, arguments, actual):
        fn, _, override = UNARY[name]
        _check(name, out, fn(x), _tolerance(dtype, override))


@pytest.mark.parametrize("dtype", DTYPES)
def test_binary_forward_matches_eager(dtype: torch.dtype) -> None:
    names = list(BINARY)
    arguments = [(BINARY[n][1].to(dtype), BINARY[n][2].to(dtype)) for n in names]
    actual = _run([BINARY[n][0] for n in names], arguments)
    for name, args, out in zip(names, arguments, actual):
        _check(name, out, BINARY[name][0](*args), _tolerance(dtype, {}))


def test_integer_inputs_match_eager() -> None:
    """Integer inputs: promoted to float (erfc, i0, angle), or kept (signbit's bool, fmax's int64)."""
    x = torch.arange(-4, 5)
    functions = [torch.erfc, torch.i0, torch.angle, torch.signbit, lambda v: torch.fmax(v, -v.flip(0)),
                 lambda v: torch.heaviside(v, v.flip(0))]
    actual = _run(functions, [(x,)] * len(functions))
    for k, (fn, out) in enumerate(zip(functions, actual)):
        _check(f"function {k}", out, fn(x), dict(atol=1e-5, rtol=1e-4))


# ---- gradients ----

def _normal(shape, low=-2.0, high=2.0):
    return torch.rand(shape, dtype=torch.float64) * (high - low) + low


# name: (function of the parameters, their initial values)
GRADIENTS: dict[str, tuple[Callable, tuple[torch.Tensor, ...]]] = {
    "cosh": (torch.cosh, (_normal(7),)),
    "sinh": (torch.sinh, (_normal(7),)),
    "exp2": (torch.exp2, (_normal(7),)),
    "erfc": (torch.erfc, (_normal(7),)),
    "erfcx": (S.erfcx, (_normal(7, -3, 30),)),
    "log_ndtr": (S.log_ndtr, (_normal(7, -5, 5),)),
    "erfinv": (torch.erfinv, (_normal(7, -0.99, 0.99),)),
    "ndtri": (S.ndtri, (_normal(7, 0.01, 0.99),)),
    "lgamma": (torch.lgamma, (_normal(7, -3.9, 5),)),
    "digamma": (torch.digamma, (_normal(7, -3.9, 5),)),
    "polygamma2": (lambda x: torch.polygamma(2, x), (_normal(7, -3.9, 5),)),
    "i0": (torch.i0, (_normal(7, -25, 25),)),
    "i0e": (S.i0e, (_normal(7, -25, 25),)),
    "i1": (S.i1, (torch.tensor([0.0, -3.0, 0.5, 21.0, -24.0], dtype=torch.float64),)),
    "i1e": (S.i1e, (torch.tensor([0.0, -3.0, 0.5, 21.0, -24.0], dtype=torch.float64),)),
    "angle": (torch.angle, (_normal(7),)),
    "frexp": (lambda x: torch.frexp(x)[0], (_normal(7, -20, 20),)),
    "acos": (torch.acos, (_normal(7, -0.9, 0.9),)),
    "asin": (torch.asin, (_normal(7, -0.9, 0.9),)),
    "atan": (torch.atan, (_normal(7),)),
    "acosh": (torch.acosh, (_normal(7, 1.1, 5),)),
    "asinh": (torch.asinh, (_normal(7),)),
    "atanh": (torch.atanh, (_normal(7, -0.9, 0.9),)),
    "tan": (torch.tan, (_normal(7, -1.2, 1.2),)),
    "mvlgamma": (lambda x: torch.mvlgamma(x, 2), (_normal(7, 1.5, 6),)),
    # binary ops, the second argument broadcast along the first axis
    "hypot": (torch.hypot, (_normal((3, 4)), _normal((1, 4)))),
    "fmax": (torch.fmax, (_normal((3, 4)), _normal((1, 4)))),
    "fmin": (torch.fmin, (_normal((3, 4)), _normal((1, 4)))),
    "copysign": (torch.copysign, (_normal((3, 4)), _normal((1, 4)))),
    "ldexp": (torch.ldexp, (_normal((3, 4)), _normal((1, 4)))),
    "atan2": (torch.atan2, (_normal((3, 4)), _normal((1, 4)))),
    "fmod": (torch.fmod, (_normal((3, 4), -5, 5), _normal((1, 4), 0.5, 2))),
    "remainder": (torch.remainder, (_normal((3, 4), -5, 5), _normal((1, 4), 0.5, 2))),
}


class Losses(nn.Module):
    """sum_k sum(f_k(params_k) * w_k), every input a parameter."""

    def __init__(self, cases: dict[str, tuple[Callable, tuple[torch.Tensor, ...]]], dtype: torch.dtype):
        super().__init__()
        self.functions = [fn for fn, _ in cases.values()]
        self.params = nn.ParameterList([nn.Parameter(x.to(dtype).clone()) for _, xs in cases.values() for x in xs])
        self.arity = [len(xs) for _, xs in cases.values()]

    def losses(self, weights: list[torch.Tensor]) -> torch.Tensor:
        params = iter(self.params)
        total = 0
        for fn, arity, w in zip(self.functions, self.arity, weights):
            total = total + (fn(*(next(params) for _ in range(arity))) * w).sum()
        return total

    def forward(self, *weights: torch.Tensor) -> torch.Tensor:
        return self.losses(list(weights))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_autograd(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = Losses(GRADIENTS, dtype)
    weights = []
    params = iter(model.params)
    for fn, arity in zip(model.functions, model.arity):
        weights.append(torch.randn_like(fn(*(next(params).detach() for _ in range(arity)))))
    before = [p.detach().clone() for p in model.params]
    expected = torch.autograd.grad(model.losses(weights), list(model.params))
    SGDStep(model)(*weights)
    tolerance = dict(atol=1e-4, rtol=1e-3) if dtype == torch.float32 else dict(atol=1e-9, rtol=1e-8)
    names = [name for name, (_, xs) in GRADIENTS.items() for _ in xs]
    for name, b, p, e in zip(names, before, model.params, expected):
        torch.testing.assert_close(b - p.detach(), e, msg=lambda m: f"{name}: {m}", **tolerance)


def test_fast_ops() -> None:
    """cosh, sinh (LLVM has no intrinsic), heaviside (dtype mix) forward, and acos's gradient:
    one small graph each, for the fast suite."""
    x = torch.tensor([-3.0, -0.25, 0.0, 0.5, 2.0])
    actual = _run([torch.cosh, torch.sinh, torch.heaviside], [(x,), (x,), (x, x.flip(0))])
    for out, expected in zip(actual, [torch.cosh(x), torch.sinh(x), torch.heaviside(x, x.flip(0))]):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    model = Losses({"acos": GRADIENTS["acos"]}, torch.float32)
    w = torch.randn(7)
    before = model.params[0].detach().clone()
    expected, = torch.autograd.grad(model.losses([w]), list(model.params))
    SGDStep(model)(w)
    torch.testing.assert_close(before - model.params[0].detach(), expected, atol=1e-4, rtol=1e-3)


SMALL = [1e-20, -1e-8, 3e-6, -1e-6, 1e-4, -3e-5, 0.2, -0.25, 0.4, -0.3, 0.5, -0.5, 2.0, -2.0, 30.0]
NEAR_ZERO_OPS = {
    "log1p": torch.log1p,
    "expm1": torch.expm1,
    "softplus": lambda x: torch.nn.functional.softplus(x * 40),  # small values at -16..-25
    "logsigmoid": lambda x: torch.nn.functional.logsigmoid(x * 40),
    "elu": torch.nn.functional.elu,
    "selu": torch.nn.functional.selu,
    "celu": lambda x: torch.nn.functional.celu(x, 2.0),
    "mish": lambda x: torch.nn.functional.mish(x * -40),
    "xlog1py": lambda x: torch.special.xlog1py(x + 3, x),
    "atanh": lambda x: torch.atanh(x.clamp(-0.9, 0.9)),  # near 1 its condition (20 at 0.99) sets the error
    "tanh": torch.tanh,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", NEAR_ZERO_OPS)
def test_log1p_expm1_and_their_users_keep_the_digits_of_small_values(name: str, dtype: torch.dtype) -> None:
    """log(1 + x) and exp(x) - 1 (the stock converters, TOPI's softplus) lost a small x to the
    rounding of 1 + x: log1p(1e-8) was 0, expm1(-1e-6) -1.0133e-6, softplus(-16) 1.19e-7 for
    1.125e-7, ELU of -1e-20 0; atanh(1e-30) was 0, and float64 tanh(1e-30) (TVM's formulas).
    Each value within a few ulps of float64's (tvmgraph/log1p_expm1.py, legalize_fixes.py;
    float32: the fast exp's 3e-7 included)."""
    fn = NEAR_ZERO_OPS[name]
    x = torch.tensor(SMALL, dtype=dtype)
    actual = ModuleGraph(_Fn(fn))(x)
    exact = fn(x.to(torch.float64))  # for float64 inputs, eager's own value (libm's log1p, expm1)
    rtol = 6e-7 if dtype == torch.float32 else 4e-15
    torch.testing.assert_close(actual.double(), exact.double(), atol=0, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("fn", [torch.log1p, torch.expm1], ids=["log1p", "expm1"])
def test_log1p_and_expm1_gradients_match_autograd(fn) -> None:
    """One SGD step with lr 1 moves each weight by minus its gradient: 1 / (1 + x), exp(x)."""
    w = torch.tensor(SMALL[:-1])
    model = _Weighted(w.clone(), fn)
    SGDStep(model)(torch.ones(()))
    leaf = w.clone().requires_grad_()
    fn(leaf).sum().backward()
    torch.testing.assert_close(w - model.w.detach(), leaf.grad, atol=0, rtol=6e-7)  # exp: the fast exp's 3e-7


class _Fn(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class _Weighted(nn.Module):
    def __init__(self, w: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.w, self.fn = nn.Parameter(w), fn

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return (self.fn(self.w) * scale).sum()

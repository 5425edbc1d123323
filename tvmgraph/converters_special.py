"""Converters for elementwise math functions that TVM 0.27 cannot lower: special functions (gamma
family, error functions, Bessel functions, zeta), floating-point helpers (hypot, fmax, copysign,
nextafter, frexp, ...) and the hyperbolic functions, whose TIR intrinsics LLVM lacks.

Each function is a TE kernel (`Elementwise`): its value is a TIR expression evaluated in
float64 whatever the tensor's dtype (float32 inputs then get float64 accuracy, cast back), and,
for the differentiable ones, its partial derivatives, which become the kernel's TE gradient
(`call_tir_with_grad`, registered under `tvmgraph.special.<name>`). Functions that libm and
CUDA's libdevice both provide in double precision (erfc, lgamma, the Bessel functions j0, j1, y0,
y1) are extern calls; the others are written here from their series, asymptotic expansions and
recurrences (accurate to ~1e-14 relative in float64 over the ranges noted at each function).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import tvm
from tvm import relax, te
from tvm import tirx as tir
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from .converters_nn import result_dtype

F64 = "float64"
Expr = tir.Expr


def _c(value: float) -> Expr:
    return tir.const(value, F64)


def _where(cond: Expr, then: Expr, otherwise: Expr) -> Expr:
    return tir.Select(cond, then, otherwise)


def _extern(name: str, x: Expr) -> Expr:
    """A double-precision libm / libdevice function (the same name on CPU and CUDA)."""
    return tir.call_pure_extern(F64, name, x)


def _poly(x: Expr, coefficients: Sequence[float]) -> Expr:
    """sum(c_k x^k), by Horner's rule."""
    acc = _c(coefficients[-1])
    for c in reversed(coefficients[:-1]):
        acc = acc * x + _c(c)
    return acc


NAN, INF = math.nan, math.inf
SQRT_PI = math.sqrt(math.pi)
EULER_GAMMA = 0.57721566490153286061


# ---- hyperbolic functions (LLVM has no intrinsic for tirx.cosh / tirx.sinh) ----

def cosh(x: Expr) -> Expr:
    # exp(|x| - ln 2) stays finite up to cosh's own overflow (exp(|x|) / 2 would overflow first).
    a = tir.abs(x)
    return tir.exp(a - _c(math.log(2.0))) + tir.exp(-a) * _c(0.5)


def sinh(x: Expr) -> Expr:
    a = tir.abs(x)
    large = tir.exp(a - _c(math.log(2.0))) - tir.exp(-a) * _c(0.5)
    small = a * _poly(a * a, [1.0 / math.factorial(2 * k + 1) for k in range(7)])  # |x| < 0.5: no cancellation
    return tir.copysign(_where(a < _c(0.5), small, large), x)


# ---- error function family ----

def erfc(x: Expr) -> Expr:
    return _extern("erfc", x)


def erfcx(x: Expr) -> Expr:
    """exp(x^2) erfc(x); above x = 25 (where exp(x^2) nears overflow) the asymptotic series
    1/(x sqrt(pi)) sum (-1)^k (2k-1)!! / (2x^2)^k, whose 8th term is below 1e-20 there."""
    inv2 = _c(1.0) / (_c(2.0) * x * x)
    series = _poly(inv2, [(-1) ** k * math.prod(range(1, 2 * k, 2)) for k in range(8)])
    return _where(x < _c(25.0), tir.exp(x * x) * erfc(x), series / (x * _c(SQRT_PI)))


# erfinv and ndtri solve erf(y) = a for y >= 0, with a = 1 - c in [0, 1] given with c (exact,
# as erfc inverses need): Giles' single-precision approximation ("Approximating the erfinv
# function", GPU Gems 9, 2010; 1e-7 to 1e-4 relative), then one Halley step (cubic) on a form
# without cancellation: erf(y) = a below a = 1/2, log(erfc(y)) = log(c) above. One step only:
# kernels are inlined into one expression, where a step copies the previous one into its ~20 uses.
NEWTON_STEPS = 1


def log_ndtr(x: Expr) -> Expr:
    """log of the standard normal CDF; through erfcx in the lower tail, where the CDF underflows."""
    t = x * _c(1.0 / math.sqrt(2.0))
    return _where(x < _c(-1.0), tir.log(erfcx(-t) * _c(0.5)) - x * x * _c(0.5),
                  tir.log1p(erfc(t) * _c(-0.5)))


def _erf_inverse_guess(a: Expr, c: Expr) -> Expr:
    w = -tir.log(c * (_c(1.0) + a))
    central = _poly(w - _c(2.5), [1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087,
                                  -4.39150654e-06, -3.5233877e-06, 3.43273939e-07, 2.81022636e-08])
    tail = _poly(tir.sqrt(w) - _c(3.0), [2.83297682, 1.00167406, 0.00943887047, -0.0076224613, 0.00573950773,
                                         -0.00367342844, 0.00134934322, 0.000100950558, -0.000200214257])
    # Giles' tail fits erfinv's float32 range (w < ~17; its relative error 1e-6 at w = 17, 0.3
    # at w = 40, 40 at w = 86: ndtri(1e-20) was -7.8 for -9.3, ndtri(1e-30) NaN). Beyond w = 18
    # (ndtri below p = 4e-9), iterate y^2 = t - log(y) + log(1 - 1/(2y^2)), t = -log(c sqrt(pi)),
    # from erfc(y) ~ exp(-y^2) / (y sqrt(pi)) (1 - 1/(2y^2)): 1e-5 there, 1e-6 at w = 86.
    t = tir.Max(-tir.log(c * _c(SQRT_PI)), _c(2.0))
    far = tir.sqrt(t)
    for _ in range(3):
        far = tir.sqrt(t - tir.log(far) + tir.log(_c(1.0) - _c(0.5) / (far * far)))
    return _where(w < _c(5.0), central * a, _where(w < _c(18.0), tail * a, far))


def _erf_inverse_step(y: Expr, a: Expr, c: Expr) -> Expr:
    """One Halley step y - u / (1 - u f'' / (2 f')), u = f / f'."""
    u = (tir.erf(y) - a) / (_c(2.0 / SQRT_PI) * tir.exp(-y * y))  # f'' / f' = -2y
    near_zero = y - u / (_c(1.0) + y * u)
    scaled = erfcx(y)  # f = log(erfc(y) / c), f' = -2 / (sqrt(pi) erfcx(y)), f'' / f' = -(2y + f')
    v = -(tir.log(scaled) - y * y - tir.log(c)) * scaled * _c(SQRT_PI / 2.0)
    near_one = y - v / (_c(1.0) + v * (y - _c(1.0 / SQRT_PI) / scaled))
    return _where(a < _c(0.5), near_zero, near_one)


def _erf_inverse_edges(y: Expr, a: Expr, c: Expr) -> Expr:
    return _where(c == _c(0.0), _c(INF), _where(a == _c(0.0), _c(0.0), y))


def _erfinv_parts(x: Expr) -> tuple[Expr, Expr]:
    a = tir.abs(x)
    return a, _c(1.0) - a


def _ndtri_parts(p: Expr) -> tuple[Expr, Expr]:
    """ndtri(p) = -sqrt(2) erfcinv(2p) below p = 1/2 (2p exact), sqrt(2) erfinv(2p - 1) above
    (2p - 1 exact)."""
    low = p < _c(0.5)
    return (_where(low, _c(1.0) - _c(2.0) * p, _c(2.0) * p - _c(1.0)),
            _where(low, _c(2.0) * p, _c(2.0) - _c(2.0) * p))


def erfinv_finish(y: Expr, x: Expr) -> Expr:
    a, c = _erfinv_parts(x)
    return _where(a > _c(1.0), _c(NAN), tir.copysign(_erf_inverse_edges(y, a, c), x))


def ndtri_finish(y: Expr, p: Expr) -> Expr:
    a, c = _ndtri_parts(p)
    z = _erf_inverse_edges(y, a, c) * _c(math.sqrt(2.0))
    return _where(tir.any(p < _c(0.0), p > _c(1.0)), _c(NAN),
                  _where(p == _c(0.0), _c(-INF), _where(p < _c(0.5), -z, z)))


# ---- gamma function family ----

def lgamma(x: Expr) -> Expr:
    return _extern("lgamma", x)


# (2k)! / B_2k, the Euler-Maclaurin coefficients of the Hurwitz zeta function (as in Cephes).
def _bernoulli(count: int) -> list[Fraction]:
    b = [Fraction(1)]
    for m in range(1, count):
        b.append(-sum(math.comb(m + 1, k) * b[k] for k in range(m)) / (m + 1))
    return b


_B = _bernoulli(26)
_ZETA_EM = [float(math.factorial(2 * k) / _B[2 * k]) for k in range(1, 13)]
_ZETA_SHIFT = 30  # terms summed directly before Euler-Maclaurin: q + 30 >= 9 for q >= -21


def _hurwitz_zeta(s: Expr, q: Expr) -> Expr:
    """zeta(s, q) = sum_k (q + k)^-s, by Cephes' scheme: the first terms summed, the tail by
    Euler-Maclaurin with 12 Bernoulli terms. Accurate while q + 30 >= 9 (q >= -21)."""
    total = _c(0.0)
    for k in range(_ZETA_SHIFT):
        total = total + tir.power(q + _c(float(k)), -s)
    w = q + _c(float(_ZETA_SHIFT))
    b = tir.power(w, -s)
    total = total + b * w / (s - _c(1.0)) + _c(0.5) * b  # Cephes adds the last direct term as b/2 too
    a, k = _c(1.0), 0.0
    for coefficient in _ZETA_EM:
        a = a * (s + _c(k))
        b = b / w
        total = total + a * b / _c(coefficient)
        a = a * (s + _c(k + 1.0))
        b = b / w
        k += 2.0
    return total


def zeta(s: Expr, q: Expr) -> Expr:
    """Cephes' (and torch's) order of special cases: s = 1, s < 1, q a pole, then (q^-s
    undefined) q <= 0 with s not an integer."""
    value = _hurwitz_zeta(s, q)
    q_pole = tir.all(q <= _c(0.0), q == tir.floor(q))
    undefined = tir.all(q <= _c(0.0), s != tir.floor(s))
    return _where(s == _c(1.0), _c(INF), _where(s < _c(1.0), _c(NAN), _where(
        q_pole, _c(INF), _where(undefined, _c(NAN), value))))


def digamma(x: Expr) -> Expr:
    """psi(x): 12 steps of psi(x) = psi(x + 1) - 1/x, then the asymptotic series at x + 12 >= 12
    (its last term below 1e-16); reflection psi(x) = psi(1 - x) - pi / tan(pi frac(x)) below 0."""
    z = _where(x < _c(0.0), _c(1.0) - x, x)
    shift = _c(0.0)
    for k in range(12):
        shift = shift + _c(1.0) / (z + _c(float(k)))
    w = z + _c(12.0)
    inv2 = _c(1.0) / (w * w)
    tail = _poly(inv2, [0.0] + [float(_B[2 * k] / (2 * k)) for k in range(1, 8)])
    value = tir.log(w) - _c(0.5) / w - tail - shift
    reflected = value - _c(math.pi) / tir.tan(_c(math.pi) * (x - tir.trunc(x)))
    result = _where(x < _c(0.0), reflected, value)
    pole = tir.all(x <= _c(0.0), x == tir.floor(x))
    return _where(x == _c(0.0), tir.copysign(_c(INF), -x), _where(pole, _c(NAN), result))


def _cot_derivative(n: int) -> list[int]:
    """Coefficients of P_n with d^n/dx^n cot(pi x) = pi^n P_n(cot(pi x)): P_0 = c and
    P_{k+1} = -(1 + c^2) P_k'."""
    p = [0, 1]
    for _ in range(n):
        derivative = [k * p[k] for k in range(1, len(p))] or [0]
        p = [0] * (len(derivative) + 2)
        for k, d in enumerate(derivative):
            p[k] -= d
            p[k + 2] -= d
    return p


def polygamma(x: Expr, n: int) -> Expr:
    """psi^(n)(x), as torch computes it: digamma for n = 0; trigamma by zeta(2, x), reflected
    below x = 1/2 as torch does (psi1(x) = pi^2 / sin^2(pi x) - psi1(1 - x)); (-1)^(n+1) n!
    zeta(n+1, x) above, reflected below x = 0 (psi^(n)(x) = (-1)^n psi^(n)(1 - x) - pi^(n+1)
    P_n(cot(pi x)), see `_cot_derivative`), where the zeta sum would need more terms."""
    if n == 0:
        return digamma(x)
    if n == 1:
        z = _where(x < _c(0.5), _c(1.0) - x, x)
        value = _hurwitz_zeta(_c(2.0), z)
        sin_pi_x = tir.sin(_c(math.pi) * x)
        reflected = _c(math.pi ** 2) / (sin_pi_x * sin_pi_x) - value
        return _where(x == _c(INF), _c(0.0), _where(x < _c(0.5), reflected, value))
    scale = (-1.0) ** (n + 1) * math.factorial(n)
    z = _where(x < _c(0.0), _c(1.0) - x, x)
    value = _c(scale) * _hurwitz_zeta(_c(float(n + 1)), z)
    cot = _c(1.0) / tir.tan(_c(math.pi) * (x - tir.trunc(x)))
    reflected = _c((-1.0) ** n) * value - _c(math.pi ** (n + 1)) * _poly(cot, [float(c) for c in _cot_derivative(n)])
    pole = tir.all(x <= _c(0.0), x == tir.floor(x))
    return _where(pole, _c(math.copysign(INF, scale)), _where(x < _c(0.0), reflected, value))


# ---- modified Bessel functions ----

_TERMS = 50
_I0_SERIES = [1.0 / math.factorial(k) ** 2 for k in range(_TERMS)]
_I1_SERIES = [1.0 / (math.factorial(k) * math.factorial(k + 1)) for k in range(_TERMS)]
_HARMONIC = [sum(Fraction(1, j) for j in range(1, k + 1)) for k in range(_TERMS + 1)]
_K0_SERIES = [float(_HARMONIC[k]) / math.factorial(k) ** 2 for k in range(_TERMS)]
_K1_SERIES = [float(_HARMONIC[k] + _HARMONIC[k + 1]) / (math.factorial(k) * math.factorial(k + 1))
              for k in range(_TERMS)]


def _asymptotic(order: int, terms: int, alternating: bool) -> list[float]:
    """Coefficients of 1/x^k in the large-x expansions of I_order (alternating) and K_order."""
    mu = 4 * order * order
    out = []
    for k in range(terms):
        a = Fraction(math.prod(mu - (2 * j - 1) ** 2 for j in range(1, k + 1)), math.factorial(k) * 8 ** k)
        out.append(float(a * (-1) ** k if alternating else a))
    return out


# I: series below |x| = 20 (50 positive terms), the asymptotic expansion above (30 terms, whose
# smallest term at x = 20 is ~1e-16). K: series below x = 9 (cancellation there costs e^18 of
# 1e-16), the expansion above (16 terms, before it diverges at k ~ 2x).
_I_SWITCH, _K_SWITCH = 20.0, 9.0
_I0_ASYMPTOTIC, _I1_ASYMPTOTIC = _asymptotic(0, 30, True), _asymptotic(1, 30, True)
_K0_ASYMPTOTIC, _K1_ASYMPTOTIC = _asymptotic(0, 16, False), _asymptotic(1, 16, False)


def _bessel_i(order: int, x: Expr, scaled: bool) -> Expr:
    """I_order(x) (times exp(-|x|) when scaled), order 0 or 1; I_1 is odd."""
    a = tir.abs(x)
    q = a * a * _c(0.25)
    series = _poly(q, _I0_SERIES) if order == 0 else a * _c(0.5) * _poly(q, _I1_SERIES)
    if scaled:
        series = series * tir.exp(-a)
    expansion = _poly(_c(1.0) / a, _I0_ASYMPTOTIC if order == 0 else _I1_ASYMPTOTIC) / tir.sqrt(_c(2.0 * math.pi) * a)
    if not scaled:
        # exp(a / 2)^2 stays finite as long as the result does
        half = tir.exp(a * _c(0.5))
        expansion = expansion * half * half
    value = _where(a < _c(_I_SWITCH), series, expansion)
    return value if order == 0 else tir.copysign(value, x)


def _bessel_k(order: int, x: Expr, scaled: bool) -> Expr:
    """K_order(x) (times exp(x) when scaled), order 0 or 1, x > 0."""
    q = x * x * _c(0.25)
    log_half = tir.log(x * _c(0.5))
    if order == 0:
        series = _poly(q, _K0_SERIES) - (log_half + _c(EULER_GAMMA)) * _poly(q, _I0_SERIES)
    else:
        i1 = x * _c(0.5) * _poly(q, _I1_SERIES)
        series = (_c(1.0) / x + log_half * i1
                  - x * _c(0.25) * (_poly(q, _K1_SERIES) - _c(2.0 * EULER_GAMMA) * _poly(q, _I1_SERIES)))
    if scaled:
        series = series * tir.exp(x)
    expansion = _poly(_c(1.0) / x, _K0_ASYMPTOTIC if order == 0 else _K1_ASYMPTOTIC) * tir.sqrt(_c(math.pi * 0.5) / x)
    if not scaled:
        expansion = expansion * tir.exp(-x)
    value = _where(x < _c(_K_SWITCH), series, expansion)
    return _where(x < _c(0.0), _c(NAN), _where(x == _c(0.0), _c(INF), value))


def _bessel_j(name: str, x: Expr) -> Expr:
    """j0 / j1 by libm; NaN at +-inf, as torch (the limit is 0). torch's float64 kernels are off
    by up to ~2e-7 near the zeros; libm agrees with scipy and mpmath to ~1e-16."""
    return _where(tir.isinf(x), _c(NAN), _extern(name, x))


def _bessel_y(name: str, x: Expr) -> Expr:
    """y0 / y1: NaN below 0 and -inf at 0, as torch (libm's y0 returns -inf for x < 0)."""
    return _where(tir.any(x < _c(0.0), tir.isinf(x)), _c(NAN), _where(x == _c(0.0), _c(-INF), _extern(name, x)))


def spherical_bessel_j0(x: Expr) -> Expr:
    """sin(x) / x; its Taylor series below |x| = 1/2."""
    small = _poly(x * x, [(-1) ** k / math.factorial(2 * k + 1) for k in range(9)])
    return _where(tir.isinf(x), _c(0.0), _where(tir.abs(x) < _c(0.5), small, tir.sin(x) / x))


# ---- elementwise functions with derivatives ----

@dataclass(frozen=True)
class Elementwise:
    """A float64 elementwise function and, if differentiable, its partial derivatives (one per
    argument, each a function of all the arguments)."""

    value: Callable[..., Expr]
    partials: Callable[..., list[Expr]] | None = None
    native: bool = False  # computed in the tensors' own dtype (nextafter: float32 steps)
    # Iterative functions: `value` is a first guess y, `refine(y, *args)` one step (each its own
    # kernel stage), `finish(y, *args)` the result; their `partials(y, *args)` get the result too.
    refine: Callable[..., Expr] | None = None
    finish: Callable[..., Expr] | None = None


def _unit(x: Expr) -> Expr:
    return _where(x == _c(0.0), _c(0.0), tir.copysign(_c(1.0), x))


FUNCTIONS: dict[str, Elementwise] = {
    "cosh": Elementwise(cosh, lambda x: [sinh(x)]),
    "sinh": Elementwise(sinh, lambda x: [cosh(x)]),
    "exp2": Elementwise(tir.exp2, lambda x: [tir.exp2(x) * _c(math.log(2.0))]),
    "erfc": Elementwise(erfc, lambda x: [_c(-2.0 / SQRT_PI) * tir.exp(-x * x)]),
    "erfcx": Elementwise(erfcx, lambda x: [_c(2.0) * x * erfcx(x) - _c(2.0 / SQRT_PI)]),
    "erfinv": Elementwise(
        lambda x: _erf_inverse_guess(*_erfinv_parts(x)), lambda y, x: [_c(SQRT_PI / 2.0) * tir.exp(y * y)],
        refine=lambda y, x: _erf_inverse_step(y, *_erfinv_parts(x)), finish=erfinv_finish),
    "ndtri": Elementwise(
        lambda p: _erf_inverse_guess(*_ndtri_parts(p)),
        lambda z, p: [_c(math.sqrt(2.0 * math.pi)) * tir.exp(z * z * _c(0.5))],
        refine=lambda y, p: _erf_inverse_step(y, *_ndtri_parts(p)), finish=ndtri_finish),
    "lgamma": Elementwise(lgamma, lambda x: [digamma(x)]),
    "digamma": Elementwise(digamma, lambda x: [polygamma(x, 1)]),
    "polygamma": Elementwise(polygamma, lambda x, n: [polygamma(x, n + 1)]),
    "zeta": Elementwise(zeta),
    "i0": Elementwise(lambda x: _bessel_i(0, x, False), lambda x: [_bessel_i(1, x, False)]),
    "i1": Elementwise(lambda x: _bessel_i(1, x, False), lambda x: [
        _where(x == _c(0.0), _c(0.5), _bessel_i(0, x, False) - _bessel_i(1, x, False) / x)]),
    "i0e": Elementwise(lambda x: _bessel_i(0, x, True), lambda x: [
        _bessel_i(1, x, True) - _unit(x) * _bessel_i(0, x, True)]),
    "i1e": Elementwise(lambda x: _bessel_i(1, x, True), lambda x: [
        _where(x == _c(0.0), _c(0.5),
               _bessel_i(0, x, True) - _bessel_i(1, x, True) * (_unit(x) + _c(1.0) / x))]),
    "modified_bessel_k0": Elementwise(lambda x: _bessel_k(0, x, False)),
    "modified_bessel_k1": Elementwise(lambda x: _bessel_k(1, x, False)),
    "scaled_modified_bessel_k0": Elementwise(lambda x: _bessel_k(0, x, True)),
    "scaled_modified_bessel_k1": Elementwise(lambda x: _bessel_k(1, x, True)),
    "bessel_j0": Elementwise(lambda x: _bessel_j("j0", x)),
    "bessel_j1": Elementwise(lambda x: _bessel_j("j1", x)),
    "bessel_y0": Elementwise(lambda x: _bessel_y("y0", x)),
    "bessel_y1": Elementwise(lambda x: _bessel_y("y1", x)),
    "spherical_bessel_j0": Elementwise(spherical_bessel_j0),
    # real input: 0, or pi below zero; NaN stays NaN
    "angle": Elementwise(lambda x: _where(tir.isnan(x), x, _where(x < _c(0.0), _c(math.pi), _c(0.0))),
                         lambda x: [_c(0.0)]),
    "hypot": Elementwise(tir.hypot, lambda x, y: [x / tir.hypot(x, y), y / tir.hypot(x, y)]),
    # torch's masks: ties and a NaN `other` go to `self`
    "fmax": Elementwise(
        lambda x, y: _where(tir.isnan(y), x, _where(tir.isnan(x), y, tir.Max(x, y))),
        lambda x, y: [_where(tir.any(x >= y, tir.isnan(y)), _c(1.0), _c(0.0)),
                      _where(tir.any(x >= y, tir.isnan(y)), _c(0.0), _c(1.0))]),
    "fmin": Elementwise(
        lambda x, y: _where(tir.isnan(y), x, _where(tir.isnan(x), y, tir.Min(x, y))),
        lambda x, y: [_where(tir.any(x <= y, tir.isnan(y)), _c(1.0), _c(0.0)),
                      _where(tir.any(x <= y, tir.isnan(y)), _c(0.0), _c(1.0))]),
    "copysign": Elementwise(tir.copysign, lambda x, y: [
        _where(x == _c(0.0), _c(0.0), tir.copysign(x, y) / x), _c(0.0)]),
    "ldexp": Elementwise(lambda x, e: x * tir.exp2(e),
                         lambda x, e: [tir.exp2(e), x * tir.exp2(e) * _c(math.log(2.0))]),
    "nextafter": Elementwise(tir.nextafter, lambda x, y: [_c(1.0), _c(0.0)], native=True),  # as torch's
    "log_ndtr": Elementwise(log_ndtr, lambda x: [
        tir.exp(_c(-0.5) * x * x - log_ndtr(x)) * _c(1.0 / math.sqrt(2.0 * math.pi))]),
}

GRAD_PREFIX = "tvmgraph.special."


def _value(function: Elementwise, tensors: Sequence[te.Tensor], params: dict) -> Callable[..., Expr]:
    """The function of the tensors, in float64, as an index -> value function (staged for
    iterative functions)."""

    def args(index: Sequence[Expr]) -> list[Expr]:
        return [t(*index).astype(F64) for t in tensors]

    if function.refine is None:
        return lambda *index: function.value(*args(index), **params)
    shape = tensors[0].shape
    y = te.compute(shape, lambda *index: function.value(*args(index)), name="guess")
    def step(previous: te.Tensor) -> Callable[..., Expr]:
        return lambda *index: function.refine(previous(*index), *args(index))

    for k in range(NEWTON_STEPS):
        y = te.compute(shape, step(y), name=f"step{k}")
    return lambda *index: function.finish(y(*index), *args(index))


def _kernel(name: str, out_dtype: str, params: dict) -> Callable[..., te.Tensor]:
    function = FUNCTIONS[name]

    def kernel(*tensors: te.Tensor) -> te.Tensor:
        if function.native:
            return te.compute(tensors[0].shape, lambda *index: function.value(*(t(*index) for t in tensors)),
                              name=name)
        value = _value(function, tensors, params)
        return te.compute(tensors[0].shape, lambda *index: value(*index).astype(out_dtype), name=name)

    return kernel


def _gradient(name: str) -> Callable[..., list[te.Tensor]]:
    function = FUNCTIONS[name]

    def gradient(grad: te.Tensor, *tensors: te.Tensor, **attrs: object) -> list[te.Tensor]:
        params = {key: int(value) for key, value in attrs.items()}  # polygamma's order n
        output = None
        if function.refine is not None:
            value = _value(function, tensors, params)
            output = te.compute(tensors[0].shape, value, name=f"{name}_value")

        def partial(k: int) -> Callable[..., Expr]:
            def body(*index: Expr) -> Expr:
                args = [t(*index).astype(F64) for t in tensors]
                if output is not None:
                    args.insert(0, output(*index))
                return (grad(*index).astype(F64) * function.partials(*args, **params)[k]).astype(tensors[k].dtype)
            return body

        return [te.compute(t.shape, partial(k), name=f"{name}_grad{k}") for k, t in enumerate(tensors)]

    return gradient


def _register_gradients() -> None:
    from tvm.relax.training.utils import register_te_gradient

    for name, function in FUNCTIONS.items():
        if function.partials is not None and tvm.get_global_func(
                "tvm.relax.te_grad._register." + GRAD_PREFIX + name, allow_missing=True) is None:
            register_te_gradient(GRAD_PREFIX + name, _gradient(name))


_register_gradients()


def _shape_of(node: torch.fx.Node) -> list[int]:
    shape = node.meta["val"].shape
    if not all(isinstance(d, int) for d in shape):
        raise NotImplementedError(f"needs a static shape, got {list(shape)}")
    return [int(d) for d in shape]


def apply(importer: ExportedProgramImporter, name: str, args: Sequence[object], dtype: str,
          shape: Sequence[int], **params: object) -> relax.Expr:
    """FUNCTIONS[name] of `args` (tensors or Python numbers), broadcast to `shape` and computed
    in `dtype` (the result's, or the common float dtype of the inputs)."""
    bb = importer.block_builder
    tensors = []
    for arg in args:
        if isinstance(arg, torch.fx.Node):
            value = importer.env[arg]
            if value.ty.dtype.dtype != dtype:
                value = bb.emit(relax.op.astype(value, dtype))
        else:
            value = relax.const(float(arg), dtype)
        if [int(d) for d in value.ty.shape] != list(shape):
            value = bb.emit(relax.op.broadcast_to(value, list(shape)))
        tensors.append(value)
    function = FUNCTIONS[name]
    if function.partials is None or not dtype.startswith(("float", "bfloat")):
        return bb.emit_te(_kernel(name, dtype, params), *tensors, primfunc_name_hint=name)
    return bb.emit(bb.call_te_with_grad(_kernel(name, dtype, params), *tensors, primfunc_name_hint=name,
                                        te_grad_name=GRAD_PREFIX + name, te_grad_kwargs=params))


def elementwise(name: str, tensor_args: Sequence[int] = (0,), **params: object) -> Callable:
    """The converter of an aten op that is FUNCTIONS[name] of the node's arguments at `tensor_args`."""

    def convert(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
        args = [node.args[i] for i in tensor_args]
        return apply(importer, name, args, result_dtype(node), _shape_of(node), **params)

    return convert


def polygamma_converter(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """aten.polygamma(n, x), n a Python int."""
    n = int(node.args[0])
    if n < 0:
        raise NotImplementedError(f"polygamma of negative order {n}")
    return apply(importer, "polygamma", [node.args[1]], result_dtype(node), _shape_of(node), n=n)


def heaviside(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """values where x == 0, else (x > 0), in the result's dtype (the stock converter mixes a
    float32 constant into other dtypes); NaN gives 0, as torch."""
    bb = importer.block_builder
    dtype = result_dtype(node)
    x, values = (importer.env[a] for a in node.args[:2])
    x, values = (v if v.ty.dtype.dtype == dtype else bb.emit(relax.op.astype(v, dtype)) for v in (x, values))
    zero = relax.const(0, dtype)
    step = relax.op.astype(relax.op.greater(x, zero), dtype)
    return bb.emit(relax.op.where(relax.op.equal(x, zero), values, step))


def _signbit(x: te.Tensor) -> te.Tensor:
    def body(*index: Expr) -> Expr:
        v, dtype = x(*index), str(x.dtype)
        if dtype == "bool":
            return tir.const(False, "bool")
        if dtype.startswith(("int", "uint")):
            return v < tir.const(0, dtype)
        # the sign bit itself: -0.0 and negative NaNs count
        return tir.reinterpret("int64", v.astype(F64)) < tir.const(0, "int64")

    return te.compute(x.shape, body, name="signbit")


def signbit(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    return importer.block_builder.emit_te(_signbit, importer.env[node.args[0]], primfunc_name_hint="signbit")


def frexp(node: torch.fx.Node, importer: ExportedProgramImporter) -> relax.Expr:
    """(mantissa, exponent) with x = mantissa * 2^exponent, 0.5 <= |mantissa| < 1, in float64
    (exact; float32 subnormals need 2^149). Written with Relax ops, so the mantissa's gradient
    dy * 2^-exponent comes from theirs (floor's is zero). 0, inf and NaN give (x, 0), as torch."""
    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dtype = x.ty.dtype.dtype
    op = relax.op

    def c(v: float) -> relax.Expr:
        return relax.const(v, F64)

    wide = bb.emit(op.astype(x, F64)) if dtype != F64 else x
    magnitude = bb.emit(op.abs(wide))
    regular = bb.emit(op.logical_and(op.isfinite(wide), op.not_equal(wide, c(0.0))))
    safe = bb.emit(op.where(regular, magnitude, c(1.0)))
    guess = bb.emit(op.add(op.floor(op.divide(op.log(safe), c(math.log(2.0)))), c(1.0)))
    # log's rounding can put the guess one off; one correction step each way
    scaled = bb.emit(op.divide(safe, op.power(c(2.0), guess)))
    guess = bb.emit(op.where(op.greater_equal(scaled, c(1.0)), op.add(guess, c(1.0)),
                             op.where(op.less(scaled, c(0.5)), op.subtract(guess, c(1.0)), guess)))
    exponent = bb.emit(op.where(regular, guess, c(0.0)))
    mantissa = bb.emit(op.divide(wide, op.power(c(2.0), exponent)))
    if dtype != F64:
        mantissa = bb.emit(op.astype(mantissa, dtype))
    return bb.emit(relax.Tuple([mantissa, bb.emit(op.astype(exponent, "int32"))]))


def _unary(name: str) -> Callable:
    return elementwise(name, (0,))


def _binary(name: str) -> Callable:
    return elementwise(name, (0, 1))


CONVERTERS = {
    "cosh.default": _unary("cosh"),
    "sinh.default": _unary("sinh"),
    "exp2.default": _unary("exp2"),
    "erfc.default": _unary("erfc"),
    "special_erfcx.default": _unary("erfcx"),
    "special_log_ndtr.default": _unary("log_ndtr"),
    "erfinv.default": _unary("erfinv"),
    "special_ndtri.default": _unary("ndtri"),
    "lgamma.default": _unary("lgamma"),
    "digamma.default": _unary("digamma"),
    "polygamma.default": polygamma_converter,
    "special_zeta.default": _binary("zeta"),
    "special_zeta.self_scalar": _binary("zeta"),
    "special_zeta.other_scalar": _binary("zeta"),
    "i0.default": _unary("i0"),
    "special_i0e.default": _unary("i0e"),
    "special_i1.default": _unary("i1"),
    "special_i1e.default": _unary("i1e"),
    "special_modified_bessel_i0.default": _unary("i0"),
    "special_modified_bessel_i1.default": _unary("i1"),
    "special_modified_bessel_k0.default": _unary("modified_bessel_k0"),
    "special_modified_bessel_k1.default": _unary("modified_bessel_k1"),
    "special_scaled_modified_bessel_k0.default": _unary("scaled_modified_bessel_k0"),
    "special_scaled_modified_bessel_k1.default": _unary("scaled_modified_bessel_k1"),
    "special_bessel_j0.default": _unary("bessel_j0"),
    "special_bessel_j1.default": _unary("bessel_j1"),
    "special_bessel_y0.default": _unary("bessel_y0"),
    "special_bessel_y1.default": _unary("bessel_y1"),
    "special_spherical_bessel_j0.default": _unary("spherical_bessel_j0"),
    "angle.default": _unary("angle"),
    "hypot.default": _binary("hypot"),
    "fmax.default": _binary("fmax"),
    "fmin.default": _binary("fmin"),
    "copysign.Tensor": _binary("copysign"),
    "copysign.Scalar": _binary("copysign"),
    "ldexp.Tensor": _binary("ldexp"),
    "nextafter.default": _binary("nextafter"),
    "heaviside.default": heaviside,
    "signbit.default": signbit,
    "frexp.Tensor": frexp,
}

"""torch.special's orthogonal polynomials against eager (tvmgraph/converters_polynomials.py):
every early case (the ends of the interval, the closed form for a large degree, n < 0, 0 and 1),
the recurrence, Hermite's degree limit (NaN above it), number arguments, float32 and float64."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import Fn, ModuleGraph, assert_close

NAMES = ["chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
         "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
         "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
         "legendre_polynomial_p"]
POLYNOMIALS = [getattr(torch.special, name) for name in NAMES]


def polynomials(x, n):
    return (*(f(x, n) for f in POLYNOMIALS), torch.special.chebyshev_polynomial_t(x, 3),
            torch.special.hermite_polynomial_h(0.5, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polynomials_match_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    # the ends (1, -1, 0 for the shifted ones), outside the interval, degrees past the closed-form
    # thresholds (4, 6, 8), past Hermite's limit (200), negative, 0 and 1, then random ones
    x = torch.cat([torch.tensor([1.0, -1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 2.0, -3.0, 0.9, 0.1, 1.1]),
                   torch.rand(36) * 2.4 - 1.2]).to(dtype)
    n = torch.cat([torch.tensor([3.0, 4.0, 5.0, 12.0, -1.0, 0.0, 1.0, 200.0, 9.0, 7.0, 5.0, 2.7]),
                   torch.randint(-1, 15, (36,)).float()]).to(dtype)
    for name, got, expected in zip(NAMES + ["t_of_a_number_n", "h_of_a_number_x"], ModuleGraph(Fn(polynomials))(x, n),
                                   polynomials(x, n), strict=True):
        assert got.dtype == expected.dtype, name
        assert_close(got, expected, rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")

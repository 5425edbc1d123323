"""`torch.cov` and `torch.corrcoef`, traced without their checks of values.

torch's C++ implementations (aten/src/ATen/native/Correlation.cpp) test values on the host
(`fweights cannot be negative`, `weights sum to zero`, and `degrees of freedom <= 0`, which
zeroes the normalization factor): torch.export stops on the first (DataDependentOutputException
on `aten.equal`). While build() is traced, `cov` and `corrcoef` below replace them: the same
operations in the same order, the degrees of freedom zeroed with a `where` when they are
computed from weights (as eager, the result is then inf/NaN), the value checks left out
(negative weights or weights that sum to zero give NaN/inf where eager raises).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.overrides import TorchFunctionMode

_DOF_WARNING = "cov(): degrees of freedom is <= 0. Correction should be strictly less than the number of observations."


def cov(input: torch.Tensor, *, correction: int = 1, fweights: torch.Tensor | None = None,
        aweights: torch.Tensor | None = None) -> torch.Tensor:
    """torch.cov (rows are variables, columns observations), as Correlation.cpp computes it."""
    if input.ndim > 2:
        raise RuntimeError(f"cov(): expected input to have two or fewer dimensions but got an input with "
                           f"{input.ndim} dimensions")
    observations = input if input.ndim == 2 else input.view(1, -1)
    count = observations.shape[1]
    weights = fweights
    if aweights is not None:
        weights = aweights if weights is None else weights * aweights
    if weights is None:
        weight_sum = torch.scalar_tensor(count, dtype=torch.long, device=input.device)
        average = observations.sum(1) / weight_sum
        if count - correction <= 0:
            warnings.warn(_DOF_WARNING)
        # A float, as true_divide makes it: a constant integer 0 stopped TVM's constant folding.
        norm = torch.scalar_tensor(float(max(count - correction, 0)), device=input.device)
    else:
        weight_sum = weights.sum()
        average = (observations * weights).sum(1) / weight_sum
        if correction == 0:
            norm = weight_sum
        elif aweights is None:
            norm = weight_sum - correction
        elif fweights is None and count == 1 and correction == 1:
            norm = torch.scalar_tensor(0.0, device=input.device)
        else:
            norm = weight_sum - correction * (weights * aweights).sum() / weight_sum
        norm = torch.where(norm <= 0, torch.zeros_like(norm), norm)
    if count == 1 and (fweights is None) != (aweights is None):
        # eager zeroes the input here; a literal zero is folded into the product by TVM
        # (0 * x = 0, 0 / 0 = 0), the difference of the input with itself is not.
        centered = observations.to(average.dtype) - observations.to(average.dtype)
    else:
        centered = observations - average.unsqueeze(1)
    product = torch.mm(centered, (centered if weights is None else centered * weights).t().conj())
    return torch.true_divide(product, norm).squeeze()


def corrcoef(input: torch.Tensor) -> torch.Tensor:
    """torch.corrcoef: the covariance divided by both standard deviations, clipped to [-1, 1]."""
    c = cov(input)
    if c.ndim == 0:
        return c / c
    stddev = torch.sqrt(c.diagonal())
    c = c / stddev.view(-1, 1)
    c = c / stddev.view(1, -1)
    return c.clip(-1, 1)


def _tensor_cov(self: torch.Tensor, *, correction: int = 1, fweights: torch.Tensor | None = None,
                aweights: torch.Tensor | None = None) -> torch.Tensor:
    return cov(self, correction=correction, fweights=fweights, aweights=aweights)


_REPLACEMENTS = {torch.cov: cov, torch.Tensor.cov: _tensor_cov, torch.corrcoef: corrcoef,
                 torch.Tensor.corrcoef: corrcoef}


class _Replaced(TorchFunctionMode):
    """Calls of torch.cov / corrcoef (functions and methods) go to the functions above: a
    function mode sees every call, also through a reference taken before tracing (OpInfo's)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _REPLACEMENTS.get(func, func)(*args, **(kwargs or {}))


def traceable() -> contextlib.AbstractContextManager:
    """torch.cov and torch.corrcoef (and their Tensor methods) are the functions above while
    build() is traced."""
    return _Replaced()

"""Batch norm with `momentum=None` (a cumulative moving average) while build() is traced.

`_BatchNorm.forward` then computes its factor as `1.0 / float(self.num_batches_tracked)`: a
Python float read from a tensor, which export cannot trace (GuardOnDataDependentSymNode). While
tracing, such a module in training normalizes with the batch statistics and updates its running
statistics itself, with the factor as a tensor: running = (1 - f) * running + f * batch, f =
1 / num_batches_tracked, the variance unbiased, computed in float64 as torch's CPU kernel does.
Every other batch norm runs torch's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def _cumulative(module: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
    module._check_input_dim(x)
    module.num_batches_tracked.add_(1)
    out = F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)
    with torch.no_grad():
        factor = 1.0 / module.num_batches_tracked.double()
        dims = [0, *range(2, x.dim())]
        wide = x.double()
        for running, batch in ((module.running_mean, wide.mean(dims)), (module.running_var, wide.var(dims))):
            running.copy_((batch * factor + running.double() * (1.0 - factor)).to(running.dtype))
    return out


@contextlib.contextmanager
def traceable() -> Iterator[None]:
    """Batch norms with `momentum=None` in training use `_cumulative` while build() is traced."""
    original = _BatchNorm.forward

    def forward(self: _BatchNorm, x: torch.Tensor) -> torch.Tensor:
        if self.momentum is None and self.training and self.track_running_stats \
                and self.num_batches_tracked is not None:
            return _cumulative(self, x)
        return original(self, x)

    _BatchNorm.forward = forward
    try:
        yield
    finally:
        _BatchNorm.forward = original

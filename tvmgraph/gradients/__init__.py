"""Relax gradients that TVM 0.27 lacks or gets wrong; importing this package registers them.

``relax.transform.Gradient`` looks up each op's ``FPrimalGradient`` attribute. TVM 0.27 has
none for many ops that ``torch.export`` programs produce (squeeze, batch_norm, layer_norm, gelu,
clip, ...). The submodules register them by op family; ``fixes`` replaces TVM gradients that
are wrong. Registration is idempotent; see ``_common`` for the level rules and
docs/gradients.md for the list and the formulas.
"""

from . import (  # noqa: F401
    activation, conv, einsum, elementwise, fixes, grid_sample, index, nn, nondiff, norm, pool3d, reduce, scan,
    scatter, shape, sort,
)
from ._common import REGISTERED as REGISTERED

__all__ = ["REGISTERED"]

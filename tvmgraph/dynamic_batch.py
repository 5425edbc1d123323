"""Dynamic batch (`graph.config.enable_dynamic_batch()`): one program for every batch size.

Dim 0 of every tensor argument with at least one dim is the batch. The call's signature holds
`None` there (`TensorSpec.shape == (None, 784)`), so calls of any batch size find one compiled
entry, and the trace exports that dim as one symbolic size shared by all arguments
(`torch.export.Dim("batch", min=1)`): Relax, the kernels and the VM's own shape checks then take
any size, while the other dims stay fixed.

A batch of 1 is not in that range: torch.export assumes a symbolic size is at least 2 (its 0/1
specialization), so `if x.shape[0] == 1:` in build() was compiled as False, and BatchNorm's
"more than 1 value per channel" check away (a batch of 1 trained on NaN-free garbage). So a
call of batch 1 has its own static signature (`TensorSpec.shape == (1, 784)`), traced and
compiled as a graph without a dynamic batch would be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .errors import GraphArgumentError
from .spec import TensorSpec

BATCH_DIM_NAME = "batch"


def is_batched(t: torch.Tensor) -> bool:
    """Whether `t` has a batch dim (dim 0); a 0-d tensor has none and stays static."""
    return t.dim() > 0


def batch_specs(graph: str, flat: Sequence[torch.Tensor],
                names: Callable[[], list[str]]) -> tuple[TensorSpec, ...]:
    """The specs of a call's tensors with the batch dim left open (`None`); checks that all
    batched tensors agree on a batch size of at least 1. `names()` gives the arguments' names
    (asked only for an error message)."""
    specs = []
    batch = None
    for i, t in enumerate(flat):
        if not is_batched(t):
            specs.append(TensorSpec.of(t))
            continue
        size = t.shape[0]
        if size == 0:
            raise GraphArgumentError(
                f"{graph}: argument '{names()[i]}' has batch size 0 and the graph has a dynamic batch "
                f"(config.enable_dynamic_batch()), which runs batches of 1 or more; skip empty batches.")
        if batch is None:
            batch = (size, i)
        elif size != batch[0]:
            first = names()[batch[1]]
            raise GraphArgumentError(
                f"{graph}: arguments '{first}' and '{names()[i]}' have batch sizes (dim 0) {batch[0]} and "
                f"{size}; with config.enable_dynamic_batch() dim 0 of every tensor argument is the batch, "
                f"so they must agree. Pass a tensor without a batch (a table, a mask shared by all "
                f"samples) as a module buffer instead of an argument.")
        specs.append(TensorSpec((None, *t.shape[1:]), t.dtype, t.device))
    if batch is not None and batch[0] == 1:  # its own entry, static (see the module docstring)
        return tuple(TensorSpec.of(t) for t in flat)
    return tuple(specs)


def export_arguments(flat: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], tuple | None]:
    """Example arguments and `dynamic_shapes` for torch.export: one `Dim` for every batch dim;
    none for a batch of 1 (static, see the module docstring)."""
    if any(is_batched(t) and t.shape[0] == 1 for t in flat):
        return tuple(flat), None
    batch = torch.export.Dim(BATCH_DIM_NAME, min=2)
    return tuple(flat), tuple({0: batch} if is_batched(t) else None for t in flat)


HINT = ("\nThe graph has a dynamic batch (config.enable_dynamic_batch()): build() must work for any "
        "batch size. Write shapes in terms of the input (x.flatten(1), x.view(x.shape[0], -1), "
        "x.reshape(-1, 784)) instead of a fixed batch, or turn the option off.")

"""scikit-learn's digits (1797 8x8 grayscale images, 10 classes): ships with the package."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """Images as float32 (N, 1, 8, 8) scaled to [0, 1], labels as int64 (N,)."""
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(data.target, dtype=torch.int64)


def batches(images: torch.Tensor, labels: torch.Tensor, batch: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled epoch of full batches (a fixed batch shape keeps one compiled graph)."""
    order = torch.randperm(len(images), generator=generator)
    full = len(images) // batch * batch
    return [(images[order[i:i + batch]], labels[order[i:i + batch]]) for i in range(0, full, batch)]

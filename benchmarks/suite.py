"""The reference workloads: model, inputs and loss for each benchmark case."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from examples.mobilenet import MobileNetV2Small
from examples.zoo import GPT, ResNet18, ViT


@dataclass(frozen=True)
class Case:
    """One workload: `make_model()` gives a fresh model, `inputs()` a batch and its target."""

    name: str
    description: str
    make_model: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[], nn.Module]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0,
                                       activation="gelu", batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _large_mlp() -> nn.Module:
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(4096, 4096), nn.ReLU())], nn.Linear(4096, 10))


class TokenCrossEntropy(nn.Module):
    """A language model's loss: cross-entropy over every position of (batch, seq, vocab) logits."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _tokens(batch: int, seq: int, vocab: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq)))


def _classification(batch: int, shape: tuple[int, ...]) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.randn(batch, *shape), torch.randint(0, 10, (batch,)))


CASES: dict[str, Case] = {
    case.name: case
    for case in (
        Case("mlp_b1", "MLP 784-1024-1024-10, batch 1", _mlp, _classification(1, (784,)), nn.CrossEntropyLoss),
        Case("mlp_b64", "MLP 784-1024-1024-10, batch 64", _mlp, _classification(64, (784,)), nn.CrossEntropyLoss),
        Case("cnn", "MobileNetV2-style CNN, 3x32x32, batch 64", lambda: MobileNetV2Small(dropout=0.0),
             _classification(64, (3, 32, 32)), nn.CrossEntropyLoss),
        Case("transformer", "2-layer encoder, d_model 256, 4 heads, seq 128, batch 8", _transformer,
             lambda: (torch.randn(8, 128, 256), torch.randn(8, 128, 256)), nn.MSELoss),
        # Models no one here tuned tvmgraph for (issue 14): torchvision's ResNet-18 block layout at
        # CIFAR size, a large MLP, and nanoGPT with its output layer tied to the token embedding.
        Case("resnet18", "CIFAR ResNet-18 (width 64), 3x32x32, batch 16", lambda: ResNet18(width=64),
             _classification(16, (3, 32, 32)), nn.CrossEntropyLoss),
        Case("mlp_large", "MLP 4096-4096-4096-4096-10, batch 256", _large_mlp, _classification(256, (4096,)),
             nn.CrossEntropyLoss),
        Case("gpt", "GPT, tied embeddings, vocab 4096, d 256, 4 heads, 4 layers, seq 128, batch 8",
             lambda: GPT(vocab=4096, d=256, heads=4, layers=4, block=128), _tokens(8, 128, 4096), TokenCrossEntropy),
        # Sequences that no vector divides: 64 patches and a class token.
        Case("vit", "ViT, 3x32x32 in 4x4 patches (65 tokens), d 128, 4 heads, 4 layers, batch 16",
             lambda: ViT(image=32, patch=4, d=128, heads=4, layers=4, classes=10),
             _classification(16, (3, 32, 32)), nn.CrossEntropyLoss),
    )
}

"""Small reference models used across the tests (shapes kept small for 2-core CI)."""

from __future__ import annotations

import torch
from torch import nn

from examples.mobilenet import InvertedResidual


def mlp(sizes: tuple[int, ...] = (32, 64, 64, 10)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """MobileNetV2-style: conv-bn-relu6 stem, inverted residuals, pools, classifier."""

    def __init__(self, in_ch: int = 3, classes: int = 10, width: int = 8, dropout: float = 0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU6(),
            InvertedResidual(width, width, 1, 2),
            InvertedResidual(width, 2 * width, 2, 2),
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1),
            InvertedResidual(2 * width, 2 * width, 1, 2),
            nn.AvgPool2d(kernel_size=3, stride=1, padding=1),
            nn.Conv2d(2 * width, 4 * width, 1), nn.ReLU6(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(4 * width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block: LayerNorm, multi-head attention, GELU MLP, residuals."""

    def __init__(self, d_model: int = 32, heads: int = 4, ff: int = 64, dropout: float = 0.0,
                 approximate: str = "none"):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, ff), nn.GELU(approximate=approximate),
                                nn.Dropout(dropout), nn.Linear(ff, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class SoftmaxAttention(nn.Module):
    """Hand-written single-head attention with an explicit softmax (no fused SDPA)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) * self.scale, dim=-1)
        return weights @ v


def assert_rnn_trains_as_in_eager(cell: str, layers: int = 1, steps: int = 3) -> None:
    """examples.zoo's RNNClassifier (an nn.LSTM or nn.GRU over 7 tokens, batch 4) trained by
    SGD in a tvmgraph TrainGraph and in eager: each step's loss, then every parameter, within
    float32 rounding."""
    from examples.zoo import RNNClassifier
    from tests.conftest import TrainGraph

    torch.manual_seed(0)
    model = RNNClassifier(cell, vocab=20, d=8, hidden=12, classes=3, layers=layers)
    reference = RNNClassifier(cell, vocab=20, d=8, hidden=12, classes=3, layers=layers)
    reference.load_state_dict(model.state_dict())
    idx, y = torch.randint(0, 20, (4, 7)), torch.randint(0, 3, (4,))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.5))
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(steps):
        loss = graph(idx, y)
        opt.zero_grad()
        expected = nn.functional.cross_entropy(reference(idx), y)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-5, rtol=1e-4)

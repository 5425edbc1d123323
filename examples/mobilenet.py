"""A MobileNetV2-style CNN for small images (digits 8x8, CIFAR-sized 32x32).

Inverted residual blocks (1x1 expand, 3x3 depthwise, 1x1 project, skip add), BatchNorm,
ReLU6, global average pooling, dropout and a linear classifier, as in torchvision's
MobileNetV2, with widths scaled down for small inputs.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn_relu6(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(),
    )


class InvertedResidual(nn.Module):
    """1x1 expand, 3x3 depthwise (stride 1 or 2), 1x1 linear projection; skip add when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_skip = stride == 1 and cin == cout
        layers: list[nn.Module] = [conv_bn_relu6(cin, hidden, 1)] if expand != 1 else []
        layers += [conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_skip else y


# (expansion t, output channels c, repeats n, first stride s), as in the MobileNetV2 paper.
SMALL_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 1, 1))


class MobileNetV2Small(nn.Module):
    def __init__(self, in_channels: int = 3, classes: int = 10, stem: int = 16, last: int = 128,
                 settings: tuple[tuple[int, int, int, int], ...] = SMALL_SETTINGS, dropout: float = 0.2):
        super().__init__()
        layers: list[nn.Module] = [conv_bn_relu6(in_channels, stem, 3)]
        cin = stem
        for t, c, n, s in settings:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(last, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))

"""A small model zoo in the shapes users bring (examples/zoo.py), kept small for 2 cores.

Each entry: a factory for the model, one for an input batch and labels, the loss and the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from examples.zoo import (GPT, TCN, AtrousCNN, AudioConv, ConvNeXt, Encoder, Llama, MobileNetV3, ResNet18, RNNClassifier,
                          UNet, ViT)


@dataclass
class ZooEntry:
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]


def _images(n: int, size: int, classes: int):
    return lambda g: (torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g))


def _waves(n: int, length: int, classes: int):
    return lambda g: (torch.randn(n, 1, length, generator=g), torch.randint(0, classes, (n,), generator=g))


def _waves4(n: int, length: int, classes: int):
    return lambda g: (torch.randn(n, 4, length, generator=g), torch.randint(0, classes, (n,), generator=g))


def _tokens(n: int, t: int, vocab: int, classes: int | None = None):
    def batch(g: torch.Generator):
        idx = torch.randint(0, vocab, (n, t), generator=g)
        target = torch.randint(0, classes, (n,), generator=g) if classes else torch.randint(0, vocab, (n, t), generator=g)
        return idx, target

    return batch


def _lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _segmentation(n: int, size: int, classes: int):
    return lambda g: (torch.randn(n, 3, size, size, generator=g),
                      torch.randint(0, classes, (n, size, size), generator=g))


class Seq2Seq(nn.Module):
    """nn.Transformer as its docs use it: a causal `tgt_mask` (its causality found by comparing
    it with the causal mask, which export could not trace), a source padding mask and an
    embedding whose padding row must not train."""

    def __init__(self, vocab: int = 12, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.transformer = nn.Transformer(width, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        src, tgt = self.embed(tokens), self.embed(tokens.roll(1, 1))
        return self.head(self.transformer(src, tgt, tgt_mask=mask, src_key_padding_mask=tokens == 0))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


ZOO = {
    "resnet18": ZooEntry(ResNet18, _images(4, 16, 10), F.cross_entropy, _sgd),
    "gpt_tied": ZooEntry(GPT, _tokens(2, 8, 32), _lm_loss, _adamw),
    "lstm": ZooEntry(lambda: RNNClassifier("lstm"), _tokens(3, 6, 20, 3), F.cross_entropy, _adamw),
    "gru": ZooEntry(lambda: RNNClassifier("gru"), _tokens(3, 6, 20, 3), F.cross_entropy, _adamw),
    "unet": ZooEntry(UNet, _segmentation(2, 16, 2), F.cross_entropy, _sgd),
    # SGD: nn.MultiheadAttention has a key bias (see CausalSelfAttention), which Adam would amplify.
    "vit": ZooEntry(ViT, _images(2, 16, 5), F.cross_entropy, _sgd),
    "seq2seq": ZooEntry(Seq2Seq, _tokens(2, 6, 12), _lm_loss, _sgd),
    "llama": ZooEntry(Llama, _tokens(2, 8, 40), _lm_loss, _adamw),
    # 1-D rows no vector divides (481, 118, 27 samples): the conv1ds' gradients as im2col + matmul.
    "audio_m5": ZooEntry(AudioConv, _waves(4, 2000, 10), F.cross_entropy, _sgd),
    # hardswish, hardsigmoid, a squeeze-excite scale, 5x5 depthwise convs, batch norms.
    "mobilenetv3": ZooEntry(MobileNetV3, _images(2, 16, 10), F.cross_entropy, _adamw),
    # 7x7 depthwise conv, channels-last LayerNorm through permutes, a layer-scale parameter.
    "convnext": ZooEntry(ConvNeXt, _images(2, 16, 10), F.cross_entropy, _adamw),
    # nn.TransformerEncoder (post-norm); SGD for its key bias, as the ViT's.
    "encoder": ZooEntry(Encoder, _tokens(2, 8, 50, 2), F.cross_entropy, _sgd),
    # dilated conv1ds (1, 2, 4) over 64 samples with residual adds.
    "tcn": ZooEntry(TCN, _waves4(2, 64, 5), F.cross_entropy, _sgd),
    # 3x3 convs dilated 2, 4, 6 (one depthwise): their input gradients as convs of flipped kernels.
    "atrous": ZooEntry(AtrousCNN, _images(2, 12, 10), F.cross_entropy, _sgd),
}

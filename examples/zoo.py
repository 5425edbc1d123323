"""Models in the shapes users bring, after their well-known designs (random weights, no downloads).

torchvision's ResNet BasicBlock, nanoGPT's block with tied embeddings, a GRU/LSTM classifier, a
U-Net with skip concatenation, a ViT patch embedding, an M5-style raw-audio Conv1d net,
MobileNetV3's squeeze-excite blocks with hardswish, ConvNeXt's blocks, nn.TransformerEncoder, a
dilated temporal conv net, a DeepLab-style atrous CNN, a LLaMA-style decoder (RMSNorm, rotary
embeddings, SwiGLU): not shapes tvmgraph was built around. The defaults are small (tests/numeric/zoo.py runs them on 2 cores); benchmarks/suite.py builds them
at full size.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 conv-bn, identity or 1x1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-style ResNet-18 (3x3 stem, [2, 2, 2, 2] BasicBlocks), width-scaled for CI."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one qkv projection, split, causal scaled-dot-product attention."""

    def __init__(self, d: int, heads: int, block: int):
        super().__init__()
        self.heads = heads
        # nanoGPT's bias=False: a key bias has a zero gradient in exact arithmetic, and AdamW turns
        # float32 rounding noise in it into steps of about lr whose sign is noise.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, block: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, block)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT in miniature, with the output layer's weight tied to the token embedding."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2, block: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.Sequential(*[GPTBlock(d, heads, block) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


class RNNClassifier(nn.Module):
    """Embedding, an LSTM or GRU (1 layer unless told) over the sequence, a linear head on the
    last state."""

    def __init__(self, cell: str, vocab: int = 20, d: int = 8, hidden: int = 12, classes: int = 3,
                 layers: int = 1):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(d, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx):
        out, _ = self.rnn(self.emb(idx))
        return self.head(out[:, -1])


class UNet(nn.Module):
    """Two-level U-Net: conv blocks, max-pool down, nearest upsample, skip concatenation."""

    def __init__(self, cin: int = 3, width: int = 4, classes: int = 2):
        super().__init__()

        def block(a: int, b: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU(),
                                 nn.Conv2d(b, b, 3, padding=1), nn.ReLU())

        self.down1 = block(cin, width)
        self.down2 = block(width, 2 * width)
        self.bottom = block(2 * width, 4 * width)
        self.up2 = block(4 * width + 2 * width, 2 * width)
        self.up1 = block(2 * width + width, width)
        self.out = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(b, scale_factor=2, mode="nearest"), d2], dim=1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2, mode="nearest"), d1], dim=1))
        return self.out(u1)


class ViT(nn.Module):
    """ViT: conv patch embedding, class token, learned positions, encoder layers, head."""

    def __init__(self, image: int = 16, patch: int = 4, d: int = 16, heads: int = 2, layers: int = 1,
                 classes: int = 5, activation: str = "relu"):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        n = (image // patch) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, activation=activation, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


class AudioConv(nn.Module):
    """A raw-audio classifier (M5-style): a Conv1d with an 80-sample kernel at stride 4, then
    3-sample ones, each with BatchNorm1d, ReLU and max pooling; an average over time."""

    def __init__(self, classes: int = 10, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, width, 80, stride=4), nn.BatchNorm1d(width), nn.ReLU(), nn.MaxPool1d(4),
            nn.Conv1d(width, 2 * width, 3), nn.BatchNorm1d(2 * width), nn.ReLU(), nn.MaxPool1d(4),
            nn.Conv1d(2 * width, 4 * width, 3), nn.BatchNorm1d(4 * width), nn.ReLU(), nn.AdaptiveAvgPool1d(1),
            nn.Flatten(), nn.Linear(4 * width, classes))

    def forward(self, x):
        return self.net(x)


class SqueezeExcite(nn.Module):
    """MobileNetV3's channel attention: a mean over the image, two small linears, hardsigmoid."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce, self.expand = nn.Linear(channels, channels // 4), nn.Linear(channels // 4, channels)

    def forward(self, x):
        scale = F.hardsigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3))))))
        return x * scale[:, :, None, None]


class InvertedResidualSE(nn.Module):
    """MobileNetV3's block: 1x1 expand, 5x5 depthwise, squeeze-excite, 1x1 project; hardswish."""

    def __init__(self, channels: int, expanded: int) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded))
        self.depthwise = nn.Sequential(nn.Conv2d(expanded, expanded, 5, padding=2, groups=expanded, bias=False),
                                       nn.BatchNorm2d(expanded))
        self.se = SqueezeExcite(expanded)
        self.project = nn.Sequential(nn.Conv2d(expanded, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x):
        y = self.se(F.hardswish(self.depthwise(F.hardswish(self.expand(x)))))
        return x + self.project(y)


class MobileNetV3(nn.Module):
    def __init__(self, width: int = 16, expanded: int = 48, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(*[InvertedResidualSE(width, expanded) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(F.hardswish(self.stem(x))).mean((2, 3)))


class ConvNeXtBlock(nn.Module):
    """7x7 depthwise conv, then channels-last LayerNorm, a 4x MLP with GELU and a layer scale."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up, self.down = nn.Linear(channels, 4 * channels), nn.Linear(4 * channels, channels)
        self.scale = nn.Parameter(torch.full((channels,), 0.1))

    def forward(self, x):
        y = self.depthwise(x).permute(0, 2, 3, 1)
        y = self.down(F.gelu(self.up(self.norm(y)))) * self.scale
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 4, stride=4)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class Encoder(nn.Module):
    """nn.TransformerEncoder as its docs use it (post-norm, ReLU, batch_first), mean-pooled."""

    def __init__(self, vocab: int = 50, d: int = 16, heads: int = 2, layers: int = 2, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids)).mean(1))


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on interleaved pairs (x[..., ::2], x[..., 1::2])."""
    t, d = x.shape[-2], x.shape[-1]
    angle = (torch.arange(t, device=x.device).float()[:, None]
             / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))[None])
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


class LlamaBlock(nn.Module):
    """RMSNorm, rotary embeddings, causal scaled-dot-product attention, a SwiGLU MLP, no biases."""

    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.norm1(h)).split(h.shape[-1], -1))
        a = F.scaled_dot_product_attention(_rotary(q), _rotary(k), v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = self.norm2(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class Llama(nn.Module):
    """A LLaMA-style decoder: token embedding, `layers` blocks, a final RMSNorm and an untied
    head. Its strided slices' gradient once read a row early
    (tvmgraph/schedules/offset_floordiv.py)."""

    def __init__(self, vocab: int = 40, width: int = 32, heads: int = 4, hidden: int = 64, layers: int = 1):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, hidden) for _ in range(layers))
        self.norm_out = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm_out(h))


class TCN(nn.Module):
    """A temporal convolutional net: dilated conv1d layers (dilation 1, 2, 4, ...) with residuals."""

    def __init__(self, inputs: int = 4, width: int = 16, levels: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Conv1d(width if i else inputs, width, 3, padding=2 ** i, dilation=2 ** i)
                                    for i in range(levels))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.relu(layer(x)) + (x if i else 0)
        return self.head(x.mean(2))


class AtrousCNN(nn.Module):
    """DeepLab's atrous convolutions: 3x3 convs dilated 2, 4 and 6 at full resolution, with
    residual adds, one of them depthwise (atrous separable), mean-pooled into a classifier."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.atrous = nn.ModuleList(nn.Conv2d(width, width, 3, padding=d, dilation=d) for d in (2, 4))
        self.separable = nn.Sequential(nn.Conv2d(width, width, 3, padding=6, dilation=6, groups=width),
                                       nn.Conv2d(width, width, 1))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for conv in self.atrous:
            x = x + F.relu(conv(x))
        x = x + F.relu(self.separable(x))
        return self.head(x.mean((2, 3)))

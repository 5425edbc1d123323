"""Models outside the suite, in shapes no one tuned tvmgraph for: numbers and speed against eager.

    python -m benchmarks.outside [--cases vgg,unet,vit,gru,lstm,audio,dense,recsys,
                                          mobilenetv3,convnext,encoder,tcn,atrous,llama] [--modes infer,train]
                                 [--compile] [--rounds 7]

A sweep for finding what the suite misses (a ViT's 65 tokens found rows that no vector divides;
docs/benchmarks.md). For each model and mode: the largest difference from eager (inference: the
output, relative to its largest value; training: the loss over three SGD-momentum steps and then
every parameter, each relative to its largest value), eager's and tvmgraph's median time per
call (rounds alternate the engines; with `--compile`, torch.compile's too), the ratio to eager
(below 1.00 is faster) and tvmgraph's first call (trace and compile, a fresh compiled cache).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.engines import LR, MOMENTUM, make_graph
from benchmarks.kernels import timer
from benchmarks.suite import Case
from examples.zoo import TCN, AtrousCNN, AudioConv, ConvNeXt, Encoder, Llama, MobileNetV3, RNNClassifier, ViT


class VGG(nn.Module):
    """VGG-style: 3x3 conv + batch norm + ReLU stages with max pooling, a two-layer head."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (32, "pool", 64, "pool", 128, 128, "pool", 256, 256, "pool"):
            if width == "pool":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(256 * 2 * 2, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        return self.head(self.features(x))


class UNetGN(nn.Module):
    """A small U-Net with GroupNorm and SiLU, nearest and bilinear upsampling."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.SiLU())

        self.down1, self.down2, self.mid = block(3, 16), block(16, 32), block(32, 64)
        self.up2, self.up1 = block(64 + 32, 32), block(32 + 16, 16)
        self.out = nn.Conv2d(16, 3, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(F.max_pool2d(a, 2))
        m = self.mid(F.max_pool2d(b, 2))
        u = self.up2(torch.cat([F.interpolate(m, scale_factor=2, mode="nearest"), b], 1))
        u = self.up1(torch.cat([F.interpolate(u, scale_factor=2, mode="bilinear", align_corners=False), a], 1))
        return self.out(u)


class DenseBlock(nn.Module):
    """DenseNet-style: each layer's output concatenated to its input (channels 24 + 12 i)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 24, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(24 + 12 * i), nn.ReLU(), nn.Conv2d(24 + 12 * i, 12, 3, padding=1, bias=False))
            for i in range(6))
        self.head = nn.Linear(24 + 72, 10)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class RecSys(nn.Module):
    """Eight embedding tables concatenated into an MLP with one logit (a click model)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(5000, 32) for _ in range(8))
        self.mlp = nn.Sequential(nn.Linear(8 * 32, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, ids):
        return self.mlp(torch.cat([table(ids[:, i]) for i, table in enumerate(self.tables)], 1)).squeeze(1)


class _TokenLoss(nn.Module):
    """Cross-entropy over every position of (batch, seq, vocab) logits."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


BATCH = 16
# name: (model, inputs, targets, loss)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Callable[[], torch.Tensor], Callable[[], nn.Module]]] = {
    "vgg": (VGG, lambda: torch.randn(BATCH, 3, 32, 32), lambda: torch.randint(0, 10, (BATCH,)), nn.CrossEntropyLoss),
    "unet": (UNetGN, lambda: torch.randn(4, 3, 64, 64), lambda: torch.randn(4, 3, 64, 64), nn.MSELoss),
    "vit": (lambda: ViT(image=32, patch=4, d=128, heads=4, layers=4, classes=10, activation="gelu"),
            lambda: torch.randn(BATCH, 3, 32, 32), lambda: torch.randint(0, 10, (BATCH,)), nn.CrossEntropyLoss),
    "gru": (lambda: RNNClassifier("gru", vocab=1000, d=64, hidden=128, classes=10, layers=2),
            lambda: torch.randint(0, 1000, (BATCH, 32)), lambda: torch.randint(0, 10, (BATCH,)), nn.CrossEntropyLoss),
    "lstm": (lambda: RNNClassifier("lstm", vocab=1000, d=64, hidden=128, classes=10),
             lambda: torch.randint(0, 1000, (BATCH, 32)), lambda: torch.randint(0, 10, (BATCH,)), nn.CrossEntropyLoss),
    "audio": (AudioConv, lambda: torch.randn(BATCH, 1, 8000), lambda: torch.randint(0, 10, (BATCH,)), nn.CrossEntropyLoss),
    "dense": (DenseBlock, lambda: torch.randn(BATCH, 3, 32, 32), lambda: torch.randint(0, 10, (BATCH,)), nn.CrossEntropyLoss),
    "recsys": (RecSys, lambda: torch.randint(0, 5000, (256, 8)), lambda: torch.rand(256), nn.BCEWithLogitsLoss),
    "mobilenetv3": (lambda: MobileNetV3(width=32, expanded=96, blocks=4), lambda: torch.randn(BATCH, 3, 64, 64), lambda: torch.randint(0, 10, (BATCH,)),
                    nn.CrossEntropyLoss),
    "convnext": (lambda: ConvNeXt(width=64, blocks=3), lambda: torch.randn(BATCH, 3, 64, 64), lambda: torch.randint(0, 10, (BATCH,)),
                 nn.CrossEntropyLoss),
    "encoder": (lambda: Encoder(vocab=1000, d=128, heads=4, layers=2), lambda: torch.randint(0, 1000, (BATCH, 64)), lambda: torch.randint(0, 2, (BATCH,)),
                nn.CrossEntropyLoss),
    "tcn": (lambda: TCN(inputs=16, width=64, levels=4), lambda: torch.randn(BATCH, 16, 256), lambda: torch.randint(0, 5, (BATCH,)), nn.CrossEntropyLoss),
    "atrous": (lambda: AtrousCNN(width=32), lambda: torch.randn(8, 3, 32, 32), lambda: torch.randint(0, 10, (8,)),
               nn.CrossEntropyLoss),
    "llama": (lambda: Llama(vocab=2000, width=256, heads=4, hidden=688, layers=2), lambda: torch.randint(0, 2000, (8, 128)),
              lambda: torch.randint(0, 2000, (8, 128)), _TokenLoss),
}
STEPS = 3  # training steps compared with eager before timing


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / (b.detach().abs().max() + 1e-12))


def _engines(name: str, mode: str, with_compile: bool) -> tuple[dict[str, Callable[[], object]], float, float]:
    """({engine: one call}, largest relative difference from eager, tvmgraph's first call s)."""
    make_model, make_x, make_y, make_loss = CASES[name]
    torch.manual_seed(0)
    model, x, y = make_model(), make_x(), make_y()
    copies = {engine: copy.deepcopy(model) for engine in ("eager", "tvmgraph", "compile")}
    case = Case(name, name, make_model, lambda: (x, y), make_loss)
    graph = make_graph(mode, case, copies["tvmgraph"])  # the suite's graphs: SGD momentum for training
    graph.config.enable_tuning(False)
    if mode == "infer":
        copies["eager"].eval()
        copies["compile"].eval()
        start = time.perf_counter()
        out = graph(x)
        first = time.perf_counter() - start
        with torch.no_grad():
            error = _relative(out, copies["eager"](x))

        def forward(m: Callable) -> Callable[[], object]:
            def call():
                with torch.no_grad():
                    return m(x)
            return call

        calls = {"eager": forward(copies["eager"]), "tvmgraph": lambda: graph(x)}
        if with_compile:
            calls["compile"] = forward(torch.compile(copies["compile"]))
        return calls, error, first

    def eager_step(m: nn.Module) -> Callable[[], torch.Tensor]:
        optimizer, loss_fn = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM), make_loss()

        def step() -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            optimizer.step()
            return loss.detach()
        return step

    eager = eager_step(copies["eager"])
    start = time.perf_counter()
    losses = [graph(x, y)]
    first = time.perf_counter() - start
    losses += [graph(x, y) for _ in range(STEPS - 1)]
    expected = [eager() for _ in range(STEPS)]
    error = max(max(abs(float(a) - float(b)) / abs(float(b)) for a, b in zip(losses, expected)),
                max(_relative(a, b) for a, b in zip(copies["tvmgraph"].parameters(), copies["eager"].parameters())))
    calls = {"eager": eager, "tvmgraph": lambda: graph(x, y)}
    if with_compile:
        compiled = copies["compile"]
        compiled.forward = torch.compile(compiled.forward)
        calls["compile"] = eager_step(compiled)
    return calls, error, first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--compile", action="store_true", help="time torch.compile too")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("TVMGRAPH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmgraph-outside-"))
    for name in args.cases.split(","):
        for mode in args.modes.split(","):
            try:
                calls, error, first = _engines(name, mode, args.compile)
            except Exception as e:  # noqa: BLE001 - a sweep reports a model that fails and goes on
                print(f"{name:7s} {mode:5s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            samplers = {engine: timer(fn, 0.2) for engine, fn in calls.items()}
            times: dict[str, list[float]] = {engine: [] for engine in samplers}
            for _ in range(args.rounds):
                for engine, sample in samplers.items():
                    times[engine].append(sample())
            median = {engine: statistics.median(t) for engine, t in times.items()}
            cells = "  ".join(f"{engine} {median[engine] * 1e3:8.2f} ms ({median[engine] / median['eager']:.2f})"
                              for engine in median)
            print(f"{name:7s} {mode:5s} diff {error:.1e}  {cells}  first call {first:5.1f} s", flush=True)


if __name__ == "__main__":
    main()

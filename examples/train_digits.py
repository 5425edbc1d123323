"""The main job: train a MobileNetV2-style CNN on scikit-learn's digits, in graph mode and in
eager mode, from the same initial weights, and print loss and step time for both.

    python examples/train_digits.py [--epochs N] [--batch B]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvmgraph  # noqa: E402
from examples.digits import batches, digits_tensors  # noqa: E402
from examples.mobilenet import MobileNetV2Small  # noqa: E402

DIGITS_SETTINGS = ((1, 8, 1, 1), (4, 16, 2, 2), (4, 24, 1, 1))


def make_model() -> nn.Module:
    return MobileNetV2Small(in_channels=1, stem=8, last=64, settings=DIGITS_SETTINGS, dropout=0.1)


def make_optimizer(model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)


class TrainGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(optimizer, lr_sch=scheduler)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def eager_step(model, loss_fn, optimizer, scheduler, x, y) -> torch.Tensor:
    loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.detach()


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        acc = (model(images).argmax(1) == labels).float().mean().item()
    model.train()
    return acc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    images, labels = digits_tensors()
    steps = args.epochs * (len(images) // args.batch)
    graph_model = make_model()
    eager_model = copy.deepcopy(graph_model)
    graph = TrainGraph(graph_model, *make_optimizer(graph_model, steps))
    eager_opt, eager_sch = make_optimizer(eager_model, steps)
    loss_fn = nn.CrossEntropyLoss()
    print(f"MobileNetV2-style CNN, {sum(p.numel() for p in graph_model.parameters())} parameters; "
          f"digits: {len(images)} images 1x8x8, batch {args.batch}, {steps} steps")

    data = torch.Generator().manual_seed(0)
    first = batches(images, labels, args.batch, data)[0]
    start = time.perf_counter()
    graph(*first)
    print(f"graph: first call (trace + lower + autodiff + compile + one step) {time.perf_counter() - start:.1f} s")
    eager_step(eager_model, loss_fn, eager_opt, eager_sch, *first)

    for epoch in range(args.epochs):
        times = {"graph": 0.0, "eager": 0.0}
        losses = {"graph": 0.0, "eager": 0.0}
        epoch_batches = batches(images, labels, args.batch, data)
        if epoch == 0:
            epoch_batches = epoch_batches[1:]  # the first batch already ran above
        for x, y in epoch_batches:
            start = time.perf_counter()
            losses["graph"] += graph(x, y).item()
            times["graph"] += time.perf_counter() - start
            start = time.perf_counter()
            losses["eager"] += eager_step(eager_model, loss_fn, eager_opt, eager_sch, x, y).item()
            times["eager"] += time.perf_counter() - start
        n = len(epoch_batches)
        print(f"epoch {epoch + 1}: "
              + "  ".join(f"{k} loss {losses[k] / n:.4f} step {times[k] / n * 1e3:6.2f} ms" for k in ("graph", "eager")))
    print(f"training accuracy: graph {accuracy(graph_model, images, labels):.4f}, "
          f"eager {accuracy(eager_model, images, labels):.4f}")


if __name__ == "__main__":
    main()

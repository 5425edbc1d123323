"""Mixed precision, gradient accumulation and activation checkpointing together, on scikit-learn's digits.

    python examples/train_amp_accum.py [--epochs N] [--batch B] [--micro-batches N]

The MobileNetV2-style CNN of examples/train_digits.py trains in one graph with:
- `config.enable_amp(True)`: build() runs under torch.autocast's policy (bfloat16 on CPU),
  float32 master weights and optimizer state;
- `config.set_gradient_accumulation_steps(n)`: each call takes a batch of B images and runs it
  as n micro-batches, one optimizer step per call;
- `graph.model.features.to(tvmgraph.nn.GraphModule).activation_checkpointing = True`: the
  features' activations are recomputed in the backward pass instead of kept.
bfloat16 has float32's exponent range, so no loss scaling is needed on CPU (docs/training.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvmgraph  # noqa: E402
from examples.digits import batches, digits_tensors  # noqa: E402
from examples.train_digits import accuracy, make_model, make_optimizer  # noqa: E402


class TrainGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, micro_batches: int):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(optimizer, lr_sch=scheduler)
        self.config.enable_amp(True)
        self.config.set_gradient_accumulation_steps(micro_batches)
        self.model.features.to(tvmgraph.nn.GraphModule).activation_checkpointing = True

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    images, labels = digits_tensors()
    steps = args.epochs * (len(images) // args.batch)
    model = make_model()
    graph = TrainGraph(model, *make_optimizer(model, steps), args.micro_batches)
    print(f"digits: {len(images)} images, batch {args.batch} as {args.micro_batches} micro-batches, {steps} steps; "
          f"bfloat16 autocast, features checkpointed")
    data = torch.Generator().manual_seed(0)
    for epoch in range(args.epochs):
        start, total, epoch_batches = time.perf_counter(), 0.0, batches(images, labels, args.batch, data)
        for x, y in epoch_batches:
            total += graph(x, y).item()
        print(f"epoch {epoch + 1}: loss {total / len(epoch_batches):.4f} ({time.perf_counter() - start:.1f} s)")
    print(f"training accuracy: {accuracy(model, images, labels):.4f} (float32 eager evaluation)")


if __name__ == "__main__":
    main()

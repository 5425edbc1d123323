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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvmgraph  # noqa: E402
from examples.digits import batches, digits_tensors  # noqa: E402
from examples.train_digits import TrainGraph, accuracy, make_model, make_optimizer  # noqa: E402


def configure(graph: TrainGraph, micro_batches: int) -> TrainGraph:
    """The digits graph of train_digits.py, with the three options on."""
    graph.config.enable_amp(True)
    graph.config.set_gradient_accumulation_steps(micro_batches)
    graph.model.features.to(tvmgraph.nn.GraphModule).activation_checkpointing = True
    return graph


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
    graph = configure(TrainGraph(model, *make_optimizer(model, steps)), args.micro_batches)
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

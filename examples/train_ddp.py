"""Graph training over torch.distributed with torchrun: data parallel, ZeRO, or pipeline stages.

    torchrun --nproc_per_node 2 examples/train_ddp.py [--epochs N] [--batch B] [--zero | --pipeline]

The graph is written exactly as for one process; in a process group of two or more ranks each
rank trains on its shard of every global batch and the graph all-reduces its gradients through
torch.distributed (docs/distributed.md). `--zero` shards the optimizer state over the ranks (ZeRO
stage 1). `--pipeline` (2 ranks) instead runs the model's features on rank 0 and its classifier
on rank 1, the whole batch flowing through them as 4 micro-batches (GPipe). Data:
scikit-learn's digits (no download).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvmgraph  # noqa: E402
from examples.digits import batches, digits_tensors  # noqa: E402
from examples.train_digits import accuracy, make_model  # noqa: E402


class TrainGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    parser.add_argument("--zero", action="store_true", help="shard the optimizer state (ZeRO stage 1)")
    parser.add_argument("--pipeline", action="store_true", help="two pipeline stages instead of data parallel")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # share the machine's cores fairly
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} ranks")

    torch.manual_seed(0)  # the graph broadcasts rank 0's weights anyway
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    graph = TrainGraph(model, optimizer)
    graph.config.enable_zero(args.zero)
    if args.pipeline:  # stage 0: features (and the pooling after them); stage 1: classifier and loss
        graph.model.features.to(tvmgraph.nn.GraphModule).set_stage(0, placement=0)
        graph.model.classifier.to(tvmgraph.nn.GraphModule).set_stage(1, placement=1)
        graph.config.set_gradient_accumulation_steps(4)  # the micro-batches of the pipeline

    images, labels = digits_tensors()
    generator = torch.Generator().manual_seed(1)  # the same shuffles on every rank
    for epoch in range(args.epochs):
        start, losses = time.perf_counter(), []
        for x, y in batches(images, labels, args.batch, generator):
            if args.pipeline:  # every rank takes the whole batch; the loss comes from the last stage
                losses.append(float(graph(x, y)))
                continue
            shard = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
            losses.append(float(graph(x[shard], y[shard])))
        mean = torch.tensor(sum(losses) / len(losses))
        dist.all_reduce(mean)
        if rank == 0:
            print(f"epoch {epoch}: loss {float(mean) / world:.4f}, {time.perf_counter() - start:.2f} s")
    if args.pipeline:  # a collective: brings each stage's trained parameters to every rank
        graph.state_dict()
    if rank == 0:
        print(f"accuracy on the training images: {accuracy(model, images, labels):.3f} ({world} ranks)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

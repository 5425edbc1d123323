"""What a graph call costs beyond its compiled program, on tiny inputs.

    python -m benchmarks.overhead

For a tiny inference graph (Linear 4->4 on one row) and a tiny training graph (the same with
SGD momentum), prints the median time of a full `graph(...)` call, of the compiled program
alone (the VM entry called with ready arguments: kernels plus VM dispatch), and the difference:
tvmgraph's Python-side overhead per call (signature, argument flattening, parameter binding,
optimizer state and hyperparameters, write-back).

Then two costs of safety checks: the same inference call with an aligned input and with a
misaligned view of one (which is copied first, tvmgraph/inputs.py), and, for an embedding over
64 int64 ids, the share of a call spent checking the ids' range (tvmgraph/index_guard.py).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import tvmgraph


class Infer(tvmgraph.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


class Train(tvmgraph.nn.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def build(self, x, y):
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def median_us(fn, calls: int = 2000, rounds: int = 7) -> float:
    for _ in range(200):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(1, 4), torch.randn(1, 4)
    for name, graph, args in (("inference", Infer(nn.Linear(4, 4)), (x,)), ("training", Train(nn.Linear(4, 4)), (x, y))):
        graph(*args)
        entry = graph.compiled
        inputs = list(args)
        ready = [*inputs, *entry.binder.tensors(), *(entry.training.inputs() if entry.training else [])]
        total = median_us(lambda: graph(*args))
        program = median_us(lambda: entry._entry(*ready))
        print(f"{name:>9}: graph call {total:6.1f} us, compiled program alone {program:5.1f} us, "
              f"overhead {total - program:5.1f} us")

    graph = Infer(nn.Linear(4, 4))
    misaligned = torch.randn(17)[1:5].view(1, 4)  # a 4-byte offset view: copied before each call
    graph(x)
    aligned_us, misaligned_us = median_us(lambda: graph(x)), median_us(lambda: graph(misaligned))
    print(f"{'layout':>9}: graph call with an aligned input {aligned_us:6.1f} us, with a misaligned view "
          f"{misaligned_us:6.1f} us (copy {misaligned_us - aligned_us:5.1f} us)")

    graph, ids = Infer(nn.Embedding(10, 4)), torch.randint(0, 10, (64,))
    graph(ids)
    guard = graph.compiled._index_guard
    total, check = median_us(lambda: graph(ids)), median_us(lambda: guard.check([ids]))
    print(f"{'index':>9}: embedding graph call {total:6.1f} us, of which the id range check {check:5.1f} us")


if __name__ == "__main__":
    main()

"""A dynamic-batch graph (config.enable_dynamic_batch()) against the static graph and eager.

    python -m benchmarks.dynamic_batch [--cases mlp_b64,cnn] [--modes infer,train]
                                       [--sizes 1,7,64,300] [--seconds 2]

For each case of the suite (benchmarks/suite.py) and mode: the median time of one call at
batch 64 of the static graph (compiled for batch 64) and of the dynamic graph (one program for
every batch), timed in interleaved rounds, their ratio (the target: dynamic within 10% of
static), then the dynamic graph
and eager at the other `--sizes`, all run by the dynamic graph's one program. Training steps
the same model in place (the numbers are only timed). Cases or modes a dynamic batch does not
cover yet (training through a flatten or a batch norm, docs/training.md) print why and go on.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import tvmgraph
from tvmgraph.errors import TvmGraphError

from .suite import CASES

REFERENCE_BATCH = 64


class Infer(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, dynamic: bool):
        super().__init__()
        self.model = model
        self.config.enable_dynamic_batch(dynamic)

    def build(self, x, y):
        return self.model(x)


class Train(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module, loss_fn: nn.Module, dynamic: bool):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
        self.config.enable_dynamic_batch(dynamic)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def median_ms(fn: Callable[[], object], seconds: float, rounds: int = 5) -> float:
    """Median over `rounds` of the mean call time, each round about `seconds / rounds` long."""
    return interleaved_median_ms([fn], seconds, rounds)[0]


def interleaved_median_ms(fns: list[Callable[[], object]], seconds: float, rounds: int = 9) -> list[float]:
    """Median per-call time of each of `fns`, over `rounds` rounds that run each in turn for
    about `seconds / rounds` (so that all see the same machine: this VM's speed drifts by 15%)."""
    calls = []
    for fn in fns:
        start = time.perf_counter()
        fn()  # warm-up (and the compile, for a graph's first call)
        calls.append(max(1, int(seconds / rounds / max(time.perf_counter() - start, 1e-6))))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, n, out in zip(fns, calls, samples):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - start) / n * 1e3)
    return [statistics.median(s) for s in samples]


def batch_of(case_name: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's inputs with `size` rows (the suite fixes the batch; the rest of the shape is kept)."""
    x, y = CASES[case_name].inputs()
    return x[:1].repeat(size, *[1] * (x.dim() - 1)), y[:1].repeat(size, *[1] * (y.dim() - 1))


def eager_fn(case_name: str, mode: str, model: nn.Module, args: tuple) -> Callable[[], object]:
    if mode == "infer":
        def infer() -> object:
            with torch.no_grad():
                return model(args[0])
        return infer
    loss_fn = CASES[case_name].loss_fn()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> object:
        optimizer.zero_grad()
        loss = loss_fn(model(args[0]), args[1])
        loss.backward()
        optimizer.step()
        return loss
    return step


def graph_of(case_name: str, mode: str, dynamic: bool) -> tvmgraph.nn.Graph:
    case = CASES[case_name]
    model = case.make_model().train(mode == "train")
    return Infer(model, dynamic) if mode == "infer" else Train(model, case.loss_fn(), dynamic)


def run(case_name: str, mode: str, sizes: list[int], seconds: float) -> None:
    torch.manual_seed(0)
    reference = batch_of(case_name, REFERENCE_BATCH)
    try:
        static, dynamic = graph_of(case_name, mode, False), graph_of(case_name, mode, True)
        static(*reference), dynamic(*reference)  # compile both before timing
        static_ms, dynamic_ms = interleaved_median_ms([lambda: static(*reference), lambda: dynamic(*reference)],
                                                      2 * seconds)
    except TvmGraphError as e:
        print(f"{case_name:>12} {mode:>5}: not covered: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        return
    print(f"{case_name:>12} {mode:>5}: batch {REFERENCE_BATCH}: static {static_ms:8.3f} ms, dynamic "
          f"{dynamic_ms:8.3f} ms ({dynamic_ms / static_ms:5.2f}x static)")
    for size in sizes:
        args = batch_of(case_name, size)
        eager_model = graph_of(case_name, mode, True).model  # a fresh model of the case
        eager_ms = median_ms(eager_fn(case_name, mode, eager_model, args), seconds)
        graph_ms = median_ms(lambda: dynamic(*args), seconds)
        print(f"{'':>12} {'':>5}  batch {size:>4}: dynamic {graph_ms:8.3f} ms, eager {eager_ms:8.3f} ms "
              f"({graph_ms / eager_ms:5.2f}x eager)")
    assert dynamic.num_compiled == 1, "the dynamic graph compiled more than one program"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mlp_b64,cnn,transformer")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--sizes", default="1,7,64,300")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    for case_name in args.cases.split(","):
        for mode in args.modes.split(","):
            run(case_name, mode, sizes, args.seconds)


if __name__ == "__main__":
    main()

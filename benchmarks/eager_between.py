"""A loop as users write it: a little eager torch work before each call.

    python -m benchmarks.eager_between [--cases mlp_b64,cnn,transformer] [--modes infer,train]

Each step first turns a uint8 batch into the model's float input in eager torch (`x / 255 -
0.5`, a few microseconds, enough for torch to wake its OpenMP threads), then runs the engine.
Engines: eager, `torch.compile`, tvmgraph (kernels on torch's OpenMP threads,
tvmgraph/openmp_launch.py) and `tvmgraph_own_pool` (the same graph on TVM's own thread pool,
as before that launcher and as with TVMGRAPH_OPENMP_THREADS=0). Prints the median time of a
step and its ratio to eager's; rounds rotate through the engines, each timing a block of steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tvmgraph.config import settings

from .engines import make_step
from .suite import CASES

ENGINES = ("eager", "compile", "tvmgraph", "tvmgraph_own_pool")


def _stepper(engine: str, mode: str, case_name: str):
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    x, y = case.inputs()
    raw = (torch.rand_like(x) * 255).to(torch.uint8)
    step = make_step("tvmgraph" if engine == "tvmgraph_own_pool" else engine, mode, case, model)

    def prepared_step():
        return step(raw / 255.0 - 0.5, y)

    # A program run from memory (the compiled cache off) keeps TVM's pool. Not
    # TVMGRAPH_OPENMP_THREADS=0: both graphs would load the one cached library, whose launcher
    # is the last load's.
    own_pool = engine == "tvmgraph_own_pool"
    object.__setattr__(settings, "compile_cache", not own_pool)  # benchmark only: settings are frozen
    try:
        prepared_step()  # the first call compiles (or loads) the program
    finally:
        object.__setattr__(settings, "compile_cache", True)
    return prepared_step


def _block(step, seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while True:
        step()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp_b64,cnn,transformer")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=0.3)
    args = parser.parse_args()
    engines = args.engines.split(",")
    print(f"torch {torch.__version__} with {torch.get_num_threads()} threads; median of {args.rounds} rounds "
          f"of ~{args.seconds} s per engine; each step = eager preprocessing + the engine's call")
    print(f"{'case':<12} {'mode':<6} " + " ".join(f"{e:>18}" for e in engines))
    for case_name in args.cases.split(","):
        for mode in args.modes.split(","):
            steps = {engine: _stepper(engine, mode, case_name) for engine in engines}
            times: dict[str, list[float]] = {engine: [] for engine in engines}
            for r in range(args.rounds):
                for engine in engines[r % len(engines):] + engines[:r % len(engines)]:
                    times[engine].append(_block(steps[engine], args.seconds))
            medians = {engine: statistics.median(t) for engine, t in times.items()}
            eager = medians.get("eager")
            cells = [f"{medians[e] * 1e3:8.2f} ms" + (f" {medians[e] / eager:4.2f}x" if eager else "")
                     for e in engines]
            print(f"{case_name:<12} {mode:<6} " + " ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

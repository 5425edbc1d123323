"""Compile time of the CNN training graph, and how fast a second process is ready.

    python -m benchmarks.compile_time [--case cnn] [--mode train]

Runs three fresh interpreters against an empty compiled cache: the first traces, lowers,
compiles and stores the program; the second and third build the same graph and load it from
the cache. Each reports the seconds from creating the graph to the end of its first call
(interpreter start-up and `import torch` excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, sys, time, torch
    from benchmarks.engines import make_step
    from benchmarks.suite import CASES
    case = CASES[sys.argv[1]]
    torch.manual_seed(0)
    model = case.make_model()
    x, y = case.inputs()
    start = time.perf_counter()
    step = make_step("tvmgraph", sys.argv[2], case, model)
    step(x, y)
    print(json.dumps({"seconds": time.perf_counter() - start}))
""")


def run_child(case: str, mode: str, cache_dir: str) -> float:
    env = dict(os.environ, TVMGRAPH_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD, case, mode], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", default="cnn")
    parser.add_argument("--mode", default="train", choices=["infer", "train"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tvmgraph-compile-time-") as cache_dir:
        first = run_child(args.case, args.mode, cache_dir)
        again = [run_child(args.case, args.mode, cache_dir) for _ in range(2)]
    print(f"{args.case} {args.mode}: first process (trace + lower + compile + first step) {first:.2f} s; "
          f"second process (trace + load from cache + first step) {again[0]:.2f} s, third {again[1]:.2f} s")


if __name__ == "__main__":
    main()

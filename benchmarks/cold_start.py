"""Cold start of a saved graph: `tvmgraph.load` plus the first call, in a fresh process.

    python -m benchmarks.cold_start [--case cnn|small_cnn] [--runs 5] [--numpy] [--runtime-lib]

Saves a CNN in eval mode once (`cnn`: the benchmark suite's MobileNetV2-style CNN, batch 64,
3x32x32; `small_cnn`: the test suite's, batch 2, 3x16x16), then starts a fresh
Python process per run that imports tvmgraph, loads the directory and calls it once. Reported
per run: the time from the child's first line to the end of its first call (Python's own start
is excluded; importing tvmgraph and TVM is included), split into import, load and first call.
With --numpy the child passes numpy arrays and never imports torch; without it, torch tensors
(torch's import is then counted). Note that tvm-ffi imports torch by itself whenever torch is
installed, so only a venv without torch shows the torch-free start. --runtime-lib sets
TVM_USE_RUNTIME_LIB=1 (TVM loads its runtime library only, as a serving process should).
Numbers mean something only on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import time
t0 = time.perf_counter()
import sys, json
import numpy as np
if not {numpy}:
    import torch
import tvmgraph
t1 = time.perf_counter()
graph = tvmgraph.load(sys.argv[1])
t2 = time.perf_counter()
x = np.zeros(graph.inputs[0]["shape"], dtype=np.float32)
graph(x if {numpy} else torch.from_numpy(x))
t3 = time.perf_counter()
print(json.dumps({{"import": t1 - t0, "load": t2 - t1, "first_call": t3 - t2, "total": t3 - t0}}))
"""


def save_cnn(path: Path, case: str) -> Path:
    import torch

    import tvmgraph
    from benchmarks.suite import CASES
    from tests.conftest import ModuleGraph
    from tests.models import SmallCNN

    torch.manual_seed(0)
    if case == "cnn":
        model, x = CASES["cnn"].make_model(), CASES["cnn"].inputs()[0]
    else:
        model, x = SmallCNN(), torch.randn(2, 3, 16, 16)
    return tvmgraph.save(ModuleGraph(model.eval()), path, example_args=(x,))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=("cnn", "small_cnn"), default="cnn")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--numpy", action="store_true", help="numpy inputs: the child never imports torch")
    parser.add_argument("--runtime-lib", action="store_true", help="TVM_USE_RUNTIME_LIB=1 in the child")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tvmgraph-cold-start-") as tmp:
        path = save_cnn(Path(tmp) / "cnn", args.case)
        child = CHILD.format(numpy=args.numpy)
        runs = []
        for _ in range(args.runs):
            env = {**os.environ, **({"TVM_USE_RUNTIME_LIB": "1"} if args.runtime_lib else {})}
            done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True,
                                  check=True, env=env)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for key in ("import", "load", "first_call", "total"):
        values = [r[key] for r in runs]
        print(f"{key:<11} median {statistics.median(values) * 1e3:8.1f} ms   min {min(values) * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where one suite case's compiled call spends its time, kernel by kernel (`graph.profile`), on
the CPU or a GPU.

    python -m benchmarks.profile --cases cnn,resnet18 --modes train [--device cuda] [--top 15]

Untuned: the default schedules only. On the CPU each kernel's share of the machine's limits is
shown; on a GPU the kernels' times (the device synchronized around each) without shares.
"""

from __future__ import annotations

import argparse

import torch

from . import engines
from .suite import CASES


def graph_for(case_name: str, mode: str, device: str):
    """The case's untuned inference or training graph and its inputs, on `device`."""
    case = CASES[case_name]
    torch.manual_seed(0)
    engines.DEVICE = device
    graph = engines.make_graph(mode, case, case.make_model().to(device))
    graph.config.enable_tuning(False)
    x, y = (t.to(device) for t in case.inputs())
    return graph, ((x,) if mode in engines.INFERENCE_MODES else (x, y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="cnn")
    parser.add_argument("--modes", default="train")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--top", type=int, default=15, help="kernels shown per graph, slowest first")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for case in args.cases.split(","):
        for mode in args.modes.split(","):
            graph, inputs = graph_for(case, mode, args.device)
            print(graph.profile(*inputs, repeat=args.repeat).table(top=args.top), "\n", flush=True)


if __name__ == "__main__":
    main()

"""Distributed training throughput: one process against two gloo ranks on the same machine.

    python -m benchmarks.distributed [--cases mlp_b64,cnn] [--steps 30] [--threads 2]

For each case of the suite, the same global batch is trained for `--steps` steps (after 3 warm-up
steps) by
- `1 proc`: one process with `--threads` threads, the whole batch per step (no communication);
- `2 ranks`: two processes with `--threads / 2` threads each, half the batch each, gradients
  all-reduced through torch.distributed (gloo on 127.0.0.1);
- `2 ranks ZeRO 1` and `ZeRO 2`: the same with `enable_zero(True, stage=1 or 2)`;
- `2 stages`: two pipeline stages (`set_stage`), one per rank with `--threads / 2` threads, the
  whole batch as 4 micro-batches (GPipe).
It prints samples per second, the share of a step spent in the gradient all-reduce (and ZeRO's
parameter broadcasts; for the pipeline, in send/recv, waiting for the other stage included), and
the optimizer state each rank keeps. On one machine two ranks share
its cores, so they cannot beat one process: the row measures the cost of data parallelism
(communication, per-rank overhead), the part that stays when each rank has a machine of its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# Where each case's model is cut into two pipeline stages (the rest follows its inputs' stage).
STAGES = {"mlp_b64": ("model.0", "model.2"), "cnn": ("model.features", "model.classifier")}
MICRO_BATCHES = 4


def _set_stages(graph: object, case: str) -> None:
    import tvmgraph

    for stage, path in enumerate(STAGES[case]):
        module = graph
        for name in path.split("."):
            module = module[int(name)] if name.isdigit() else getattr(module, name)
        module.to(tvmgraph.nn.GraphModule).set_stage(stage, stage)
    graph.config.set_gradient_accumulation_steps(MICRO_BATCHES)


def _rank_main(case_name: str, rank: int, world: int, port: int, steps: int, zero: int, pipeline: bool) -> None:
    import torch
    import torch.distributed as dist

    from .engines import _TrainGraph
    from .suite import CASES

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    graph = _TrainGraph(model, case.loss_fn(), optimizer)
    graph.config.enable_zero(zero > 0, stage=max(zero, 1))
    x, y = case.inputs()
    if pipeline:  # every rank takes the whole batch
        _set_stages(graph, case_name)
    else:
        x, y = x.chunk(world)[rank].contiguous(), y.chunk(world)[rank].contiguous()
    for _ in range(3):
        graph(x, y)
    parallel = graph._state().data_parallel or graph._state().pipeline
    comm_before = parallel.comm_seconds if parallel is not None else 0.0
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        graph(x, y)
        times.append(time.perf_counter() - start)
    comm = ((parallel.comm_seconds - comm_before) / steps) if parallel is not None else 0.0
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t))
    if rank == 0:
        print(json.dumps({"step_s": statistics.median(times), "comm_s": comm, "state_bytes": state_bytes,
                          "batch": int(x.shape[0]) * (1 if pipeline else world)}))
    if world > 1:  # torch's teardown of a gloo group sometimes aborts the process: leave without it
        dist.barrier()
        sys.stdout.flush()
        os._exit(0)


def _run(case: str, world: int, threads: int, steps: int, zero: int, pipeline: bool = False) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_rank = str(max(1, threads // world))
    env = {**os.environ, "OMP_NUM_THREADS": per_rank, "TVM_NUM_THREADS": per_rank}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.distributed", "--rank", str(r), "--world", str(world),
                               "--port", str(port), "--cases", case, "--steps", str(steps), "--zero", str(zero)]
                              + (["--pipeline"] if pipeline else []),
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{case}: a rank failed ({[p.returncode for p in procs]})")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp_b64,cnn")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank_main(args.cases, args.rank, args.world, args.port, args.steps, args.zero, args.pipeline)
        return
    print(f"{'case':<12} {'setup':<14} {'samples/s':>10} {'step ms':>8} {'comm':>6} {'opt. state/rank':>16}")
    for case in args.cases.split(","):
        for label, world, zero, pipeline in (("1 proc", 1, 0, False), ("2 ranks", 2, 0, False),
                                             ("2 ranks ZeRO 1", 2, 1, False), ("2 ranks ZeRO 2", 2, 2, False),
                                             ("2 stages", 2, 0, True)):
            r = _run(case, world, args.threads, args.steps, zero, pipeline)
            print(f"{case:<12} {label:<14} {r['batch'] / r['step_s']:10.0f} {r['step_s'] * 1e3:8.2f} "
                  f"{r['comm_s'] / r['step_s'] * 100:5.1f}% {r['state_bytes'] / 2**20:13.2f} MiB", flush=True)


if __name__ == "__main__":
    main()

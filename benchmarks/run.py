"""Run the reference suite: torch eager, torch.compile and tvmgraph, interleaved in one run.

    python -m benchmarks.run [--cases mlp_b1,mlp_b64,cnn,transformer,resnet18,mlp_large,gpt,vit] [--modes infer,infer_amp,train,train_amp]
                             [--engines eager,compile,tvmgraph,frozen,tuned] [--rounds 15] [--seconds 0.2]
                             [--tune-trials N] [--tune-minutes M]
                             [--no-memory] [--warm-caches] [--json results.json] [--device cpu|cuda]

`tvmgraph` is untuned (default schedules), `frozen` the same with its weights packed once
(`enable_frozen_weights`, inference rows only); `tuned` tunes each graph first (`tvmgraph.tune`,
default budget: 32 trials per kernel worth tuning) and prints the trials and tuning minutes.
Mode `train_amp` is the training step in bfloat16 mixed precision with a GradScaler, and
`infer_amp` the inference call in bfloat16 mixed precision (engines.py), to compare with the
float32 `train` and `infer` rows.
For every case and mode it prints the median time per call of each engine, its ratio to eager
(below 1.00 is faster than eager), the first-call (compile) time, and the peak memory of the
steady-state step. Timing rounds rotate through the engines so that all three see the same
machine conditions. Peak memory is measured in a fresh subprocess per engine (see memory.py);
with tvmgraph among the engines, two more rows compare the CNN's training step at batch 256 with
4 accumulation micro-batches against batch 64 without accumulation (memory.py, accumulation_rows).

The first-call column is a cold compile for both compilers: unless `--warm-caches` is given,
tvmgraph's compiled cache and TorchInductor's caches point at a fresh temporary directory (set
before either library is imported; the memory subprocesses inherit them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

if __name__ == "__main__" and "--warm-caches" not in sys.argv:
    _fresh = tempfile.mkdtemp(prefix="tvmgraph-bench-")
    os.environ["TVMGRAPH_CACHE_DIR"] = os.path.join(_fresh, "tvmgraph")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_fresh, "inductor")

import torch  # noqa: E402  (after the cache directories are chosen)

from . import engines as engine_setup  # noqa: E402
from .engines import ENGINES, INFERENCE_MODES, INFERENCE_ONLY, MODES, make_step  # noqa: E402
from .memory import accumulation_rows, checkpointing_row, format_checkpointing_row, measure_peak_memory  # noqa: E402
from .suite import CASES  # noqa: E402


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from tvmgraph.target import host_cpu

    return (f"{cpu} (LLVM: {host_cpu()}), {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def time_case(case_name: str, mode: str, engines: list[str], rounds: int, seconds: float) -> dict:
    case = CASES[case_name]
    torch.manual_seed(0)
    model = case.make_model()
    x, y = (t.to(engine_setup.DEVICE) for t in case.inputs())
    sync = torch.cuda.synchronize if engine_setup.DEVICE == "cuda" else (lambda: None)
    steps, compile_s = {}, {}
    for engine in engines:
        step = make_step(engine, mode, case, model)
        start = time.perf_counter()
        step(x, y)  # first call: compiles for compile/tvmgraph
        sync()
        compile_s[engine] = time.perf_counter() - start
        step(x, y)
        steps[engine] = step
    # calls per timing block, so that one block lasts about `seconds` on the slowest engine
    per_call = {}
    for engine, step in steps.items():
        sync()
        start = time.perf_counter()
        step(x, y)
        sync()
        per_call[engine] = time.perf_counter() - start
    calls = max(1, int(seconds / max(per_call.values())))
    samples: dict[str, list[float]] = {e: [] for e in engines}
    for r in range(rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for engine in order:
            step = steps[engine]
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                step(x, y)
            sync()
            samples[engine].append((time.perf_counter() - start) / calls)
    medians = {e: statistics.median(s) for e, s in samples.items()}
    return {"case": case_name, "mode": mode, "calls_per_block": calls, "median_s": medians,
            "compile_s": compile_s, "samples_s": samples}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.2, help="target duration of one timing block")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--warm-caches", action="store_true",
                        help="keep tvmgraph's and TorchInductor's usual cache directories (first calls may hit them)")
    parser.add_argument("--json", help="also write all results to this file")
    parser.add_argument("--tune-trials", type=int, help="trials per graph for the tuned engine (default: 32 per kernel)")
    parser.add_argument("--tune-minutes", type=float, help="tuning time budget per graph")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="run models and inputs on this device (cuda: peak memory is not measured)")
    args = parser.parse_args(argv)
    engines = args.engines.split(",")
    engine_setup.DEVICE = args.device
    if args.device == "cuda":
        args.no_memory = True  # memory.py measures host memory in subprocesses
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 for all
    engine_setup.TUNE = {"trials": args.tune_trials, "minutes": args.tune_minutes}
    fma_peak = None
    if "tuned" in engines and args.device == "cpu":
        from .peak import fma_peak_gflops

        fma_peak = fma_peak_gflops()
        print(f"fp32 FMA peak (benchmarks/peak.py): {fma_peak:.1f} GFLOP/s")
    print(f"machine: {machine()}")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, TF32 off for eager and torch.compile")
    header = f"{'case':<12} {'mode':<9} {'engine':<9} {'median':>10} {'x eager':>8} {'first call':>11} {'peak MiB':>9}"
    print(header)
    print("-" * len(header))
    results = []
    for case_name in args.cases.split(","):
        for mode in args.modes.split(","):
            used = [e for e in engines if mode in INFERENCE_MODES or e not in INFERENCE_ONLY]
            result = time_case(case_name, mode, used, args.rounds, args.seconds)
            if not args.no_memory:
                result["peak_bytes"] = {e: measure_peak_memory(case_name, mode, e) for e in used}
            results.append(result)
            eager = result["median_s"].get("eager")
            for engine in used:
                median = result["median_s"][engine]
                ratio = f"{median / eager:8.2f}" if eager else f"{'-':>8}"
                peak = result.get("peak_bytes", {}).get(engine)
                peak_text = f"{peak / 2**20:9.1f}" if peak is not None else f"{'-':>9}"
                print(f"{case_name:<12} {mode:<9} {engine:<9} {median * 1e3:8.3f}ms {ratio} "
                      f"{result['compile_s'][engine]:10.2f}s {peak_text}", flush=True)
            if not args.no_memory and case_name == "transformer" and mode == "train" and "tvmgraph" in engines:
                for engine in [e for e in ("eager", "tvmgraph") if e in engines]:
                    print(format_checkpointing_row(case_name, *checkpointing_row(case_name, engine), engine=engine),
                          flush=True)
            report = engine_setup.TUNE_REPORTS.get(f"{case_name} {mode}")
            if report is not None:
                print(f"{'':<12} {'':<9} tuned with {report.trials} trials in {report.seconds / 60:.1f} min, "
                      f"{sum(k.use_tuned for k in report.kernels)} kernel(s) from the log", flush=True)
                if args.device == "cuda":  # no FMA peak measured: the report's kernel table
                    print(report.table(), flush=True)
                for k in report.kernels:
                    if k.flops >= 1e8 and k.default_us and fma_peak:
                        best = min(k.default_us, k.tuned_us or k.default_us)
                        print(f"{'':<12} {'':<9}   {k.name[:48]:<48} {k.flops / best / 1e3:7.1f} GFLOP/s "
                              f"({k.flops / best / 1e3 / fma_peak:4.0%} of peak; default "
                              f"{k.flops / k.default_us / 1e3 / fma_peak:4.0%})", flush=True)
    accumulation = {}
    if not args.no_memory and "tvmgraph" in engines:
        accumulation = accumulation_rows()
        for row, peak in accumulation.items():
            peak_text = f"{peak / 2**20:9.1f}" if peak is not None else f"{'-':>9}"
            print(f"{'cnn':<12} {'train':<6} {'tvmgraph':<9} {row:<32} {peak_text} MiB peak", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "results": results, "accumulation_peak_bytes": accumulation}, f,
                      indent=1)


if __name__ == "__main__":
    main()

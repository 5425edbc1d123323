"""Peak memory of one steady-state step, measured in a fresh process.

The child first runs the engine once on a tiny model (so that what any use of the engine costs
once per process, imported modules, thread pools, torch.export's and torch.compile's caches,
is not charged to the case), then builds the model, its optimizer and the engine, reads the
RSS, runs one call (torch.compile compiles there, tvmgraph loads its program, the optimizer
creates its state), resets the kernel's peak-RSS counter (`/proc/self/clear_refs` <- 5) so that
the first call's transient peak is not counted, runs a few more calls and reports
`VmHWM - RSS before the first call`: everything a steady-state step adds to the weights, at its peak
(activations, gradients, optimizer state, for tvmgraph the compiled program and its workspace).
The parent has already run the case, so tvmgraph's child loads the program from the persistent
compiled cache instead of compiling it.

So that RSS follows live tensors for every engine, the child runs with glibc's mmap threshold
fixed at 64 KiB (large blocks are returned to the kernel when freed; the default threshold
adapts upwards and keeps them) and with TVM's "naive" VM allocator (blocks freed after each
call instead of pooled). Both change where memory is cached, not how much a step uses.

`accumulation_rows` compares gradient accumulation with its micro-batch: a tvmgraph training
step over `steps` x the micro-batch with `set_gradient_accumulation_steps(steps)` against one
over the micro-batch alone (batch 256 with n = 4 against batch 64; the target is within 20%).
`checkpointing_row` measures a transformer's training step with and without activation
checkpointing of its encoder layers, in tvmgraph (`GraphModule.activation_checkpointing`,
docs/training.md) and in eager torch (`torch.utils.checkpoint` around each layer): the suite's
2-layer encoder and `transformer_6`, the same layers six deep. Run it alone with
`python -m benchmarks.memory [--tiny]` (`--tiny`: a toy size that only checks that it runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .suite import Case


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def warm_up_engine(engine: str, mode: str, case: Case) -> None:
    """Two calls of `engine` on a tiny model with `case`'s loss, then everything freed."""
    import gc

    import torch
    from torch import nn

    from .engines import make_step
    from .suite import Case

    regression = isinstance(case.loss_fn(), nn.MSELoss)
    tiny = Case("tiny", "Linear 8-8", lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                lambda: (torch.randn(2, 8), torch.randn(2, 8) if regression else torch.randint(0, 8, (2,))),
                case.loss_fn)
    step = make_step(engine, mode, tiny, tiny.make_model())
    x, y = tiny.inputs()
    step(x, y)
    step(x, y)
    del step
    gc.collect()


def _encoder_case(name: str, layers: int, d_model: int, ffn: int, heads: int, seq: int, batch: int) -> Case:
    """A TransformerEncoder of `layers` GELU layers with an MSE loss, like the suite's transformer."""
    import torch
    from torch import nn

    from .suite import Case

    def make_model() -> nn.Module:
        layer = nn.TransformerEncoderLayer(d_model=d_model, nhead=heads, dim_feedforward=ffn, dropout=0.0,
                                           activation="gelu", batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)

    return Case(name, f"{layers}-layer encoder, d_model {d_model}, seq {seq}, batch {batch}", make_model,
                lambda: (torch.randn(batch, seq, d_model), torch.randn(batch, seq, d_model)), nn.MSELoss)


# Cases of the checkpointing row beside the suite's: a toy size that only checks that the row runs,
# and the suite transformer's layers six deep (with two layers, checkpointing can free at most the
# activations of one layer: the other is recomputed at the peak).
EXTRA_CASES = {
    "transformer_tiny": lambda: _encoder_case("transformer_tiny", 2, 16, 32, 2, 8, 2),
    "transformer_6": lambda: _encoder_case("transformer_6", 6, 256, 1024, 4, 128, 8),
}


def checkpoint_layers(graph: object) -> None:
    """Switch on activation checkpointing for every layer of the graph's TransformerEncoder."""
    import tvmgraph

    for index in range(len(graph.model.layers)):
        graph.model.layers[index].to(tvmgraph.nn.GraphModule).activation_checkpointing = True


def checkpoint_layers_eagerly(model: object) -> None:
    """Eager torch's activation checkpointing of every layer of a TransformerEncoder:
    `torch.utils.checkpoint` around each layer's forward (non-reentrant, torch's recommended form)."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class CheckpointedEncoderLayer(nn.TransformerEncoderLayer):
        def forward(self, *args, **kwargs):
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)

    for layer in model.layers:
        layer.__class__ = CheckpointedEncoderLayer  # keeps the attributes the encoder's fast-path checks read


def probe(case_name: str, mode: str, engine: str, calls: int = 3, batch: int | None = None,
          accumulation_steps: int = 1, checkpointed: bool = False) -> int:
    """Run in the child: the step's peak memory in bytes. `batch` replaces the case's batch size
    (its rows repeated); `accumulation_steps` is tvmgraph's set_gradient_accumulation_steps;
    `checkpointed`: every encoder layer checkpointed (checkpoint_layers, checkpoint_layers_eagerly)."""
    import torch

    from .engines import make_step
    from .suite import CASES

    case = CASES[case_name] if case_name in CASES else EXTRA_CASES[case_name]()
    torch.manual_seed(0)
    warm_up_engine(engine, mode, case)
    model = case.make_model()
    if checkpointed and engine == "eager":
        checkpoint_layers_eagerly(model)
    step = make_step(engine, mode, case, model)
    if accumulation_steps > 1:
        step.config.set_gradient_accumulation_steps(accumulation_steps)
    if checkpointed and engine != "eager":
        checkpoint_layers(step)
    x, y = case.inputs()
    if batch is not None:
        rows = torch.arange(batch) % x.shape[0]
        x, y = x[rows], y[rows]
    before = _status_kib("VmRSS")
    step(x, y)  # compiles (torch.compile) or loads (tvmgraph); creates optimizer state
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak so far (the first call's compile) is not a step's
    for _ in range(calls):
        step(x, y)
    return max(0, _status_kib("VmHWM") - before) * 1024


def measure_peak_memory(case_name: str, mode: str, engine: str, **probe_args: int) -> int | None:
    """Run `probe` in a fresh interpreter; None if the probe failed.

    A tvmgraph variant the parent did not run (`probe_args`: another batch, accumulation,
    checkpointing) is probed twice and the second is kept: the first compiles it into the
    compiled cache, and what compiling leaves in a process (LLVM, the compiled module; 75 MiB
    for the transformer) is not a step's memory."""
    extra = "".join(f", {k}={v!r}" for k, v in probe_args.items())
    code = (f"import json, benchmarks.memory as m; "
            f"print(json.dumps(m.probe({case_name!r}, {mode!r}, {engine!r}{extra})))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", TVMGRAPH_VM_ALLOCATOR="naive")
    if engine == "tvmgraph" and probe_args:
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"  (peak-memory probe failed for {case_name}/{mode}/{engine}{extra}: "
              f"{proc.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def accumulation_rows(case_name: str = "cnn", micro_batch: int = 64, steps: int = 4) -> dict[str, int | None]:
    """Peak memory of a tvmgraph training step over `steps * micro_batch` rows with `steps`
    micro-batches, and of one over `micro_batch` rows without accumulation (bytes, by row name)."""
    return {
        f"batch {steps * micro_batch}, {steps} micro-batches": measure_peak_memory(
            case_name, "train", "tvmgraph", batch=steps * micro_batch, accumulation_steps=steps),
        f"batch {micro_batch}, no accumulation": measure_peak_memory(case_name, "train", "tvmgraph",
                                                                      batch=micro_batch),
    }


def checkpointing_row(case_name: str = "transformer", engine: str = "tvmgraph") -> tuple[int | None, int | None]:
    """Peak memory of `engine`'s training step of `case_name` without and with its encoder layers
    checkpointed (target: at least 30% lower with)."""
    plain = measure_peak_memory(case_name, "train", engine)
    if engine == "tvmgraph":  # the parent may not have run this case: the first probe compiled it
        plain = measure_peak_memory(case_name, "train", engine)
    return plain, measure_peak_memory(case_name, "train", engine, checkpointed=True)


def format_checkpointing_row(case_name: str, plain: int | None, checkpointed: int | None,
                             engine: str = "tvmgraph") -> str:
    if plain is None or checkpointed is None:
        return f"{case_name:<12} train  {engine} peak MiB with checkpointed layers: probe failed"
    return (f"{case_name:<12} train  {engine:<8} peak MiB {plain / 2**20:.1f}, with checkpointed layers "
            f"{checkpointed / 2**20:.1f} ({checkpointed / plain - 1:+.0%})")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="transformer training peak memory with and without "
                                                 "activation checkpointing of its layers, eager and tvmgraph")
    parser.add_argument("--tiny", action="store_true", help="toy size: only check that it runs")
    names = ["transformer_tiny"] if parser.parse_args().tiny else ["transformer", "transformer_6"]
    for name in names:
        for engine in ("eager", "tvmgraph"):
            print(format_checkpointing_row(name, *checkpointing_row(name, engine), engine=engine), flush=True)

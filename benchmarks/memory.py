"""Peak memory of one steady-state step, measured in a fresh process.

The child builds the model, its optimizer and the engine, resets the kernel's peak-RSS counter
(`/proc/self/clear_refs` <- 5), runs a few calls and reports `VmHWM - RSS before the calls`:
everything a step adds to the weights, at its peak (activations, gradients, optimizer state,
for tvmgraph the compiled program). The parent has already run the case, so tvmgraph's child
loads the program from the persistent compiled cache instead of compiling it.

So that RSS follows live tensors for every engine, the child runs with glibc's mmap threshold
fixed at 64 KiB (large blocks are returned to the kernel when freed; the default threshold
adapts upwards and keeps them) and with TVM's "naive" VM allocator (blocks freed after each
call instead of pooled). Both change where memory is cached, not how much a step uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def probe(case_name: str, mode: str, engine: str, calls: int = 3) -> int:
    """Run in the child: the step's peak memory in bytes."""
    import torch

    from .engines import make_step
    from .suite import CASES

    case = CASES[case_name]
    torch.manual_seed(0)
    step = make_step(engine, mode, case, case.make_model())
    x, y = case.inputs()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    for _ in range(calls):
        step(x, y)
    return max(0, _status_kib("VmHWM") - before) * 1024


def measure_peak_memory(case_name: str, mode: str, engine: str) -> int | None:
    """Run `probe` in a fresh interpreter; None if the probe failed."""
    code = (f"import json, benchmarks.memory as m; "
            f"print(json.dumps(m.probe({case_name!r}, {mode!r}, {engine!r})))")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", TVMGRAPH_VM_ALLOCATOR="naive")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"  (peak-memory probe failed for {case_name}/{mode}/{engine}: {proc.stderr.strip().splitlines()[-1:]})")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])

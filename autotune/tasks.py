"""The kernels of a graph's program that tuning works on, each with tvmgraph's default schedule.

A graph's program goes through the compile pipeline up to its tuning stage (autotune/apply.py):
what is left there is the fused PrimFuncs that stage would look up in the log. MetaSchedule's
`extract_tasks` groups identical ones (a kernel called several times is one task, `calls` of
them) and keys each by its structural hash, as the log does.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm

from tvmgraph.config import CompileOptions


@dataclass
class Kernel:
    name: str
    mod: tvm.IRModule       # {"main": the unscheduled PrimFunc}, as MetaSchedule tunes it
    workload: str           # structural hash: the key of its records in the log
    calls: int
    flops: float
    default: tvm.IRModule   # the same kernel with tvmgraph's default schedule
    default_s: float | None = None


def extract_kernels(fused: tvm.IRModule, target: tvm.target.Target, options: CompileOptions) -> list[Kernel]:
    """One `Kernel` per distinct PrimFunc of `fused` that has no schedule yet."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    from tvmgraph.pipeline import default_schedules

    schedule = tvm.transform.Sequential(default_schedules(target, options))
    kernels = []
    for task in ms.relax_integration.extract_tasks(fused, target):
        mod = task.dispatched[0]
        if mod["main"].attrs is not None and mod["main"].attrs.get("tirx.is_scheduled", False):
            continue
        if not _static(mod["main"]):  # MetaSchedule crashed on symbolic shapes (TVM 0.27)
            continue
        with target:  # NOTE: on a copy: dlight's pass updates the module it is given in place
            default = schedule(tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs))
        kernels.append(Kernel(_short(task.task_name), mod, ms.database.Workload(mod).as_json()[0], int(task.weight),
                              float(estimate_tir_flops(mod)), default))
    return kernels


def _static(func: tvm.tirx.PrimFunc) -> bool:
    from tvm.s_tir import meta_schedule as ms

    try:
        shapes = [info.shape for info in ms.arg_info.ArgInfo.from_prim_func(func)]
        return all(isinstance(d, int) or isinstance(d, tvm.tirx.IntImm) for shape in shapes for d in shape)
    except Exception:  # noqa: BLE001  (a symbolic shape may not convert at all)
        return False


def worth_tuning(kernels: list[Kernel], share: float = 0.97, most: int = 24) -> list[Kernel]:
    """The kernels that take `share` of the program's default time (slowest first, at most
    `most`): tuning a kernel that runs a few microseconds in a millisecond program buys nothing."""
    timed = sorted((k for k in kernels if k.default_s is not None), key=lambda k: -k.calls * k.default_s)
    total = sum(k.calls * k.default_s for k in timed)
    chosen, covered = [], 0.0
    for k in timed:
        if covered >= share * total or len(chosen) == most:
            break
        chosen.append(k)
        covered += k.calls * k.default_s
    return chosen


def _short(task_name: str) -> str:
    """`fused_relax_permute_dims_relax_matmul_relax_add` -> `permute_dims_matmul_add`."""
    return task_name.removeprefix("fused_").replace("relax_nn_", "").replace("relax_", "")

"""Code generation: an optimized Relax module becomes a VM executable, then a shared library,
using every core.

TVM's own `tvm.compile` and `export_library` hand all kernels to LLVM as one module, on one
thread: generating and emitting a CNN training step's ~250 kernels took most of its compile
time. Here the kernels are split into one part per core; each part is compiled (`tirx.build`)
and emitted as an object file in its own thread (TVM releases the GIL while LLVM works), the
parts are imported into the first one, and the VM code links against that. The result is the
same executable `tvm.compile` makes, with its kernels spread over several LLVM modules.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tvm
from tvm import relax
from tvm.relax import vm_build

from .native_output import to_debug_log
from .schedules.apply import OPT_LEVEL_ATTR
from .vm_results import with_release_function

log = logging.getLogger(__name__)

PARTS_PER_THREAD = 4

_BF16_PARAM = re.compile(r"(\w+): T\.Buffer\(\([^\"]*\), \"bfloat16\"\)")


def _unvectorizable(func: tvm.tirx.PrimFunc) -> bool:
    """True for a kernel that stores a bfloat16 constant into one of its parameters (a zero
    init of a reduction's output). TVM 0.27's BF16StorageLegalize rejects such a store once
    VectorizeLoop has made it a vector store (it legalizes scalar constants only), so these
    kernels are built with their loops serial."""
    text = func.script()
    names = _BF16_PARAM.findall(text.split("\n    ", 1)[0])  # the parameters, on the `def` line
    return any(re.search(rf"\b{name}\[[^\n]*\] = T\.bfloat16\(", text) for name in names)


def _wanted_opt_level(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> int | None:
    """The LLVM optimization level a kernel's schedule asked for (OPT_LEVEL_ATTR), when above
    the target's."""
    wanted = func.attrs.get(OPT_LEVEL_ATTR) if func.attrs is not None else None
    current = int(target.attrs.get("opt-level", 3))  # TVM's LLVM default: -O3
    return int(wanted) if wanted is not None and int(wanted) > current else None


def _with_opt_level(target: tvm.target.Target, level: int) -> tvm.target.Target:
    return tvm.target.Target({**dict(target.export()), "opt-level": level})


def _build_part(part: tvm.IRModule, target: tvm.target.Target, vectorize: bool,
                kernel_checks: bool) -> tvm.runtime.Module:
    config = {"tirx.disable_vectorize": not vectorize, "tirx.disable_assert": not kernel_checks}
    with tvm.transform.PassContext(config=config):
        return tvm.tirx.build(part, target=target)


def _build_part_or_split(part: tvm.IRModule, target: tvm.target.Target, vectorize: bool,
                         kernel_checks: bool) -> list[tvm.runtime.Module]:
    """`_build_part`; when a vectorized part fails, its kernels one by one, those that fail
    vectorized built serial.

    TVM 0.27's bfloat16 legalization rejects some vector expressions (a bfloat16 slice_scatter:
    `IntImm can only take scalar, but boolx32 was supplied`) that it accepts serial; the other
    failures it has known are caught before the build (`_unvectorizable`, SerialHalfFills).
    A kernel that fails serial too raises that error."""
    try:
        return [_build_part(part, target, vectorize, kernel_checks)]
    except Exception:  # noqa: BLE001 - TVM raises its own error types; the serial build re-raises
        if not vectorize:
            raise
    built, serial = [], {}
    for gv, func in part.functions_items():
        try:
            built.append(_build_part(tvm.IRModule({gv: func}, attrs=part.attrs), target, True, kernel_checks))
        except Exception as error:  # noqa: BLE001
            log.debug("kernel %s built serial: it failed vectorized (%s)", gv.name_hint,
                      str(error).strip().splitlines()[-1][:200])
            serial[gv] = func
    if serial:
        built.append(_build_part(tvm.IRModule(serial, attrs=part.attrs), target, False, kernel_checks))
    return built


def _parts(tir_mod: tvm.IRModule, jobs: int) -> list[tvm.IRModule]:
    items = sorted(tir_mod.functions_items(), key=lambda item: item[0].name_hint)
    groups = [dict(items[i::jobs]) for i in range(jobs)]
    return [tvm.IRModule(group, attrs=tir_mod.attrs) for group in groups if group]


def build_executable(mod: tvm.IRModule, target: tvm.target.Target, jobs: int | None = None,
                     kernel_checks: bool = True) -> relax.VMExecutable:
    """`tvm.compile(mod, target, relax_pipeline=None)`, with the kernels built in parallel and
    vm_results.RELEASE added; LLVM's and TVM's C++ warnings go to the debug log
    (native_output.py). A kernel whose schedule asked for a higher LLVM opt-level than the
    target's (schedules/apply.py's OPT_LEVEL_ATTR) is built on its own at that level.

    `kernel_checks=False` leaves out each CPU kernel's checks of its arguments (TVM's
    `tirx.disable_assert`). They test every tensor's dtype, shape, strides and device on each
    call, and made two thirds of the machine code: the benchmark CNN's training step emitted
    5.6 s of objects (5.5 MB) with them, 2.0 s (1.1 MB) without. The program's entry still
    checks its inputs' dtypes and shapes (Relax's match_cast), tvmgraph hands it compact,
    aligned tensors only (inputs.py), and every other kernel argument is the VM's own.
    """
    with to_debug_log("codegen"):
        return _build_executable(with_release_function(mod), target, jobs, kernel_checks)


def _build_executable(mod: tvm.IRModule, target: tvm.target.Target, jobs: int | None,
                      kernel_checks: bool) -> relax.VMExecutable:
    jobs = jobs or os.cpu_count() or 1
    if "gpu" in target.keys:  # device modules keep TVM's single-module path
        return tvm.compile(mod, target=target, relax_pipeline=None)
    attrs = dict(mod.attrs) if mod.attrs else {}
    ext_libs = list(attrs.get("external_mods", []))
    params = dict(attrs.get("const_name_to_constant", {}))
    builder = relax.ExecBuilder()
    leftover = vm_build._vmcodegen(builder, mod, "bytecode")
    tir_mod = vm_build._filter_tir(leftover)
    if tir_mod is None:
        return tvm.compile(mod, target=target, relax_pipeline=None)
    # More parts than threads: a thread that finishes its part takes the next one, so one slow
    # part does not leave the other cores idle (with one part per core, the CNN training step's
    # two parts took 2.0 and 5.0 s to emit).
    functions = dict(tir_mod.functions_items())
    serial = {gv: f for gv, f in functions.items() if _unvectorizable(f)}
    levels = {gv: level for gv, f in functions.items()
              if gv not in serial and (level := _wanted_opt_level(f, target)) is not None}
    rest = tvm.IRModule({gv: f for gv, f in functions.items() if gv not in serial and gv not in levels},
                        attrs=tir_mod.attrs)
    parts = [(part, target, True) for part in _parts(rest, jobs * PARTS_PER_THREAD)]
    parts += [(tvm.IRModule(serial, attrs=tir_mod.attrs), target, False)] if serial else []
    # Each on its own, so that the slower -O3 builds spread over the threads.
    parts += [(tvm.IRModule({gv: functions[gv]}, attrs=tir_mod.attrs), _with_opt_level(target, level), True)
              for gv, level in levels.items()]
    with ThreadPoolExecutor(jobs) as pool:
        built = pool.map(lambda part: _build_part_or_split(*part, kernel_checks), parts)
        libs = [lib for part_libs in built for lib in part_libs]
    lib = libs[0]
    for other in libs[1:]:
        lib.import_module(other)
    return relax.VMExecutable(vm_build._ffi_api.VMLink(builder, target, lib, ext_libs, params))


def export_library(executable: relax.VMExecutable, path: str | Path, jobs: int | None = None) -> None:
    """`executable.export_library(path)` for a CPU executable, emitting objects in parallel."""
    from tvm.runtime import _ffi_api as runtime_api
    from tvm.support import cc

    module = executable.mod
    dso = module._collect_dso_modules()
    if len(dso) < 2 or any(m.kind != "llvm" for m in dso):
        executable.export_library(str(path))
        return
    with tempfile.TemporaryDirectory(prefix="tvmgraph-export-") as workspace:
        objects = [os.path.join(workspace, f"lib{i}.o") for i in range(len(dso))]
        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            list(pool.map(lambda mo: mo[0].write_to_file(mo[1]), zip(dso, objects)))
        llvm_target = dso[0].get_function("_get_target_string")()
        packed = os.path.join(workspace, "devc.o")
        runtime_api.ModulePackImportsToLLVM(module, False, llvm_target, "").write_to_file(packed)
        cc.create_shared(str(path), [*objects, packed])

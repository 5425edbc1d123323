"""Which TVM target and device a graph compiles for, from the torch device of its inputs."""

from __future__ import annotations

import functools
import re

import torch
import tvm

from .config import CompileOptions, compile_options
from .errors import UnsupportedDeviceError


@functools.cache
def host_cpu() -> str:
    """LLVM's name for this machine's CPU (e.g. `znver5`), so kernels use all its vector units."""
    return tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")()


def target_for(device: torch.device, options: CompileOptions | None = None) -> tvm.target.Target:
    """The target that runs best on `device`: LLVM for the host CPU (at the options' LLVM
    optimization level), or CUDA for its GPU."""
    if device.type == "cpu":
        opt_level = compile_options(options).llvm_opt_level
        return tvm.target.Target({"kind": "llvm", "mcpu": host_cpu(), "opt-level": opt_level})
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return tvm.target.Target({"kind": "cuda", "arch": f"sm_{major}{minor}"})
    raise UnsupportedDeviceError(
        f"tvmgraph compiles for CPU and CUDA devices; got inputs on {device}. "
        f"Move the inputs and the modules to 'cpu' or 'cuda'."
    )


def tvm_device(device: torch.device) -> tvm.runtime.Device:
    """The TVM runtime device that shares memory with torch `device`."""
    if device.type == "cpu":
        return tvm.cpu(0)
    if device.type == "cuda":
        return tvm.cuda(device.index if device.index is not None else torch.cuda.current_device())
    raise UnsupportedDeviceError(f"tvmgraph runs on CPU and CUDA devices, not on {device}; move the "
                                 f"inputs and modules with .to('cpu') or .to('cuda').")


def valid_cuda_arch(arch: str) -> bool:
    """Whether `arch` names a CUDA architecture as TVM's CUDA target takes it: sm_<version>,
    with an optional feature letter (sm_80, sm_90a, sm_100a). TVM's own checks fail deep in
    target parsing, with a traceback ("Compute version parsing error")."""
    return isinstance(arch, str) and re.fullmatch(r"sm_\d{2,3}[a-z]?", arch) is not None

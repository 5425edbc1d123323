"""`tvmgraph.save`: a called graph becomes a directory that runs without the model's code.

    <dir>/manifest.json        format version, graph name, input/output specs, target and what
                               the target machine needs, versions, the compiled program's
                               metadata (the compiled cache's codec), every file's sha256
    <dir>/graph.so             the VM executable, exported as a shared library
    <dir>/params.safetensors   parameters and buffers, by their path in the graph
    <dir>/constants.bin        lifted constant tensors as raw bytes (when there are any)

It is the compiled cache's artifact format (tvmgraph/artifact_format.py) with a manifest in
place of the cache's entry.json; `tvmgraph.load` (tvmgraph/deploy_runtime.py) reads it. The
directory is written beside its destination and renamed into place, so a crash never leaves a
directory that loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tvm

from . import artifact, codegen
from .artifact_format import document_digest, files_table, write_file
from .binding import TensorBinder
from .compiled_program import CompiledProgram
from .deploy_runtime import FORMAT, KIND, MANIFEST, host_machine, machine_of
from .deploy_train_step import train_step_program
from .entry import tuning_log_for
from .errors import SaveError, UnsupportedOptionError
from .graph import Graph
from .spec import TreeDef
from .stages import LoweredGraph, TracedGraph
from .target import target_for, valid_cuda_arch

logger = logging.getLogger("tvmgraph.deploy")

LIBRARY = "graph.so"
PARAMETERS = "params.safetensors"
PIPELINE = "default"
TARGETS = ("host", "x86_64", "aarch64", "cuda")
PROGRAMS = ("inference", "train_step")
CPU_OF = {"x86_64": "x86-64-v3", "aarch64": "neoverse-n1"}  # what a generic server of each kind has
TRIPLE_OF = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}


def save(obj: Any, path: str | os.PathLike, *, example_args: tuple | None = None, target: Any = "host",
         arch: str | None = None, program: str = "inference") -> Path:
    """Save a graph (compiled program, parameters, manifest) as a directory `path`, or a state
    dict as a file like `torch.save`.

    A graph saves what its last call compiled; with `example_args` it is traced for those
    instead. A training graph saves its inference program: build() traced with the modules in
    eval mode, without the optimizer update; `program="train_step"` saves the training step
    instead (forward, backward and update, with the optimizer state: tvmgraph/deploy_train_step.py).
    `target` is "host" (the device the graph ran on), "x86_64", "aarch64", "cuda" (with `arch`,
    default sm_90), or a `tvm.target.Target`. Returns the directory.
    """
    path = Path(path)
    if not isinstance(obj, Graph):
        if isinstance(obj, Mapping):
            torch.save(obj, path)  # a state dict: what OneFlow's flow.save also takes
            return path
        raise SaveError(f"tvmgraph.save takes a called tvmgraph.nn.Graph or a state dict, not a "
                        f"{type(obj).__name__}; for a module, save module.state_dict() or wrap it in a Graph")
    if program not in PROGRAMS:
        raise SaveError(f"{obj.name}: program={program!r}; use one of {', '.join(map(repr, PROGRAMS))}")
    pipeline = obj._state("saving the graph").pipeline
    if pipeline is not None and not pipeline.gathered:
        raise SaveError(f"{obj.name}: the graph trains in pipeline stages, and this rank holds only its own "
                        f"stage's trained parameters; call graph.state_dict() on every rank first (a collective "
                        f"that brings every stage's parameters here), then save")
    last = obj.compiled
    if example_args is None and last is not None and last.traced.signature.options.dynamic_batch:
        raise _dynamic_batch_refused(obj)  # before tracing again: the last call's shapes have no batch
    if program == "train_step":
        traced, lowered, optimizer_state, training = train_step_program(obj, example_args)
        modules = dict(obj.named_modules())
    else:
        traced, modules = _traced(obj, example_args)
        lowered, optimizer_state, training = traced.lower(None), {}, None
    if traced.signature.options.dynamic_batch:
        raise _dynamic_batch_refused(obj)
    device = traced.signature.leaves[0].device if traced.signature.leaves else torch.device("cpu")
    tvm_target, needs = resolve_target(obj.name, target, arch, device, traced.signature.options)
    tuning = tuning_log_for(type(obj).__name__, traced.signature.options, tvm_target)
    # A saved program may be run by other code than tvmgraph's: its kernels keep their checks.
    # Its weights change only through the program itself (a train step's), so an inference
    # program's are packed once, when it is loaded (tvmgraph/frozen_weights.py).
    options = dataclasses.replace(traced.signature.options, kernel_checks=True,
                                  frozen_weights=program != "train_step")
    compiled = lowered.compile(tvm_target, options, PIPELINE, tuning=tuning)
    binder = TensorBinder(lowered.signature.inputs, modules, lowered.signature.constants)
    tensors = binder.named()
    state = {s.target: tensors[s.target] for s in binder.sources if s.kind != "constant"}
    # A module's plain tensor attribute is read at each call (binding.py): save its value now,
    # not the one traced (a mask replaced after the first call was saved stale).
    live = {s.target: tensors[s.target] for s in binder.sources if s.kind == "constant"}
    compiled = dataclasses.replace(compiled, signature=dataclasses.replace(
        compiled.signature, constants={**compiled.signature.constants, **live}))
    state.update(optimizer_state)
    manifest = _manifest(obj, traced, lowered, tvm_target, needs)
    manifest["program"], manifest["entry"] = program, lowered.entry
    if training is not None:
        manifest["training"] = training
    manifest["tuning"] = {"log": str(tuning.directory), "kernels": tuning.kernels} if tuning is not None else None
    _write_atomically(path, manifest, compiled, state)
    logger.info("%s: saved the %s program for %s to %s", obj.name, program, tvm_target, path)
    return path


def _traced(graph: Graph, example_args: tuple | None) -> tuple[TracedGraph, dict[str, torch.nn.Module]]:
    """The traced program to save: for example_args or the last call's signature, in eval mode
    for a training graph."""
    modules = dict(graph.named_modules())
    compiled = graph.compiled
    if example_args is None and compiled is None:
        raise SaveError(f"{graph.name}: the graph has not been called, so there is no compiled program to "
                        f"save; call it once, or pass inputs: tvmgraph.save(graph, path, example_args=(x,))")
    if example_args is not None and not isinstance(example_args, tuple):
        example_args = (example_args,)
    if example_args is None and not graph.training and last_call_holds(graph):
        return compiled.traced, modules
    if example_args is None:
        example_args = last_call_zeros(graph)
    if not graph.training:
        return graph.trace(*example_args), modules
    modes = [(m, m.training) for top in modules.values() for m in top.modules()]
    try:
        for top in modules.values():
            top.eval()
        return graph.trace(*example_args), modules
    finally:
        for m, mode in modes:
            m.training = mode


def _dynamic_batch_refused(graph: Graph) -> UnsupportedOptionError:
    return UnsupportedOptionError(f"{graph.name}: tvmgraph.save of a graph with a dynamic batch is not "
                                  f"implemented yet (a saved graph runs fixed shapes); turn it off first, "
                                  f"graph.config.enable_dynamic_batch(False), then call the graph or pass "
                                  f"example_args")


def last_call_zeros(graph: Graph) -> tuple:
    """Zeros in the shapes, dtypes and nesting of the graph's last call."""
    traced = graph.compiled.traced
    leaves = [torch.zeros(s.shape, dtype=s.dtype, device=s.device) for s in traced.signature.leaves]
    return tuple(traced.args_tree.unflatten(leaves))


def last_call_holds(graph: Graph) -> bool:
    """True while every guard of the last call's program holds for the model as it is now:
    a call now would run it. A save after `model.eval()`, a changed attribute, a replaced
    layer or a frozen parameter saved the program of before (silently, or failing at load).
    """
    return graph._last_entry_again(graph._state("saving the graph"), last_call_zeros(graph)) is graph.compiled


def resolve_target(name: str, target: Any, arch: str | None, device: torch.device,
                   options: Any) -> tuple[tvm.target.Target, list[str]]:
    """The TVM target for `target`, and what a machine needs to run the build."""
    if isinstance(target, tvm.target.Target):
        kind = "cuda" if target.kind.name == "cuda" else machine_of(target)
    elif target in TARGETS:
        kind = target
    else:
        raise SaveError(f"{name}: target={target!r}; use one of {', '.join(map(repr, TARGETS))} or a "
                        f"tvm.target.Target")
    if kind == "host":
        tvm_target = target_for(device, options)
        kind = "cuda" if device.type == "cuda" else host_machine()
    elif isinstance(target, tvm.target.Target):
        tvm_target = target
    elif kind == "cuda":
        if arch is not None and not valid_cuda_arch(arch):
            raise SaveError(f"{name}: arch={arch!r} is not a CUDA architecture; give one as sm_<version>, "
                            f"such as sm_80 or sm_90 (nvidia-smi --query-gpu=compute_cap shows a GPU's)")
        tvm_target = tvm.target.Target({"kind": "cuda", "arch": arch or "sm_90"},
                                       host={"kind": "llvm", "mtriple": TRIPLE_OF[host_machine()]})
    else:
        opt_level = options.llvm_opt_level if options is not None else 1
        tvm_target = tvm.target.Target({"kind": "llvm", "mtriple": TRIPLE_OF[kind], "mcpu": CPU_OF[kind],
                                        "opt-level": opt_level})
    if arch is not None and kind != "cuda":
        raise SaveError(f"{name}: arch={arch!r} is for target='cuda', not {target!r}")
    machine = host_machine() if kind == "cuda" else kind
    needs = [f"Linux {machine}"]
    if kind == "cuda":
        sm = str(tvm_target.attrs.get("arch", "sm_90"))
        needs += [f"an NVIDIA GPU of compute capability {sm.removeprefix('sm_')[:-1]}.{sm[-1]} ({sm}) or newer "
                  f"with a driver for CUDA 13",
                  "NVRTC (pip install cuda-bindings nvidia-cuda-nvrtc, CUDA_PATH set to its headers) or nvcc "
                  "(TVM_CUDA_COMPILE_MODE=nvcc): the library carries CUDA C source, compiled when it is loaded"]
    else:
        cpu = str(tvm_target.attrs.get("mcpu", "")) or "generic"
        needs.append(f"a CPU that runs code built for -mcpu={cpu}")
    needs.append(f"apache-tvm {tvm.__version__.rsplit('.post', 1)[0]}, numpy, safetensors (torch only to pass "
                 f"torch tensors)")
    return tvm_target, needs


def _tree(tree: TreeDef) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": tree.kind}
    if tree.kind in ("list", "tuple", "dict"):
        doc["children"] = [_tree(c) for c in tree.children]
    if tree.kind == "dict":
        doc["keys"] = list(tree.keys)
    if tree.cls is not None:  # a namedtuple: the loaded graph rebuilds one of its name and fields
        doc["namedtuple"] = {"name": tree.cls.__name__, "fields": list(tree.cls._fields)}
    return doc


def _manifest(graph: Graph, traced: TracedGraph, lowered: LoweredGraph, target: tvm.target.Target,
              needs: list[str]) -> dict[str, Any]:
    import tvm_ffi

    import tvmgraph

    sig = lowered.signature
    user_types = [t for t, s in zip(sig.input_types, sig.inputs) if s.kind == "user"]
    names = [s.arg.name for s in traced.result.exported.graph_signature.input_specs
             if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    if len(names) != len(user_types):
        names = [f"input_{i}" for i in range(len(user_types))]
    ret = lowered.mod[lowered.entry].ret_ty
    fields = ret.fields if hasattr(ret, "fields") else [ret]
    n_mut = len(sig.mutations)
    # A size known only when the program runs (the count of a boolean mask's true elements) is -1.
    outputs = [{"name": f"output_{i}", "dtype": str(f.dtype),
                "shape": [int(d) if isinstance(d, tvm.tirx.IntImm) else -1 for d in f.shape.values]
                if isinstance(f.shape, tvm.relax.ShapeExpr) else [-1] * f.ndim}
               for i, f in enumerate(fields[n_mut:n_mut + sig.num_user_outputs])]
    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    machine = host_machine() if kind == "cuda" else machine_of(target)
    return {
        "format": FORMAT,
        "kind": KIND,
        "graph": graph.name,
        "graph_class": type(graph).__name__,
        "program": "inference",
        "entry": "main",
        "inputs": [{"name": n, "dtype": d, "shape": list(s)} for n, (s, d) in zip(names, user_types)],
        "input_tree": _tree(traced.args_tree),
        "outputs": outputs,
        "output_tree": _tree(traced.out_tree),
        "target": {"string": str(target), "kind": kind, "device": "cuda" if kind == "cuda" else "cpu",
                   "machine": machine, "os": "linux", "needs": needs},
        "versions": {"tvmgraph": tvmgraph.__version__, "tvm": tvm.__version__, "tvm_ffi": tvm_ffi.__version__,
                     "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "library": LIBRARY,
        "parameters": PARAMETERS,
    }


def _write_atomically(path: Path, manifest: dict[str, Any], program: CompiledProgram,
                      state: Mapping[str, torch.Tensor]) -> None:
    from safetensors.numpy import save as save_safetensors

    if path.exists() and not (path / MANIFEST).is_file():
        raise SaveError(f"{manifest['graph']}: {path} exists and is not a saved graph; choose another path "
                        f"(tvmgraph.save replaces only a saved graph)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        export(program.library, tmp / LIBRARY, program.target)
        meta_doc, data = artifact.encode_meta(program.meta())
        arrays = {name: _numpy(manifest["graph"], name, t) for name, t in state.items()}
        data = {**data, PARAMETERS: save_safetensors(arrays, metadata={"graph": manifest["graph"]})}
        for name, blob in data.items():
            write_file(tmp / name, blob)
        manifest = {**manifest, "meta": meta_doc, "files": files_table(tmp, [LIBRARY, *data])}
        manifest["sha256"] = document_digest(manifest)
        write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        if path.exists():  # replace an older save: move it away first, then rename ours in
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _numpy(graph: str, name: str, t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16, and the loader reads through numpy
        raise SaveError(f"{graph}: '{name}' is bfloat16, which tvmgraph.save cannot store yet; save a float32 "
                        f"copy of the model (model.float())")
    return t.detach().to("cpu").contiguous().numpy()


def zig_cc(triple: str):
    """An `fcompile` for export_library that links with the PyPI `ziglang` package's clang
    (a cross linker with its own libc headers; nothing to apt-get)."""
    def compile_shared(output: str, objects: list[str], options: list[str] | None = None, cc: str | None = None):
        cmd = [sys.executable, "-m", "ziglang", "cc", "-target", triple, "-shared", "-fPIC", "-o", output,
               *objects]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"zig cc failed: {done.stderr.strip()[-2000:]}")

    compile_shared.output_format = "so"
    return compile_shared


def export(executable: Any, path: Path, target: tvm.target.Target) -> None:
    """Export the library for `target`: this machine's linker, or zig's for another CPU."""
    machine = machine_of(target.host if target.kind.name == "cuda" and target.host else target)
    if machine == host_machine():
        codegen.export_library(executable, path)
        return
    try:
        import ziglang  # noqa: F401
    except ImportError:
        raise SaveError(f"linking for {machine} needs a cross linker: pip install ziglang (tvmgraph uses "
                        f"`python -m ziglang cc -target {TRIPLE_OF.get(machine, machine)}`)") from None
    executable.export_library(str(path), fcompile=zig_cc(TRIPLE_OF.get(machine, f"{machine}-linux-gnu")))

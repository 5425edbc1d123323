"""Running a saved graph (`tvmgraph.load`) without torch and without the model's code.

Loading trusts nothing until it is checked: the manifest's format, platform and TVM version,
then the sha256 of the manifest and of every file it lists. Only then is the library loaded,
which runs native code from it (like unpickling: load only what you trust). The checksums catch
corruption and partial copies; they do not tell who wrote the directory.

This module imports neither torch nor the model's code; numpy arrays in give numpy arrays out.
torch tensors in give torch tensors out (torch is then imported, since the caller has it).
"""

from __future__ import annotations

import collections
import logging
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .artifact_format import ArtifactFormatError, read_document, verify_files
from .errors import SavedGraphError, SavedGraphInputError
from .openmp_launch import load_library
from .vm_results import releasing

logger = logging.getLogger("tvmgraph.deploy")

MANIFEST = "manifest.json"
PACK_FUNCTION = "pack_weights"  # relay_passes/weight_packing.py (not imported: it needs the compiler)
FORMAT = 1  # bump when manifest.json changes meaning; newer ones are refused
KIND = "tvmgraph-saved-graph"

_MACHINES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}


def host_machine() -> str:
    """This machine's architecture in the manifest's words (`x86_64`, `aarch64`)."""
    return _MACHINES.get(platform.machine().lower(), platform.machine().lower())


def machine_of(target: Any) -> str:
    """The architecture an llvm target builds for: its triple's (`x86_64`, `aarch64`), else,
    with no triple, this machine's."""
    triple = str(target.attrs.get("mtriple", ""))
    return triple.split("-")[0] if triple else host_machine()


class _HideTorch:
    """A meta-path finder under which `import torch` fails (see `_import_tvm`)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise ImportError("tvmgraph.load imports TVM without torch")


def _import_tvm() -> Any:
    """`import tvm`; in a runtime-only process (TVM_USE_RUNTIME_LIB=1) that has not imported
    torch, without torch.

    tvm-ffi imports torch on its own import when torch is installed, which takes seconds that a
    process serving saved graphs on numpy arrays does not need. Hidden, torch tensors still pass
    through DLPack, but tvm-ffi no longer converts torch dtypes, which compiling needs: hence
    only where TVM's compiler is not loaded anyway.
    """
    if "tvm" in sys.modules or "torch" in sys.modules or os.environ.get("TVM_USE_RUNTIME_LIB") != "1":
        import tvm

        return tvm
    hide = _HideTorch()
    sys.meta_path.insert(0, hide)
    try:
        import tvm
    finally:
        sys.meta_path.remove(hide)
    return tvm


def _refuse(path: Path, file: str, reason: str, fix: str) -> SavedGraphError:
    return SavedGraphError(f"{path}: cannot load the saved graph: {file}: {reason}. {fix}")


def _check_manifest(path: Path, doc: Mapping[str, Any]) -> None:
    """Format, kind, platform and versions: what can be refused before hashing anything."""
    fmt = doc.get("format")
    if type(fmt) is not int:
        raise _refuse(path, MANIFEST, f"format {fmt!r} is not a format version", "Save the graph again.")
    if fmt > FORMAT:
        raise _refuse(path, MANIFEST, f"format {fmt} is newer than the format this tvmgraph reads ({FORMAT}); "
                      f"it was written by tvmgraph {doc.get('versions', {}).get('tvmgraph')}",
                      "Upgrade tvmgraph on this machine, or save the graph with this machine's version.")
    if fmt != FORMAT or doc.get("kind") != KIND:
        raise _refuse(path, MANIFEST, f"format {fmt!r} ({doc.get('kind')!r}) is not a saved graph this tvmgraph "
                      f"reads", "Save the graph again with this version of tvmgraph.")
    target = doc.get("target")
    if not isinstance(target, dict):
        raise _refuse(path, MANIFEST, "has no target", "Save the graph again.")
    machine, system = target.get("machine"), target.get("os")
    if machine != host_machine() or system != sys.platform:
        raise _refuse(path, MANIFEST, f"the graph was built for {system} {machine} ({target.get('string')}) but "
                      f"this machine is {sys.platform} {host_machine()}",
                      f"Export it for this machine: tvmgraph.save(graph, path, target={host_machine()!r}).")
    tvm = _import_tvm()

    built, here = str(doc.get("versions", {}).get("tvm")), tvm.__version__
    if built.split(".")[:2] != here.split(".")[:2]:
        raise _refuse(path, MANIFEST, f"the library was built with TVM {built}, this process has TVM {here}",
                      f"Install apache-tvm {built} here, or save the graph again with TVM {here}.")


def _device(target: Mapping[str, Any], device: Any):
    import tvm

    name = str(device) if device is not None else target["device"]
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda"):
        raise SavedGraphInputError(f"tvmgraph.load: device {name!r} is not 'cpu' or 'cuda[:N]'")
    if kind != target["device"]:
        raise SavedGraphInputError(f"tvmgraph.load: the graph was built for {target['device']} "
                                   f"({target['string']}), not for {name!r}; save it with target={kind!r}")
    dev = tvm.cpu(0) if kind == "cpu" else tvm.cuda(int(index or 0))
    if not dev.exist:
        raise SavedGraphError(f"tvmgraph.load: cannot load the saved graph: it runs on {name}, which this "
                              f"machine does not have. The target machine needs: "
                              f"{'; '.join(target.get('needs', []))}.")
    return dev


class TreeSpec:
    """An argument or output structure from the manifest: tensor, none, list, tuple or dict."""

    __slots__ = ("kind", "children", "keys", "named")

    def __init__(self, doc: Any):
        self.kind = doc["kind"]
        if self.kind not in ("tensor", "none", "list", "tuple", "dict"):
            raise ValueError(f"unknown tree kind {self.kind!r}")
        self.children = [TreeSpec(c) for c in doc.get("children", [])]
        self.keys = list(doc.get("keys", []))
        named = doc.get("namedtuple")  # the user's class is not imported: one of its name and fields
        self.named = collections.namedtuple(named["name"], named["fields"]) if named else None
        if self.kind == "dict" and len(self.keys) != len(self.children):
            raise ValueError("a dict tree needs one key per child")

    def flatten(self, value: Any, where: str, out: list) -> None:
        if self.kind == "tensor":
            out.append((where, value))
        elif self.kind == "none":
            if value is not None:
                raise SavedGraphInputError(f"{where} must be None, got {type(value).__name__}")
        elif self.kind == "dict":
            if not isinstance(value, dict) or list(value) != self.keys:
                raise SavedGraphInputError(f"{where} must be a dict with keys {self.keys}, got "
                                           f"{type(value).__name__}{f' with keys {list(value)}' if isinstance(value, dict) else ''}")
            for key, child in zip(self.keys, self.children):
                child.flatten(value[key], f"{where}[{key!r}]", out)
        else:
            if not isinstance(value, (list, tuple)) or len(value) != len(self.children):
                raise SavedGraphInputError(f"{where} must be a {self.kind} of {len(self.children)} items, got "
                                           f"{type(value).__name__}{'' if not hasattr(value, '__len__') else f' of {len(value)}'}")
            for i, (child, item) in enumerate(zip(self.children, value)):
                child.flatten(item, f"{where}[{i}]", out)

    def unflatten(self, leaves: Any) -> Any:
        if self.kind == "tensor":
            return next(leaves)
        if self.kind == "none":
            return None
        items = [c.unflatten(leaves) for c in self.children]
        if self.kind == "dict":
            return dict(zip(self.keys, items))
        if self.named is not None:
            return self.named(*items)
        return items if self.kind == "list" else tuple(items)


def _load_by_content(library: Path, sha256: str) -> Any:
    """`load_library(library)` under a name made of its content, so native code runs from here on.

    The dynamic loader hands back a library already loaded under the same path: a graph saved
    over an earlier one at `path` and loaded in the same process ran the earlier graph's code
    with the new weights. A link named by the content's hash is loaded instead, then removed
    (the loaded code stays mapped)."""
    with tempfile.TemporaryDirectory(prefix="tvmgraph-load-") as work:
        alias = Path(work) / f"graph-{sha256[:16]}{library.suffix}"
        try:
            os.link(library, alias)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(library, alias)
        return load_library(alias)


class SavedGraph:
    """A graph loaded by `tvmgraph.load`: call it with the arguments of the original `build()`.

    A saved train step (`program == "train_step"`) trains on every call: it runs forward,
    backward and the optimizer update, keeps the new parameters and optimizer state, and returns
    what build() returned. `state_dict()` reads the trained parameters and buffers;
    `set_hyperparameter` changes the lr (or another hyperparameter) between calls.
    """

    __slots__ = ("path", "manifest", "name", "program", "inputs", "outputs", "_args", "_outs", "_dev",
                 "_sources", "_mutations", "_num_user_outputs", "_has_loss", "_state", "_vm", "_entry",
                 "_training", "_optimizer_state", "_hypers", "_steps", "_packed")

    def __init__(self, path: Path, manifest: dict[str, Any], files: Mapping[str, bytes], device: Any):
        import tvm
        from tvm.runtime.vm import VirtualMachine  # not tvm.relax: a runtime-only process has no compiler

        self.path = path
        self.manifest = manifest
        self.name = manifest["graph"]
        self.inputs: list[dict[str, Any]] = manifest["inputs"]
        self.outputs: list[dict[str, Any]] = manifest["outputs"]
        self._args = TreeSpec(manifest["input_tree"])
        self._outs = TreeSpec(manifest["output_tree"])
        self._dev = _device(manifest["target"], device)
        sig = manifest["meta"]["signature"]
        self._sources = [tuple(s) for s in sig["inputs"]]
        self._mutations = [tuple(s) for s in sig["mutations"]]
        self._num_user_outputs = sig["num_user_outputs"]
        self._has_loss = bool(sig.get("has_loss", False))
        state = _read_state(files.get(manifest["parameters"], b""), sig["constants"], files.get("constants.bin", b""))
        self._state = {name: tvm.runtime.tensor(value, self._dev) for name, value in state.items()}
        self.program = manifest.get("program", "inference")
        self._training = manifest.get("training") if self.program == "train_step" else None
        self._optimizer_state, self._hypers, self._steps = [], [], 0
        if self._training is not None:
            self._optimizer_state = [self._state.pop(name) for name in self._training["states"]]
            self._hypers = [{"first_call": list(map(float, g["first_call"])),
                             "later_calls": list(map(float, g["later_calls"]))} for g in self._training["groups"]]
        missing = [t for k, t in self._sources if k in ("parameter", "buffer", "constant") and t not in self._state]
        if missing:
            raise _refuse(path, manifest["parameters"], f"has no tensor {missing[0]!r}", "Save the graph again.")
        lib = _load_by_content(path / manifest["library"], manifest["files"][manifest["library"]]["sha256"])
        self._vm = VirtualMachine(lib, self._dev)
        self._entry = releasing(self._vm, manifest["entry"])
        self._packed = self._pack_weights()

    def __repr__(self) -> str:
        ins = ", ".join(f"{s['name']}: {s['dtype']}{s['shape']}" for s in self.inputs)
        return f"SavedGraph({self.name}({ins}), target={self.manifest['target']['string']!r}, path='{self.path}')"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the program once; outputs come back in the graph's output structure, as numpy
        arrays for numpy inputs and torch tensors for torch inputs. Arguments go by position:
        the artifact keeps build()'s order, not its parameter names."""
        if kwargs:
            ins = ", ".join(f"{s['name']}: {s['dtype']}{s['shape']}" for s in self.inputs)
            raise SavedGraphInputError(f"{self.name}: a saved graph takes its arguments by position, in build()'s "
                                       f"order ({ins}); got keyword argument(s) {', '.join(map(repr, kwargs))}")
        if len(args) != len(self._args.children):
            ins = ", ".join(f"{s['name']}: {s['dtype']}{s['shape']}" for s in self.inputs)
            raise SavedGraphInputError(f"{self.name} takes {len(self._args.children)} argument(s) but {len(args)} "
                                       f"were given; call it with the arguments of build() ({ins})")
        leaves: list = []
        for i, (child, arg) in enumerate(zip(self._args.children, args)):
            child.flatten(arg, f"{self.name}: argument {i}", leaves)
        use_torch = any(type(v).__module__.startswith("torch") for _, v in leaves)
        flat = [self._check(i, value, use_torch) for i, (_, value) in enumerate(leaves)]
        rng = [self._seed()] if any(k == "rng" for k, _ in self._sources) else []
        state = self._program_state()
        results = self._entry(*flat, *rng, *state, *self._optimizer_inputs(), *self._packed)
        n_mut, n_user = len(self._mutations), self._num_user_outputs
        for (kind, target), value in zip(self._mutations, results[:n_mut]):
            if kind == "user":
                _copy_into(leaves[int(target)][1], value)
            else:
                self._state[target] = value
        outs = [_as(value, use_torch) for value in results[n_mut:n_mut + n_user]]
        if self._training is not None:
            self._keep_update(results[n_mut + n_user + int(self._has_loss):])
        return self._outs.unflatten(iter(outs))

    def _pack_weights(self) -> list:
        """The weights an inference program takes packed (its `pack_weights` function, see
        tvmgraph/frozen_weights.py), packed once: nothing but the program changes them."""
        try:
            pack = releasing(self._vm, PACK_FUNCTION)
        except AttributeError:  # TVM's answer for a function the program does not have
            return []
        return list(pack(*self._program_state()))

    def _program_state(self) -> list:
        """The parameters, buffers and constants the program takes after its inputs, in order."""
        return [self._state[t] for k, t in self._sources if k in ("parameter", "buffer", "constant")]

    def _optimizer_inputs(self) -> list:
        """A train step's optimizer state, then one float64 hyperparameter vector per group."""
        if self._training is None:
            return []
        import tvm

        hypers = [tvm.runtime.tensor(np.asarray(h[self._phase], dtype=np.float64), self._dev) for h in self._hypers]
        return [*self._optimizer_state, *hypers]

    def _keep_update(self, tail: Sequence[Any]) -> None:
        """Keep `new_params..., new_states...` (the end of train_step's results)."""
        params = self._training["params"]
        for name, value in zip(params, tail[:len(params)]):
            self._state[name] = value
        self._optimizer_state = list(tail[len(params):])
        self._steps += 1

    def state_dict(self) -> dict[str, np.ndarray]:
        """The parameters and buffers as numpy arrays, by their path in the graph (a train step's
        trained values)."""
        kinds = ("parameter", "buffer")
        return {t: self._state[t].numpy() for k, t in self._sources if k in kinds}

    @property
    def hyperparameters(self) -> list[dict[str, float]]:
        """A train step's hyperparameters per param group, as its next call uses them."""
        if self._training is None:
            return []
        return [dict(zip(g["hyper_keys"], h[self._phase])) for g, h in zip(self._training["groups"], self._hypers)]

    @property
    def _phase(self) -> str:
        """Which hyperparameter vectors the next call takes (SGD's first step differs)."""
        return "first_call" if self._steps == 0 else "later_calls"

    def set_hyperparameter(self, key: str, value: float, group: int | None = None) -> None:
        """Set a train step's hyperparameter (`lr`, `weight_decay`, ...) for every param group,
        or for group `group` (in add_optimizer order)."""
        if self._training is None:
            raise SavedGraphInputError(f"{self.name}: this saved graph is its {self.program} program, which has "
                                       f"no optimizer; save it with program='train_step' to train it")
        groups = self._training["groups"]
        if group is not None and not 0 <= group < len(groups):
            raise SavedGraphInputError(f"{self.name}: group={group}; the saved train step has {len(groups)} "
                                       f"param group(s), 0 to {len(groups) - 1}")
        for i, g in enumerate(groups):
            if group is not None and i != group:
                continue
            if key not in g["hyper_keys"] or key == "first":
                names = ", ".join(k for k in g["hyper_keys"] if k != "first")
                raise SavedGraphInputError(f"{self.name}: param group {i} ({g['optimizer']}) has no "
                                           f"hyperparameter {key!r}; it has {names}")
            was_zero = g.get("compiled_zero", {}).get(key)
            if was_zero is not None and was_zero != (float(value) == 0):
                raise SavedGraphInputError(
                    f"{self.name}: param group {i} ({g['optimizer']}) was saved with {key} "
                    f"{'0' if was_zero else 'non-zero'}, and its program "
                    f"{'leaves that term out' if was_zero else 'keeps that term'}; {key}={value} needs another "
                    f"program: set it on the optimizer, call the graph, and save the train step again")
        for i, (g, h) in enumerate(zip(groups, self._hypers)):
            if group is None or i == group:
                slot = g["hyper_keys"].index(key)
                h["first_call"][slot] = h["later_calls"][slot] = float(value)

    def _check(self, index: int, value: Any, use_torch: bool) -> Any:
        spec = self.inputs[index]
        where = f"{self.name}: input '{spec['name']}'"
        want = f"{spec['dtype']}{spec['shape']}"
        if use_torch:
            import torch

            if not isinstance(value, torch.Tensor):
                raise SavedGraphInputError(f"{where} is a {type(value).__name__}; pass torch tensors for every "
                                           f"input, or numpy arrays for every input (expected {want})")
            dtype, shape = str(value.dtype).removeprefix("torch."), list(value.shape)
            if value.device.type != self._dev_type():
                raise SavedGraphInputError(f"{where} is on {value.device} but the graph runs on "
                                           f"{self._dev_type()}; move it with .to({self._dev_type()!r})")
        else:
            if not isinstance(value, np.ndarray):
                raise SavedGraphInputError(f"{where} is a {type(value).__name__}, not a numpy array or torch tensor "
                                           f"(expected {want}); pass np.asarray(value, dtype={spec['dtype']!r})")
            dtype, shape = str(value.dtype), list(value.shape)
        if dtype != spec["dtype"] or shape != spec["shape"]:
            raise SavedGraphInputError(f"{where} is {dtype}{shape} but the graph was saved for {want}; a saved graph "
                                       f"runs only the shapes and dtypes it was compiled for (save one per shape)")
        if use_torch:  # a misaligned view would crash the kernels (inputs.py): those are copied
            from .inputs import runnable

            return runnable(value)
        import tvm

        return tvm.runtime.tensor(np.ascontiguousarray(value), self._dev)

    def _dev_type(self) -> str:
        return "cpu" if self._dev.dlpack_device_type() == 1 else "cuda"

    def _seed(self):
        import tvm

        return tvm.runtime.tensor(np.random.randint(0, 2**31 - 1, size=(2,), dtype=np.int64), self._dev)


def _as(value: Any, use_torch: bool) -> Any:
    if use_torch:
        import torch

        return value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
    return value.numpy() if not isinstance(value, np.ndarray) else value


def _copy_into(dest: Any, value: Any) -> None:
    if isinstance(dest, np.ndarray):
        np.copyto(dest, _as(value, False))
    else:
        dest.copy_(_as(value, True))


def _read_state(params: bytes, constants: Sequence[Mapping[str, Any]], blob: bytes) -> dict[str, np.ndarray]:
    """Parameters and buffers from safetensors, constants from their raw-bytes table."""
    state = {}
    if params:
        from safetensors.numpy import load as load_safetensors

        state.update(load_safetensors(params))
    for row in constants:
        dtype, shape = np.dtype(row["dtype"]), tuple(row["shape"])
        offset, size = row["offset"], row["bytes"]
        if size != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or offset < 0 or offset + size > len(blob):
            raise ValueError(f"constant {row['name']!r}: {size} bytes at {offset} do not hold {dtype}{list(shape)}")
        state[row["name"]] = np.frombuffer(blob, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)),
                                           offset=offset).reshape(shape).copy()
    return state


def load(path: str | Path, device: Any = None) -> SavedGraph:
    """Load a graph saved by `tvmgraph.save`: check its manifest and every file's sha256, then
    load its library onto `device` (default: the device it was built for, `cpu` or `cuda:0`).

    Loading runs native code from the directory, like unpickling: load only what you trust.
    Raises `SavedGraphError` naming the file and the reason when anything does not check out.
    """
    path = Path(path)
    if not path.is_dir():
        raise _refuse(path, "directory", "does not exist" if not path.exists() else "is not a directory",
                      "Pass the directory that tvmgraph.save wrote.")
    try:
        doc = read_document(path / MANIFEST)
    except ArtifactFormatError as e:
        raise _refuse(path, MANIFEST, str(e).removeprefix(f"{MANIFEST} "),
                      "Pass the directory that tvmgraph.save wrote, copied whole.") from None
    _check_manifest(path, doc)
    listed = doc.get("files") if isinstance(doc.get("files"), dict) else {}
    try:
        files = verify_files(path, doc, MANIFEST, read=[n for n in (doc.get("parameters"), "constants.bin")
                                                        if n in listed])
    except ArtifactFormatError as e:
        name, _, reason = str(e).partition(" ")
        raise _refuse(path, name, reason, "The directory is damaged or was changed after saving: copy it again "
                      "from where it was saved.") from None
    try:
        return SavedGraph(path, doc, files, device)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, SavedGraphError | SavedGraphInputError):
            raise
        raise _refuse(path, MANIFEST, f"is malformed ({type(e).__name__}: {e})", "Save the graph again.") from None

"""Compiled graphs as persistent artifacts: the cache key of a traced graph, and loading and
storing entries of the compiled cache (tvmgraph/compiled_cache.py).

The key is made of named parts (tvmgraph/cache_key.py): the traced program (every FX node with
its shapes and dtypes), the lifted constants' values, the call signature, the training plan,
the graph config, the target, the pass pipeline, the versions of torch/TVM/tvm-ffi, and a hash
of tvmgraph's own source. What the key ignores cannot change the compiled code: the graph's
name, the parameters' values (they are inputs), and debug settings.

An entry's metadata is JSON, written and read by the explicit codecs below (no pickle: reading
a cache entry never runs code): the `LoweredSignature` (constant tensors go, as raw bytes, into
the entry's `constants.bin`), the `TrainStepLayout` and the target.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import tvm

from .cache_key import Part, cache_key
from .compiled_cache import CompiledCache

from .config import CompileOptions, GraphConfig, compile_options, settings
from .lower import InputSource, LoweredSignature
from .stages import TracedGraph
from .training.plan import TrainingPlan
from .training.train_step import TrainStepLayout

CONSTANTS = "constants.bin"


@functools.cache
def source_fingerprint() -> str:
    """sha256 of tvmgraph's, relay_passes' and autotune's Python sources: a code change is a new key."""
    import autotune
    import relay_passes

    h = hashlib.sha256()
    for package in (Path(__file__).parent, Path(relay_passes.__file__).parent, Path(autotune.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            h.update(str(path.relative_to(package.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _meta(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_meta(v) for v in value) + ")"
    return type(value).__name__


def program_text(exported: torch.export.ExportedProgram) -> str:
    """Every node of the traced program with its op, arguments and result shapes, one a line;
    the bodies of its submodules too (an autocast region, torch.cond's branches), which the
    top graph names only (`wrap_with_autocast(..., submod_1, ...)`)."""
    lines = [str(exported.graph_signature)]
    for path, module in exported.graph_module.named_modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        lines.append(f"module {path}")
        for node in module.graph.nodes:
            lines.append(f"{node.op} {node.name} {node.target} {node.args} {node.kwargs} "
                         f"{_meta(node.meta.get('val'))}")
    return "\n".join(lines)


def _constants(exported: torch.export.ExportedProgram) -> bytes:
    h = hashlib.sha256()
    for name, value in sorted(exported.constants.items()):
        h.update(name.encode())
        if isinstance(value, torch.Tensor):  # raw bytes: numpy has no bfloat16
            value = value.detach().cpu().contiguous()
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def key_parts(traced: TracedGraph, plan: TrainingPlan | None, config: CompileOptions | GraphConfig,
              target: tvm.target.Target, pipeline: str, tuning: str = "none") -> list[Part]:
    """The named parts of a compiled-cache key; `tuning` is the digest of the tuning-log records
    the compile applies (a changed log is a new key)."""
    import tvm_ffi

    sig = traced.signature
    return [
        ("program", program_text(traced.result.exported)),
        ("constants", _constants(traced.result.exported)),
        # sig.optimizers holds object ids (per process); the plan below names parameters by path
        ("signature", repr((sig.args, sig.leaves, sig.module_modes))),
        ("training", repr(plan.structure()) if plan is not None else "inference"),
        # Every option that shapes code, the process-wide codegen settings included.
        ("options", repr(compile_options(config))),
        ("target", str(target)),
        ("pipeline", pipeline),
        ("tuning", tuning),
        ("versions", f"torch {torch.__version__}; tvm {tvm.__version__}; tvm-ffi {tvm_ffi.__version__}"),
        ("tvmgraph", source_fingerprint()),
    ]


def graph_key(graph_class: str, traced: TracedGraph, plan: TrainingPlan | None, config: CompileOptions | GraphConfig,
              target: tvm.target.Target, pipeline: str, tuning: str = "none") -> str:
    """The compiled-cache key of `traced` compiled with these settings."""
    return cache_key(graph_class, key_parts(traced, plan, config, target, pipeline, tuning))


# ---- metadata as JSON: each codec written out, each reader checking every type ----

def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _str(value: Any, optional: bool = False) -> str | None:
    if not (isinstance(value, str) or (optional and value is None)):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {value!r}")
    return value


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(_int(d) for d in _list(value))


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, _str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _source_from_json(value: Any) -> InputSource:
    kind, target = _list(value)
    if kind not in ("user", "parameter", "buffer", "constant", "rng"):
        raise ValueError(f"unknown input kind {kind!r}")
    return InputSource(kind, _str(target, optional=True))


def _constants_to_json(constants: Mapping[str, Any]) -> tuple[list[dict[str, Any]], bytes]:
    """A table of (name, dtype, shape, device, offset, bytes) and the tensors' bytes, concatenated."""
    table, blob = [], bytearray()
    for name, value in constants.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"constant {name!r} is a {type(value).__name__}, not a tensor: it cannot be cached")
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype, bfloat16 included
        table.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                      "device": str(value.device), "offset": len(blob), "bytes": len(raw)})
        blob += raw
    return table, bytes(blob)


def _constants_from_json(table: Any, blob: bytes) -> dict[str, torch.Tensor]:
    constants = {}
    for row in _list(table):
        dtype, shape = _dtype(row["dtype"]), _shape(row["shape"])
        offset, size = _int(row["offset"]), _int(row["bytes"])
        if size != math.prod(shape) * dtype.itemsize or offset < 0 or offset + size > len(blob):
            raise ValueError(f"constant {row['name']!r}: {size} bytes at {offset} do not hold {dtype}{list(shape)}")
        if size == 0:
            t = torch.empty(shape, dtype=dtype)
        else:  # a bytearray: torch warns about (and must not write into) read-only buffers
            t = torch.frombuffer(bytearray(blob[offset:offset + size]), dtype=torch.uint8).view(dtype).reshape(shape)
        constants[_str(row["name"])] = t.to(torch.device(_str(row["device"])))
    return constants


def signature_to_json(sig: LoweredSignature) -> tuple[dict[str, Any], bytes]:
    """The signature as a JSON document, and its constant tensors' bytes (see `_constants_to_json`)."""
    constants, blob = _constants_to_json(sig.constants)
    doc = {
        "inputs": [[s.kind, s.target] for s in sig.inputs],
        "mutations": [[s.kind, s.target] for s in sig.mutations],
        "num_user_outputs": sig.num_user_outputs,
        "has_loss": sig.has_loss,
        "constants": constants,
        "input_types": [[list(shape), dtype] for shape, dtype in sig.input_types],
        "returned_inputs": [list(pair) for pair in sig.returned_inputs],
    }
    return doc, blob


def signature_from_json(doc: Mapping[str, Any], blob: bytes) -> LoweredSignature:
    """Inverse of `signature_to_json`; raises ValueError (or KeyError) on anything malformed."""
    if not isinstance(doc["has_loss"], bool):
        raise ValueError(f"has_loss: expected a bool, got {doc['has_loss']!r}")
    types = []
    for shape, dtype in map(_list, _list(doc["input_types"])):
        _dtype(dtype)  # a dtype name torch knows
        types.append((_shape(shape), dtype))
    return LoweredSignature(
        inputs=tuple(_source_from_json(s) for s in _list(doc["inputs"])),
        mutations=tuple(_source_from_json(s) for s in _list(doc["mutations"])),
        num_user_outputs=_int(doc["num_user_outputs"]),
        has_loss=doc["has_loss"],
        constants=_constants_from_json(doc["constants"], blob),
        input_types=tuple(types),
        # (absent from artifacts written before it: no output is an input then)
        returned_inputs=tuple((_int(i), _int(k)) for i, k in map(_list, _list(doc.get("returned_inputs", [])))),
    )


def layout_to_json(layout: TrainStepLayout) -> dict[str, Any]:
    """The training step's layout as a JSON document."""
    return {
        "grad_indices": list(layout.grad_indices),
        "state_shapes": [[target, key, list(shape), dtype] for target, key, shape, dtype in layout.state_shapes],
        "num_groups": layout.num_groups,
        "accumulation_steps": layout.accumulation_steps,
        "loss_scaling": layout.loss_scaling,
        "ranks": layout.ranks,
        "pipelined": layout.pipelined,
        "input_grads": list(layout.input_grads),
    }


def layout_from_json(doc: Mapping[str, Any]) -> TrainStepLayout:
    """Inverse of `layout_to_json`; raises ValueError (or KeyError) on anything malformed."""
    states = []
    for target, key, shape, dtype in map(_list, _list(doc["state_shapes"])):
        _dtype(dtype)
        states.append((_str(target), _str(key), _shape(shape), dtype))
    return TrainStepLayout(tuple(_int(i) for i in _list(doc["grad_indices"])), tuple(states),
                           _int(doc["num_groups"]), accumulation_steps=_int(doc["accumulation_steps"]),
                           loss_scaling=doc.get("loss_scaling", False) is True, ranks=_int(doc["ranks"]),
                           pipelined=doc.get("pipelined", False) is True,
                           input_grads=tuple(_int(i) for i in _list(doc.get("input_grads", []))))


def encode_meta(meta: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """A compiled program's cache metadata (`CompiledProgram.meta()`) as a JSON document
    plus data files."""
    signature, blob = signature_to_json(meta["signature"])
    layout = meta["train_layout"]
    doc = {"signature": signature, "train_layout": layout_to_json(layout) if layout is not None else None,
           "target": str(meta["target"])}
    return doc, {CONSTANTS: blob} if blob else {}


def decode_meta(doc: Mapping[str, Any], files: Mapping[str, bytes]) -> dict[str, Any]:
    """Inverse of `encode_meta`, from a verified entry."""
    layout = doc["train_layout"]
    return {"signature": signature_from_json(doc["signature"], files.get(CONSTANTS, b"")),
            "train_layout": layout_from_json(layout) if layout is not None else None,
            "target": _str(doc["target"])}


def compiled_cache() -> CompiledCache | None:
    """The process's compiled cache, or None when TVMGRAPH_COMPILE_CACHE=0."""
    if not settings.compile_cache:
        return None
    return CompiledCache(settings.cache_dir / "compiled", settings.cache_max_bytes, encode_meta, decode_meta)


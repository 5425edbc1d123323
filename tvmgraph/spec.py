"""What a graph call looks like from outside: tensor specs, argument trees and call signatures.

A `build()` argument or result is a tree whose leaves are tensors and whose inner nodes are lists,
tuples or None (seed 002: "Tensor, list of Tensor, None"). `flatten` turns a tree into its leaves
plus a `TreeDef`; `TreeDef.unflatten` puts leaves back. A `Signature` is everything a compiled
entry depends on; two calls with equal signatures share one compiled program.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape, dtype and device of one tensor leaf, e.g. `Tensor([64, 784], float32, cpu)`.

    A dynamic batch dim (tvmgraph/dynamic_batch.py) is `None`: `Tensor([batch, 784], ...)`.
    """

    shape: tuple[int | None, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(t.shape), t.dtype, t.device)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def __repr__(self) -> str:
        return f"Tensor([{self._dims()}], {self.dtype_name}, {self.device})"

    def describe(self) -> str:
        """Short form used in error messages: `float32[64, 784]`, `float32[batch, 784]`."""
        return f"{self.dtype_name}[{self._dims()}]"

    def _dims(self) -> str:
        return ", ".join("batch" if d is None else str(d) for d in self.shape)


@dataclass(frozen=True, slots=True)
class TreeDef:
    """The structure of an argument tree with its tensor leaves taken out.

    `kind` is "tensor", "none", "list", "tuple" or "dict"; `children` hold the sub-structures,
    and a dict's `keys` its keys in order (a model's `{"logits": ..., "loss": ...}`). A
    namedtuple is a "tuple" with its class in `cls`, rebuilt as that class (`out.logits`).
    """

    kind: str
    children: tuple[TreeDef, ...] = ()
    keys: tuple[str, ...] = ()
    cls: type | None = None

    @property
    def num_leaves(self) -> int:
        if self.kind == "tensor":
            return 1
        return sum(c.num_leaves for c in self.children)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """Rebuild the tree from `leaves`, in the order `flatten` produced them."""
        it = iter(leaves)
        out = self._build(it)
        if next(it, _END) is not _END:
            raise ValueError("more leaves than the tree has slots")
        return out

    def _build(self, it: Any) -> Any:
        if self.kind == "tensor":
            return next(it)
        if self.kind == "none":
            return None
        items = [c._build(it) for c in self.children]
        if self.kind == "dict":
            return dict(zip(self.keys, items))
        if self.cls is not None:
            return self.cls(*items)
        return items if self.kind == "list" else tuple(items)

    def leaf_paths(self, prefix: str) -> list[str]:
        """Names of the leaves: `prefix` for a lone tensor, `prefix.1.0` inside lists."""
        if self.kind == "tensor":
            return [prefix]
        out: list[str] = []
        for i, c in enumerate(self.children):
            out.extend(c.leaf_paths(f"{prefix}.{self.keys[i] if self.kind == 'dict' else i}"))
        return out

    def __repr__(self) -> str:
        if self.kind in ("tensor", "none"):
            return "T" if self.kind == "tensor" else "None"
        if self.kind == "dict":
            return "{" + ", ".join(f"{k!r}: {c!r}" for k, c in zip(self.keys, self.children)) + "}"
        inner = ", ".join(map(repr, self.children))
        if self.cls is not None:
            return f"{self.cls.__name__}({inner})"
        return f"[{inner}]" if self.kind == "list" else f"({inner}{',' if len(self.children) == 1 else ''})"


_END = object()


class NotATreeError(TypeError):
    """A value in an argument tree is not a Tensor, list, tuple, dict with string keys or None;
    `path` says where."""

    def __init__(self, path: str, value: Any):
        super().__init__(path)
        self.path = path
        self.value = value


_TENSOR = TreeDef("tensor")


@functools.cache
def tuple_of_tensors(n: int) -> TreeDef:
    """The tree of n tensor arguments (one object per n: compared by identity)."""
    return TreeDef("tuple", (_TENSOR,) * n)


def flatten(tree: Any, path: str = "") -> tuple[list[torch.Tensor], TreeDef]:
    """Split `tree` into its tensor leaves and its structure; raise NotATreeError on other types."""
    if isinstance(tree, torch.Tensor):
        return [tree], _TENSOR
    if type(tree) is tuple and all(isinstance(t, torch.Tensor) for t in tree):
        # A graph's arguments, most of the time: one shared TreeDef, compared by identity later.
        return list(tree), tuple_of_tensors(len(tree))
    if tree is None:
        return [], TreeDef("none")
    if isinstance(tree, (list, tuple)):
        leaves: list[torch.Tensor] = []
        children = []
        for i, item in enumerate(tree):
            sub_leaves, sub_def = flatten(item, f"{path}[{i}]")
            leaves.extend(sub_leaves)
            children.append(sub_def)
        named = type(tree) if isinstance(tree, tuple) and hasattr(type(tree), "_fields") else None
        return leaves, TreeDef("list" if isinstance(tree, list) else "tuple", tuple(children), cls=named)
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        leaves, children = [], []
        for key, item in tree.items():
            sub_leaves, sub_def = flatten(item, f"{path}[{key!r}]")
            leaves.extend(sub_leaves)
            children.append(sub_def)
        return leaves, TreeDef("dict", tuple(children), tuple(tree))
    raise NotATreeError(path, tree)


@dataclass(frozen=True, slots=True)
class Signature:
    """Everything a compiled entry depends on besides the code of `build()` itself: its guards.

    `module_modes` holds `training` of every module in the graph (train/eval changes the
    program: batch norm and dropout behave differently), in `named_modules()` order; the module
    paths in that order are passed to `differences` for messages. `structure` fingerprints the
    modules, parameters and buffers (tvmgraph/guards.py). `optimizers` holds what about each
    optimizer shapes the program (a learning rate does not: it is an input). `options` is the
    `CompileOptions` snapshot (graph config and process-wide codegen settings). `default_dtype`
    is `torch.get_default_dtype()`: build()'s `torch.ones(2)` and Python floats take it.
    """

    args: TreeDef
    leaves: tuple[TensorSpec, ...]
    module_modes: tuple[bool, ...]
    optimizers: tuple = ()
    structure: Any = None  # guards.ModuleStructure
    options: Any = None  # config.CompileOptions
    default_dtype: Any = None  # torch.dtype

    def differences(self, other: Signature, arg_names: Sequence[str], module_paths: Sequence[str]) -> list[str]:
        """Human-readable list of what differs from `other` (an earlier signature)."""
        diffs = []
        if self.args != other.args:
            diffs.append(f"argument structure {other.args!r} became {self.args!r}")
        else:
            paths = [p for name, sub in zip(arg_names, self.args.children) for p in sub.leaf_paths(name)]
            for path, new, old in zip(paths, self.leaves, other.leaves):
                if new != old:
                    diffs.append(f"argument '{path}' was {old.describe()} on {old.device}, "
                                 f"now {new.describe()} on {new.device}")
        if self.structure != other.structure and self.structure is not None and other.structure is not None:
            changes = self.structure.differences(other.structure)
            more = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
            diffs.append(f"model structure changed: {'; '.join(changes[:3])}{more}")
        elif self.module_modes != other.module_modes:
            changed = [f"'{path}' {_mode(old)} -> {_mode(now)}"
                       for path, old, now in zip(module_paths, other.module_modes, self.module_modes)
                       if old != now]
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            diffs.append(f"module mode changed: {', '.join(changed[:3])}{more}")
        if self.optimizers != other.optimizers:
            diffs.append("optimizer options that shape the program changed (momentum/nesterov/"
                         "amsgrad/maximize/weight decay on-off, param groups, requires_grad, clipping)")
        if self.options != other.options and self.options is not None and other.options is not None:
            diffs.append(f"compile options changed: {', '.join(self.options.changes_from(other.options))}")
        if self.default_dtype != other.default_dtype:
            diffs.append(f"torch.get_default_dtype() was {other.default_dtype}, now {self.default_dtype}")
        return diffs


def _mode(training: bool) -> str:
    return "train" if training else "eval"

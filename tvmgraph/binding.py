"""How a compiled program finds the live parameters, buffers and tensor attributes of the
user's modules.

The program takes every parameter and buffer as an argument. At each call `TensorBinder` reads
them from the modules' own `_parameters`/`_buffers` dicts, so the program always sees what
eager code sees: an in-place update (`p.data.mul_(2)`, `load_state_dict`) or a replaced
Parameter object is picked up by the next call without recompiling, and nothing is copied,
unless a tensor's layout does not suit the kernels (a misaligned view, channels_last):
`CompiledGraph.run` then passes a copy and writes updates back into the tensor (inputs.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .lower import InputSource


class TensorBinder:
    """Resolves `InputSource`s (module paths like `model.0.weight`) to live tensors."""

    __slots__ = ("_slots", "_constants", "sources")

    def __init__(self, sources: tuple[InputSource, ...], modules: Mapping[str, torch.nn.Module],
                 constants: Mapping[str, torch.Tensor]):
        self.sources = [s for s in sources if s.kind in ("parameter", "buffer", "constant")]
        self._constants = dict(constants)
        self._slots: list[tuple[dict, str]] = [self._slot(s, modules) for s in self.sources]

    def _slot(self, source: InputSource, modules: Mapping[str, torch.nn.Module]) -> tuple[dict, str]:
        if source.kind == "constant":
            return self._attribute_slot(source.target, modules) or (self._constants, source.target)
        owner, leaf = _owner(source.target, modules)
        table = owner._parameters if source.kind == "parameter" else owner._buffers
        if leaf not in table:
            raise KeyError(f"{source.kind} '{source.target}' is no longer registered on its module")
        return table, leaf

    @staticmethod
    def _attribute_slot(target: str, modules: Mapping[str, torch.nn.Module]) -> tuple[dict, str] | None:
        """A constant that is a module's plain tensor attribute (`self.mask = torch.ones(4)`),
        read from the module like a buffer: an in-place change, or another tensor of the same
        shape and dtype put in its place, is seen, also by a program loaded from the compiled
        cache, whose stored constants are copies (one of another shape recompiles:
        attribute_guard.py). None for a constant build() made itself."""
        try:
            owner, leaf = _owner(target, modules)
        except (KeyError, AttributeError):  # no module of the graph on that path
            return None
        attrs = owner.__dict__
        return (attrs, leaf) if isinstance(attrs.get(leaf), torch.Tensor) else None

    def tensors(self) -> list[torch.Tensor]:
        """The current tensors, in the program's argument order."""
        return [table[leaf] for table, leaf in self._slots]

    def named(self) -> dict[str, torch.Tensor]:
        return {s.target: t for s, t in zip(self.sources, self.tensors())}


def _owner(target: str, modules: Mapping[str, torch.nn.Module]) -> tuple[torch.nn.Module, str]:
    """The module that `target` (`model.0.weight`: a graph attribute, then a path) names a
    tensor of, and the tensor's name on it."""
    top, _, rest = target.partition(".")
    owner_path, _, leaf = rest.rpartition(".")
    return (modules[top].get_submodule(owner_path) if owner_path else modules[top]), leaf

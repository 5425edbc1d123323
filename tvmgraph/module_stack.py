"""Which module was running when tracing failed, for the TraceError to name.

torch.export runs build() in Python; an error inside a module's forward (a Linear given 5
features where it takes 4) comes back as torch's own message, which names neither the module
nor the input: "a and b must have same reduction dim, but got [6, 5] X [4, 8]". While tracing,
each module's forward pre-hook pushes (path, module, input shapes) and its forward hook pops
it; an exception skips the pops, so what the stack holds then is the chain of calls the error
left, innermost last.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import TensorSpec


@dataclass(frozen=True)
class Call:
    path: str
    module: torch.nn.Module
    inputs: tuple[TensorSpec, ...]
    others: tuple[str, ...] = ()  # the type names of its other arguments (not None)

    def describe(self) -> str:
        module = f"{type(self.module).__name__}({self.module.extra_repr()})"
        shown = [spec.describe() for spec in self.inputs[:4]]
        more = f" and {len(self.inputs) - 4} more tensors" if len(self.inputs) > 4 else ""
        shown += [f"a {name}" for name in self.others[:2]]
        if not shown:
            return f"'{self.path}', {module}, called with no tensor"
        return f"'{self.path}', {module}, called with {', '.join(shown)}{more}"


class ModuleStack:
    """The modules under `root` whose forward is running (see the module docstring)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.calls: list[Call] = []
        self.handles = []
        for path, module in root.named_modules():
            if path:
                self.handles.append(module.register_forward_pre_hook(self._enter(path), with_kwargs=True))
                self.handles.append(module.register_forward_hook(self._leave(path)))

    def _enter(self, path: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            values = (*args, *kwargs.values())
            tensors = [a for a in values if isinstance(a, torch.Tensor)]
            others = tuple(type(a).__name__ for a in values if a is not None and not isinstance(a, torch.Tensor))
            self.calls.append(Call(path, module, tuple(TensorSpec.of(t) for t in tensors), others))

        return hook

    def _leave(self, path: str):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            if self.calls and self.calls[-1].path == path:
                self.calls.pop()

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def hint(self) -> str:
        """The TraceError's line for the module the error left running, or ""."""
        if not self.calls:
            return ""
        if any("PackedSequence" in call.others for call in self.calls):
            return (f"\nRaised inside {self.calls[-1].describe()}. A PackedSequence cannot go through a graph: "
                    f"the RNN reads its batch_sizes, which are data, as shapes. Pass the padded batch "
                    f"(nn.utils.rnn.pad_sequence) and mask the padded steps, or run the RNN eagerly "
                    f"outside the graph.")
        return (f"\nRaised inside {self.calls[-1].describe()}. If eager torch raises the same, these "
                f"inputs do not fit that module: compare their shapes and dtypes with its sizes.")

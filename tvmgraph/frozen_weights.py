"""Frozen weights (`graph.config.enable_frozen_weights()`): what an inference program may
compute once, and the runner's copies of it.

`mark_frozen_state` tells the pass pipeline which of main's parameters are state that the
program does not write (parameters, buffers and constants it does not mutate) and where the
state starts; relay_passes/weight_packing.py then moves what main computes from those alone
(the matmuls' packed weights among it) into a function of its own,
`pack_weights(state...) -> (results...)`, whose results main takes last.

`PackedWeights` runs `pack_weights` when the state changed since it last did: a tensor replaced
(another object or storage) or changed in place through itself (torch's version counter).
Writes torch does not count (`w.data.copy_(...)`, numpy views, fused optimizers) need
`refresh()` (`graph.refresh_weights()`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import tvm
from tvm import relax

from relay_passes.weight_packing import FROZEN_PARAMS, PACK_FUNCTION

from .lower import LoweredSignature
from .vm_results import releasing

STATE_KINDS = ("parameter", "buffer", "constant")


def mark_frozen_state(mod: tvm.IRModule, signature: LoweredSignature) -> tvm.IRModule:
    """`mod` with main's `num_input` (its per-call inputs: user tensors and the seed) and
    FROZEN_PARAMS (its state parameters that the program does not write) set."""
    mutated = {s.target for s in signature.mutations if s.kind != "user"}
    num_input = sum(s.kind not in STATE_KINDS for s in signature.inputs)
    frozen = [i for i, s in enumerate(signature.inputs) if s.kind in STATE_KINDS and s.target not in mutated]
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod["main"] = mod["main"].with_attr("num_input", num_input).with_attr(FROZEN_PARAMS, frozen)
    return mod


class PackedWeights:
    """The results of a program's `pack_weights` for the state tensors they were made from."""

    __slots__ = ("_pack", "_made_from", "_packed")

    def __init__(self, pack: Callable[..., list]) -> None:
        self._pack = pack
        self._made_from: tuple[tuple[torch.Tensor, int, int], ...] | None = None
        self._packed: tuple = ()

    @classmethod
    def of(cls, vm: relax.VirtualMachine) -> PackedWeights | None:
        """The packed weights of the program `vm` runs; None when it packs none."""
        try:
            return cls(releasing(vm, PACK_FUNCTION))
        except AttributeError:  # TVM's answer for a function the program does not have
            return None

    def get(self, state: Sequence[torch.Tensor], passed: Sequence[torch.Tensor]) -> tuple:
        """The packed weights of `state` (the module's tensors; `passed`: as given to the
        program), packed again when a tensor is another object, storage or version than at the
        last packing."""
        made_from = tuple((t, t.data_ptr(), _version(t)) for t in state)
        if self._made_from is None or any(
                a is not b or pa != pb or va is None or va != vb
                for (a, pa, va), (b, pb, vb) in zip(made_from, self._made_from)):
            self._packed = tuple(self._pack(*passed))
            self._made_from = made_from
        return self._packed

    def refresh(self) -> None:
        """Pack again at the next call (after a write torch's version counter does not see)."""
        self._made_from = None
        self._packed = ()


def _version(t: torch.Tensor) -> int | None:
    """torch's count of `t`'s in-place changes; None for a tensor made under
    `torch.inference_mode`, which keeps no count (its weights are then packed on every call)."""
    try:
        return t._version
    except RuntimeError:
        return None

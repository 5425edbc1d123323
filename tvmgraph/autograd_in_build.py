"""What build() may ask of torch's autograd besides `loss.backward()`, and what a training graph
refuses.

The graph's gradients come from its own autodiff of the traced program (Relax's `Gradient`),
not from torch's autograd: whatever in build() would change what autograd computes must either
show in the traced program or be refused, never be dropped. Dropped, each of these trained
silently otherwise than eager:

- a `torch.autograd.Function` of the user's (a gradient reversal layer went the wrong way, a
  hand-written straight-through estimator lost its gradient; reentrant checkpointing trained
  nothing): refused, naming the class (`through_functions`);
- `loss.backward(inputs=[...])`: only those parameters train, as in eager (`parameters_named`);
- `torch.inference_mode()`: traced as `torch.no_grad()`, which export records (its gradient
  passed before);
- after `loss.backward()`, `zero_grad()` (eager's step then skips every parameter); at any point,
  `requires_grad_` on a parameter (export undoes it after tracing, and a use while it was off
  was differentiated), a tensor's `register_hook`, `retain_grad()`: refused (`Edits`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .errors import BackwardError

if TYPE_CHECKING:
    from .trace import _Record


@contextlib.contextmanager
def record_functions(record: _Record) -> Iterator[None]:
    """Note each torch.autograd.Function that build() applies in `record.functions`. Under AMP
    build() is traced with autograd off, and the loss has no autograd graph that would tell
    which of them it goes through: a training graph then refuses any."""
    function = torch.autograd.function.Function
    original = function.__dict__["apply"]  # a classmethod

    def apply(cls: type, *args: object, **kwargs: object) -> object:
        if cls not in record.functions:
            record.functions.append(cls)
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


def refused(functions: list[type]) -> list[type]:
    """The Functions of `functions` a training graph refuses: the user's, and torch's reentrant
    checkpoint. torch's others are ops whose backward is their forward's derivative, or module
    backward hooks' (refused on their own with UnsupportedOptionError, entry.py)."""
    from torch.utils.checkpoint import CheckpointFunction

    return [cls for cls in functions if cls is CheckpointFunction or not cls.__module__.startswith("torch.")]


def through_functions(graph_name: str, functions: list[type]) -> str:
    """Why a loss differentiated through `functions` (autograd.Function classes) is refused."""
    from torch.utils.checkpoint import CheckpointFunction

    if CheckpointFunction in functions:
        return (f"{graph_name}: build() uses torch.utils.checkpoint with use_reentrant=True on the way to the "
                f"loss; the graph's autodiff would not run its recomputation. Pass use_reentrant=False "
                f"(torch's recommendation), which the graph differentiates as eager does, or use "
                f"graph.<module>.to(tvmgraph.nn.GraphModule).activation_checkpointing = True.")
    names = ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in functions)
    return (f"{graph_name}: the loss is differentiated through torch.autograd.Function {names}: the graph "
            f"computes gradients with its own autodiff, which differentiates forward() and would not run "
            f"your backward(). Write the gradient with torch ops instead: a straight-through estimator as "
            f"`x + (f(x) - x).detach()`, a gradient reversal as `x.detach() - lam * (x - x.detach())`; "
            f"or run that part outside the graph.")


def parameters_named(graph_name: str, inputs: tuple[torch.Tensor, ...], root: torch.nn.Module) -> frozenset[str]:
    """The paths of the parameters `loss.backward(inputs=...)` listed; anything else listed
    (an activation, a tensor made in build()) is a BackwardError: the graph keeps gradients of
    parameters only."""
    path_of = {id(p): path for path, p in root.named_parameters()}
    others = [i for i, t in enumerate(inputs) if id(t) not in path_of]
    if others:
        raise BackwardError(f"{graph_name}: loss.backward(inputs=...) lists a tensor that is not a parameter of "
                            f"the graph's modules (position {others[0]}); the graph keeps gradients of "
                            f"parameters only. List parameters, or leave inputs out.")
    return frozenset(path_of[id(t)] for t in inputs)


@contextlib.contextmanager
def inference_mode_as_no_grad() -> Iterator[None]:
    """`torch.inference_mode()` (as a context or a decorator) enters `torch.no_grad()` while
    build() is traced: export records no_grad blocks (stop_gradient.py) and not inference mode."""
    cls = torch.autograd.grad_mode.inference_mode
    enter, leave = cls.__enter__, cls.__exit__

    def no_grad_enter(self: torch.autograd.grad_mode.inference_mode) -> None:
        self._tvmgraph_no_grad = torch.no_grad() if self.mode else contextlib.nullcontext()
        self._tvmgraph_no_grad.__enter__()

    def no_grad_exit(self: torch.autograd.grad_mode.inference_mode, *exc: object) -> None:
        self._tvmgraph_no_grad.__exit__(*exc)

    cls.__enter__, cls.__exit__ = no_grad_enter, no_grad_exit
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = enter, leave


class Edits:
    """While build() is traced: what it does to gradients that the graph cannot follow, kept
    until tracing knows whether build() trains (`refusal`): an inference graph may do any of it,
    as eager without a backward pass would be unaffected."""

    def __init__(self, record: _Record) -> None:
        self.record = record
        self.found: list[str] = []

    def refusal(self) -> str | None:
        """The BackwardError message for a training graph, or None."""
        if not self.found:
            return None
        return (f"{self.record.graph_name}: build() {self.found[0]}; the graph computes gradients with its own "
                f"autodiff of build()'s program, which cannot follow that. {_FIXES[self.found[0]]}")

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        module_requires_grad_, tensor_requires_grad_ = torch.nn.Module.requires_grad_, torch.Tensor.requires_grad_

        def zero_grad(*args: object, **kwargs: object) -> None:
            if self.record.backward is not None:
                self.found.append(_ZERO_GRAD)  # before backward() it changes nothing: no gradient exists yet

        def module_requires_grad(module: torch.nn.Module, requires_grad: bool = True) -> torch.nn.Module:
            if any(True for _ in module.parameters()):
                self.found.append(_REQUIRES_GRAD)
            return module_requires_grad_(module, requires_grad)

        def tensor_requires_grad(tensor: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
            if isinstance(tensor, torch.nn.Parameter):
                self.found.append(_REQUIRES_GRAD)
            return tensor_requires_grad_(tensor, requires_grad)

        def hook(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
            self.found.append(_HOOK)
            return _NoHandle()

        def retain_grad(tensor: torch.Tensor) -> None:
            self.found.append(_RETAIN_GRAD)

        patches = {
            (torch.nn.Module, "zero_grad"): zero_grad, (torch.optim.Optimizer, "zero_grad"): zero_grad,
            (torch.nn.Module, "requires_grad_"): module_requires_grad,
            (torch.Tensor, "requires_grad_"): tensor_requires_grad,
            (torch.Tensor, "register_hook"): hook, (torch.Tensor, "register_post_accumulate_grad_hook"): hook,
            (torch.Tensor, "retain_grad"): retain_grad,
        }
        # What each class defines itself, put back after; the others it inherits from torch's C base.
        own = {key: key[0].__dict__[key[1]] for key in patches if key[1] in key[0].__dict__}
        for (owner, name), patch in patches.items():
            setattr(owner, name, patch)
        try:
            yield
        finally:
            for owner, name in patches:
                if (owner, name) in own:
                    setattr(owner, name, own[owner, name])
                else:
                    delattr(owner, name)


class _NoHandle:
    """What a refused hook registration returns, so that build() can go on to its end."""

    def remove(self) -> None:
        pass


_ZERO_GRAD = "calls zero_grad() after loss.backward()"
_REQUIRES_GRAD = "changes requires_grad of a parameter (requires_grad_)"
_HOOK = "registers a gradient hook on a tensor (register_hook)"
_RETAIN_GRAD = "calls retain_grad() to read a tensor's .grad"
_FIXES = {
    _ZERO_GRAD: "In eager, the step after it would skip every parameter; the graph's step is implicit: "
                "remove the zero_grad() call (or the backward() before it).",
    _REQUIRES_GRAD: "Set requires_grad outside build() (the graph recompiles for the new set of trained "
                    "parameters); to keep one term from training a parameter, give that term "
                    "`p.detach()` (`F.linear(x, layer.weight.detach(), layer.bias.detach())`).",
    _HOOK: "Write what the hook does into build() with torch ops (a gradient scale `s` as "
           "`x * s + (x * (1 - s)).detach()`), or run that part outside the graph.",
    _RETAIN_GRAD: "Gradients of intermediate tensors do not exist outside the compiled program; compute what "
                  "you need from them outside the graph.",
}

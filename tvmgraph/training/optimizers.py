"""torch.optim optimizers, lowered: their update rules written as Relax expressions.

Sorted in order of increasing complexity: SGD, Adam, AdamW (Adam with decoupled decay).

An `UpdateRule` knows one optimizer class: which per-parameter state tensors it keeps (the same
keys torch keeps in `optimizer.state[p]`, so `optimizer.state_dict()` stays the source of truth),
which per-group hyperparameters travel as runtime inputs (so lr schedulers, and anything else
that edits `param_groups`, take effect without recompiling), which options change the program
itself (`structure`), and how to emit the update for one parameter.

Each update follows torch's single-tensor implementation (torch/optim/sgd.py, adam.py) step for
step; tests/numeric/test_training.py compares whole training runs against eager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tvm import relax

from ..errors import OptimizerError

Emit = Callable[[relax.Expr], relax.Var]


@dataclass(frozen=True)
class UpdateInputs:
    """Relax values one parameter's update reads."""

    param: relax.Expr
    grad: relax.Expr
    state: dict[str, relax.Expr]
    hyper: dict[str, relax.Expr]  # 0-d float32 tensors: lr, momentum, ...


def _scalar(v: float, like: relax.Expr) -> relax.Expr:
    return relax.const(v, like.ty.dtype.dtype)


def _cast(hyper: relax.Expr, like: relax.Expr) -> relax.Expr:
    dtype = like.ty.dtype.dtype
    return hyper if dtype == "float32" else relax.op.astype(hyper, dtype)


class UpdateRule:
    """How one torch optimizer class updates a parameter; subclasses fill in the details."""

    optimizer_class: type[torch.optim.Optimizer]
    hyper_keys: tuple[str, ...] = ()
    # Implementation switches of torch that have no meaning inside a compiled graph.
    unsupported: tuple[str, ...] = ("fused", "capturable", "differentiable")

    def check_group(self, group: dict, where: str) -> None:
        for key in self.unsupported:
            if group.get(key):
                raise OptimizerError(f"{where}: {self.optimizer_class.__name__}({key}={group[key]!r}) "
                                     f"is not supported in graph mode; leave {key} at its default")

    def structure(self, group: dict) -> tuple:
        """The options that change the program (a change compiles a new entry)."""
        raise NotImplementedError

    def state_keys_for(self, group: dict) -> tuple[str, ...]:
        """Keys of `optimizer.state[p]` this rule reads and writes, in a fixed order."""
        raise NotImplementedError

    def hyper_values(self, group: dict, fresh: bool) -> list[float]:
        """Runtime inputs in `hyper_keys` order; `fresh` says the group's state was just created."""
        return [float(group[k]) for k in self.hyper_keys]

    def init_state(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        """State tensors as torch creates them lazily before the first step."""
        raise NotImplementedError

    def emit_update(self, emit: Emit, x: UpdateInputs, group: dict) -> tuple[relax.Expr, dict[str, relax.Expr]]:
        """(new_param, new_state) for one parameter."""
        raise NotImplementedError


class SGD(UpdateRule):
    """torch.optim.SGD: momentum, dampening, nesterov, weight_decay, maximize."""

    optimizer_class = torch.optim.SGD
    hyper_keys = ("lr", "momentum", "dampening", "weight_decay", "first")

    def structure(self, group: dict) -> tuple:
        return (group["nesterov"], group["maximize"], group["momentum"] != 0,
                group["weight_decay"] != 0, group["dampening"] != 0)

    def state_keys_for(self, group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def hyper_values(self, group: dict, fresh: bool) -> list[float]:
        lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
        return [float(lr), float(group["momentum"]), float(group["dampening"]),
                float(group["weight_decay"]), 1.0 if fresh else 0.0]

    def init_state(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": torch.zeros_like(param, memory_format=torch.preserve_format)} \
            if group["momentum"] != 0 else {}

    def emit_update(self, emit: Emit, x: UpdateInputs, group: dict) -> tuple[relax.Expr, dict[str, relax.Expr]]:
        op, p = relax.op, x.param
        h = {k: _cast(v, p) for k, v in x.hyper.items()}
        g = emit(op.negative(x.grad)) if group["maximize"] else x.grad
        if group["weight_decay"] != 0:
            g = emit(op.add(g, op.multiply(h["weight_decay"], p)))
        state = {}
        if group["momentum"] != 0:
            buf = x.state["momentum_buffer"]
            # torch starts the buffer as a copy of the first gradient; a zero-initialised buffer
            # gives the same update when dampening is 0, otherwise the first step skips it.
            scale = op.subtract(_scalar(1.0, p), h["dampening"])
            if group["dampening"] != 0:
                scale = op.where(op.greater(h["first"], _scalar(0.5, p)), _scalar(1.0, p), scale)
            buf = emit(op.add(op.multiply(h["momentum"], buf), op.multiply(scale, g)))
            state["momentum_buffer"] = buf
            g = emit(op.add(g, op.multiply(h["momentum"], buf))) if group["nesterov"] else buf
        new_p = emit(op.subtract(p, op.multiply(h["lr"], g)))
        return new_p, state


class Adam(UpdateRule):
    """torch.optim.Adam: betas, eps, weight_decay (L2, added to the gradient), amsgrad, maximize."""

    optimizer_class = torch.optim.Adam
    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
    decoupled = False

    def structure(self, group: dict) -> tuple:
        return (group["amsgrad"], group["maximize"], group["weight_decay"] != 0,
                group.get("decoupled_weight_decay", False))

    def state_keys_for(self, group: dict) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def hyper_values(self, group: dict, fresh: bool) -> list[float]:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        beta1, beta2 = group["betas"]
        return [float(lr), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])]

    def init_state(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        state = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }
        if group["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def emit_update(self, emit: Emit, x: UpdateInputs, group: dict) -> tuple[relax.Expr, dict[str, relax.Expr]]:
        op, p = relax.op, x.param
        h = {k: _cast(v, p) for k, v in x.hyper.items()}
        one = _scalar(1.0, p)
        g = emit(op.negative(x.grad)) if group["maximize"] else x.grad
        step = emit(op.add(x.state["step"], relax.const(1.0, "float32")))
        decoupled = self.decoupled or group.get("decoupled_weight_decay", False)
        if group["weight_decay"] != 0:
            if decoupled:
                p = emit(op.multiply(p, op.subtract(one, op.multiply(h["lr"], h["weight_decay"]))))
            else:
                g = emit(op.add(g, op.multiply(h["weight_decay"], p)))
        beta1, beta2 = h["beta1"], h["beta2"]
        exp_avg = emit(op.add(op.multiply(beta1, x.state["exp_avg"]), op.multiply(op.subtract(one, beta1), g)))
        exp_avg_sq = emit(op.add(op.multiply(beta2, x.state["exp_avg_sq"]),
                                 op.multiply(op.subtract(one, beta2), op.multiply(g, g))))
        step_p = _cast(step, p)
        bias_correction1 = op.subtract(one, op.power(beta1, step_p))
        bias_correction2_sqrt = op.sqrt(op.subtract(one, op.power(beta2, step_p)))
        state = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        second = exp_avg_sq
        if group["amsgrad"]:
            second = emit(op.maximum(x.state["max_exp_avg_sq"], exp_avg_sq))
            state["max_exp_avg_sq"] = second
        denom = op.add(op.divide(op.sqrt(second), bias_correction2_sqrt), h["eps"])
        step_size = op.divide(h["lr"], bias_correction1)
        new_p = emit(op.subtract(p, op.multiply(step_size, op.divide(exp_avg, denom))))
        return new_p, state


class AdamW(Adam):
    """torch.optim.AdamW: Adam with weight decay applied to the parameter, not the gradient."""

    optimizer_class = torch.optim.AdamW
    decoupled = True


RULES: tuple[UpdateRule, ...] = (SGD(), Adam(), AdamW())


def rule_for(optimizer: torch.optim.Optimizer, where: str) -> UpdateRule:
    """The rule for `optimizer`'s exact class; a clear error listing the supported ones otherwise."""
    for rule in RULES:
        if type(optimizer) is rule.optimizer_class:
            return rule
    names = ", ".join(f"torch.optim.{r.optimizer_class.__name__}" for r in RULES)
    raise OptimizerError(f"{where}: {type(optimizer).__module__}.{type(optimizer).__name__} cannot be "
                         f"lowered into a graph; supported optimizers: {names}.")

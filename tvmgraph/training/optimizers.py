"""torch.optim optimizers, lowered: their update rules as backend-neutral formulas.

Sorted in order of increasing complexity: SGD, Adam, AdamW (Adam with decoupled decay).

An `UpdateRule` knows one optimizer class: which per-parameter state tensors it keeps (the same
keys torch keeps in `optimizer.state[p]`, so `optimizer.state_dict()` stays the source of truth),
which per-group hyperparameters travel as runtime inputs (so lr schedulers, and anything else
that edits `param_groups`, take effect without recompiling), which options change the program
(`flags`), and the update formula for one parameter.

A formula is written once against `UpdateOps` (update_ops.py) and evaluated by two backends:
Relax ops (one kernel per fused group after FuseOps) and TE (relay_passes/fuse_model_update.py:
one in-place kernel per param group). `ops.output(key, value)` marks a result; results are
produced in call order, and a later formula step reads an earlier result only through the
value `output` returned, which is what makes the in-place kernel correct.

Each update follows torch's single-tensor implementation (torch/optim/sgd.py, adam.py) step for
step; tests/numeric/test_training.py compares whole training runs against eager.
"""

from __future__ import annotations

import torch

from ..errors import OptimizerError
from .update_ops import UpdateOps, Value

PARAM = "param"  # the output key of the new parameter value


class UpdateRule:
    """How one torch optimizer class updates a parameter; subclasses fill in the details."""

    name: str
    optimizer_class: type[torch.optim.Optimizer]
    hyper_keys: tuple[str, ...] = ()
    # Implementation switches of torch that have no meaning inside a compiled graph.
    unsupported: tuple[str, ...] = ("fused", "capturable", "differentiable")

    def check_group(self, group: dict, where: str) -> None:
        for key in self.unsupported:
            if group.get(key):
                raise OptimizerError(f"{where}: {self.optimizer_class.__name__}({key}={group[key]!r}) "
                                     f"is not supported in graph mode; leave {key} at its default")

    def flags(self, group: dict) -> dict[str, bool]:
        """The options that change the program (a change compiles a new entry)."""
        raise NotImplementedError

    def structure(self, group: dict) -> tuple:
        return tuple(sorted(self.flags(group).items()))

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        """Keys of `optimizer.state[p]` this rule reads and writes, in a fixed order."""
        raise NotImplementedError

    def scalar_state(self, key: str) -> bool:
        """True for per-parameter scalar state (Adam's `step`), False for tensors shaped like p."""
        return False

    def hyper_values(self, group: dict, fresh: bool) -> list[float]:
        """Runtime inputs in `hyper_keys` order; `fresh` says the group's state was just created."""
        raise NotImplementedError

    def init_state(self, param: torch.Tensor, flags: dict[str, bool]) -> dict[str, torch.Tensor]:
        """State tensors as torch creates them lazily before the first step."""
        raise NotImplementedError

    def update(self, ops: UpdateOps, p: Value, g: Value, state: dict[str, Value],
               h: dict[str, Value], flags: dict[str, bool]) -> None:
        """Emit `ops.output(key, value)` for each new state value, then for PARAM."""
        raise NotImplementedError


def _lr(group: dict) -> float:
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


class SGD(UpdateRule):
    """torch.optim.SGD: momentum, dampening, nesterov, weight_decay, maximize."""

    name = "sgd"
    optimizer_class = torch.optim.SGD
    hyper_keys = ("lr", "momentum", "dampening", "weight_decay", "first")

    def flags(self, group: dict) -> dict[str, bool]:
        return {"nesterov": bool(group["nesterov"]), "maximize": bool(group["maximize"]),
                "momentum": group["momentum"] != 0, "weight_decay": group["weight_decay"] != 0,
                "dampening": group["dampening"] != 0}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("momentum_buffer",) if flags["momentum"] else ()

    def hyper_values(self, group: dict, fresh: bool) -> list[float]:
        return [_lr(group), float(group["momentum"]), float(group["dampening"]),
                float(group["weight_decay"]), 1.0 if fresh else 0.0]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool]) -> dict[str, torch.Tensor]:
        return {"momentum_buffer": torch.zeros_like(param)} if flags["momentum"] else {}

    def update(self, ops, p, g, state, h, flags) -> None:
        if flags["maximize"]:
            g = -g
        if flags["weight_decay"]:
            g = g + h["weight_decay"] * p
        if flags["momentum"]:
            # torch starts the buffer as a copy of the first gradient; a zero-initialised buffer
            # gives the same update when dampening is 0, otherwise the first step skips it.
            scale = ops.const(1.0) - h["dampening"]
            if flags["dampening"]:
                scale = ops.where_gt(h["first"], ops.const(0.5), ops.const(1.0), scale)
            buf = ops.output("momentum_buffer", h["momentum"] * state["momentum_buffer"] + scale * g)
            g = g + h["momentum"] * buf if flags["nesterov"] else buf
        ops.output(PARAM, p - h["lr"] * g)


class Adam(UpdateRule):
    """torch.optim.Adam: betas, eps, weight_decay (L2, added to the gradient), amsgrad, maximize."""

    name = "adam"
    optimizer_class = torch.optim.Adam
    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay")

    def flags(self, group: dict) -> dict[str, bool]:
        return {"amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"]),
                "weight_decay": group["weight_decay"] != 0,
                "decoupled": bool(group.get("decoupled_weight_decay", False))}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if flags["amsgrad"] else ())

    def scalar_state(self, key: str) -> bool:
        return key == "step"

    def hyper_values(self, group: dict, fresh: bool) -> list[float]:
        beta1, beta2 = group["betas"]
        return [_lr(group), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool]) -> dict[str, torch.Tensor]:
        state = {"step": torch.tensor(0.0, dtype=torch.float32, device=param.device),
                 "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        if flags["amsgrad"]:
            state["max_exp_avg_sq"] = torch.zeros_like(param)
        return state

    def update(self, ops, p, g, state, h, flags) -> None:
        one = ops.const(1.0)
        if flags["maximize"]:
            g = -g
        step = ops.output("step", state["step"] + one)
        if flags["weight_decay"]:
            if flags["decoupled"]:
                p = p * (one - h["lr"] * h["weight_decay"])
            else:
                g = g + h["weight_decay"] * p
        beta1, beta2 = h["beta1"], h["beta2"]
        exp_avg = ops.output("exp_avg", beta1 * state["exp_avg"] + (one - beta1) * g)
        second = ops.output("exp_avg_sq", beta2 * state["exp_avg_sq"] + (one - beta2) * (g * g))
        if flags["amsgrad"]:
            second = ops.output("max_exp_avg_sq", ops.maximum(state["max_exp_avg_sq"], second))
        bias_correction1 = one - ops.pow(beta1, step)
        bias_correction2_sqrt = ops.sqrt(one - ops.pow(beta2, step))
        denom = ops.sqrt(second) / bias_correction2_sqrt + h["eps"]
        ops.output(PARAM, p - (h["lr"] / bias_correction1) * (exp_avg / denom))


class AdamW(Adam):
    """torch.optim.AdamW: Adam with weight decay applied to the parameter, not the gradient
    (torch marks its param groups `decoupled_weight_decay=True`)."""

    name = "adamw"
    optimizer_class = torch.optim.AdamW


RULES: dict[str, UpdateRule] = {rule.name: rule for rule in (SGD(), Adam(), AdamW())}


def rule_for(optimizer: torch.optim.Optimizer, where: str) -> UpdateRule:
    """The rule for `optimizer`'s exact class; a clear error listing the supported ones otherwise."""
    for rule in RULES.values():
        if type(optimizer) is rule.optimizer_class:
            return rule
    names = ", ".join(f"torch.optim.{r.optimizer_class.__name__}" for r in RULES.values())
    raise OptimizerError(f"{where}: {type(optimizer).__module__}.{type(optimizer).__name__} cannot be "
                         f"lowered into a graph; supported optimizers: {names}.")

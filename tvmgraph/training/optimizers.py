"""torch.optim optimizers, lowered: their update rules as backend-neutral formulas.

SGD, Adam and AdamW first, then the others in the order of torch's docs: RMSprop, Adagrad,
Adamax, NAdam, RAdam, Adadelta, Rprop, ASGD, Adafactor.

An `UpdateRule` knows one optimizer class: which per-parameter state tensors it keeps (the same
keys torch keeps in `optimizer.state[p]`, so `optimizer.state_dict()` stays the source of truth),
which per-group hyperparameters travel as runtime inputs (so lr schedulers, and anything else
that edits `param_groups`, take effect without recompiling), which options change the program
(`flags`), and the update formula for one parameter. Options a rule does not implement raise
an OptimizerError (`check_group`), never a silently different update.

A formula is written once against `UpdateOps` (update_ops.py) and evaluated by two backends:
Relax ops (one kernel per fused group after FuseOps) and TE (relay_passes/fuse_model_update.py:
one in-place kernel per param group). `ops.output(key, value)` marks a result; results are
stored in call order. A formula reads the old value of a state (or of the parameter) only until
it outputs it; a later step reads the new value through the value `output` returned. That is
what makes the in-place kernel correct (its TE backend checks it); a rule that cannot keep to
it, as when two results each need the other's old value, says `in_place() -> False`.

Each update follows torch's single-tensor implementation (torch/optim/*.py, `_single_tensor_*`)
step for step; tests/numeric/test_training.py and test_optimizers.py compare training runs,
parameters and state, against eager.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import OptimizerError
from .update_ops import UpdateOps, Value

PARAM = "param"  # the output key of the new parameter value


class UpdateRule:
    """How one torch optimizer class updates a parameter; subclasses fill in the details."""

    name: str
    optimizer_class: type[torch.optim.Optimizer]
    hyper_keys: tuple[str, ...] = ()
    # Values given per parameter, after the group's `hyper_keys` in the same vector (SGD's
    # `first`: this parameter's momentum buffer was just created). One parameter of a group can
    # take its first step later than the others (unfrozen by `requires_grad_(True)`).
    param_hyper_keys: tuple[str, ...] = ()
    # `fused`, `foreach` and `capturable` choose torch's kernels, with the same arithmetic: the
    # compiled update replaces them all. `differentiable` asks for a gradient through the step.
    unsupported: tuple[str, ...] = ("differentiable",)

    def check_group(self, group: dict, where: str) -> None:
        for key in self.unsupported:
            if group.get(key):
                raise OptimizerError(f"{where}: {self.optimizer_class.__name__}({key}={group[key]!r}) "
                                     f"is not supported in graph mode; leave {key} at its default")
        if any(p.is_complex() for p in group["params"]):
            raise OptimizerError(f"{where}: complex parameters are not supported by graph-mode optimizers")

    def flags(self, group: dict) -> dict[str, bool]:
        """The options that change the program (a change compiles a new entry)."""
        raise NotImplementedError

    def structure(self, group: dict) -> tuple:
        return tuple(sorted(self.flags(group).items()))

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        """Keys of `optimizer.state[p]` this rule reads and writes, in a fixed order."""
        raise NotImplementedError

    # Per-parameter scalar state (Adam's `step`); every other state key is a tensor shaped like p.
    scalar_keys: tuple[str, ...] = ()

    def scalar_state(self, key: str) -> bool:
        """True for per-parameter scalar state, False for tensors shaped like p."""
        return key in self.scalar_keys

    def state_shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of state `key` for a parameter of `shape`: () for scalar state, the
        parameter's shape for the rest; None where torch keeps no such state for this parameter
        (Adafactor's factored `row_var` of a vector), which the program then reads as a scalar
        placeholder and passes through unchanged."""
        return () if self.scalar_state(key) else shape

    def hyper_values(self, group: dict) -> list[float]:
        """The group's runtime inputs, in `hyper_keys` order."""
        raise NotImplementedError

    def param_hyper_values(self, fresh: bool) -> list[float]:
        """One parameter's runtime inputs, in `param_hyper_keys` order; `fresh` says its state
        was just created."""
        return []

    def hyper_vector(self, group: dict, fresh: Sequence[bool]) -> list[float]:
        """The group's hyperparameter vector: `hyper_values`, then each parameter's
        `param_hyper_values` (`fresh` has one entry per parameter, in group order)."""
        return [*self.hyper_values(group), *(v for f in fresh for v in self.param_hyper_values(f))]

    def hyper_length(self, params: int) -> int:
        """The length of the hyperparameter vector of a group of `params` parameters."""
        return len(self.hyper_keys) + params * len(self.param_hyper_keys)

    def hyper_slots(self, param: int) -> dict[str, int]:
        """Where each hyperparameter parameter number `param` of its group reads sits in the vector."""
        slots = {k: i for i, k in enumerate(self.hyper_keys)}
        base = len(self.hyper_keys) + param * len(self.param_hyper_keys)
        return {**slots, **{k: base + n for n, k in enumerate(self.param_hyper_keys)}}

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        """State tensors as torch creates them lazily before the first step."""
        raise NotImplementedError

    def in_place(self, flags: dict[str, bool]) -> bool:
        """Whether FuseModelUpdate may update in place: False when two results each read the
        other's old value (the kernel stores one before the other), leaving Relax ops."""
        return True

    def update(self, ops: UpdateOps, p: Value, g: Value, state: dict[str, Value],
               h: dict[str, Value], flags: dict[str, bool]) -> None:
        """Emit `ops.output(key, value)` for each new state value and for PARAM (see the
        module docstring for the order)."""
        raise NotImplementedError


def _adam_hypers(group: dict) -> list[float]:
    """lr, beta1, beta2, eps, weight_decay: the runtime inputs the Adam family shares."""
    beta1, beta2 = group["betas"]
    return [_lr(group), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"])]


def _lr(group: dict) -> float:
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


class SGD(UpdateRule):
    """torch.optim.SGD: momentum, dampening, nesterov, weight_decay, maximize."""

    name = "sgd"
    optimizer_class = torch.optim.SGD
    hyper_keys = ("lr", "momentum", "dampening", "weight_decay")
    param_hyper_keys = ("first",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"nesterov": bool(group["nesterov"]), "maximize": bool(group["maximize"]),
                "momentum": group["momentum"] != 0, "weight_decay": group["weight_decay"] != 0,
                "dampening": group["dampening"] != 0}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("momentum_buffer",) if flags["momentum"] else ()

    def hyper_values(self, group: dict) -> list[float]:
        return [_lr(group), float(group["momentum"]), float(group["dampening"]), float(group["weight_decay"])]

    def param_hyper_values(self, fresh: bool) -> list[float]:
        return [1.0 if fresh else 0.0]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
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
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"amsgrad": bool(group["amsgrad"]), "maximize": bool(group["maximize"]),
                "weight_decay": group["weight_decay"] != 0,
                "decoupled": bool(group.get("decoupled_weight_decay", False))}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if flags["amsgrad"] else ())

    def hyper_values(self, group: dict) -> list[float]:
        return _adam_hypers(group)

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
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
        p, g = _adam_decay(ops, flags, p, g, h)
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


def _scalar(value: float) -> torch.Tensor:
    """Per-parameter scalar state as torch keeps it: a float32 0-d tensor, on the CPU."""
    return torch.tensor(value, dtype=torch.float32)


def _lerp(ops: UpdateOps, start: Value, end: Value, weight: Value) -> Value:
    """torch.lerp as its CPU kernel computes it (exact at both ends)."""
    return ops.where_gt(ops.const(0.5), ops.abs(weight), start + weight * (end - start),
                        end - (end - start) * (ops.const(1.0) - weight))


def _decay(flags: dict[str, bool], g: Value, p: Value, h: dict[str, Value]) -> Value:
    """torch's `grad = grad.add(param, alpha=weight_decay)` (L2 penalty in the gradient)."""
    return g + h["weight_decay"] * p if flags["weight_decay"] else g


def _adam_decay(ops: UpdateOps, flags: dict[str, bool], p: Value, g: Value,
                h: dict[str, Value]) -> tuple[Value, Value]:
    """(p, g) after the Adam family's weight decay: decoupled (AdamW's `param.mul_(1 - lr * wd)`)
    or the L2 penalty in the gradient."""
    if flags["weight_decay"] and flags["decoupled"]:
        return p * (ops.const(1.0) - h["lr"] * h["weight_decay"]), g
    return p, _decay(flags, g, p, h)


class RMSprop(UpdateRule):
    """torch.optim.RMSprop: alpha, eps, weight_decay, momentum, centered, maximize."""

    name = "rmsprop"
    optimizer_class = torch.optim.RMSprop
    hyper_keys = ("lr", "alpha", "eps", "weight_decay", "momentum")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        # momentum > 0 and centered decide which state torch creates.
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0,
                "momentum": group["momentum"] > 0, "centered": bool(group["centered"])}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return (("step", "square_avg") + (("grad_avg",) if flags["centered"] else ())
                + (("momentum_buffer",) if flags["momentum"] else ()))

    def hyper_values(self, group: dict) -> list[float]:
        return [_lr(group), float(group["alpha"]), float(group["eps"]), float(group["weight_decay"]),
                float(group["momentum"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), **{k: torch.zeros_like(param) for k in self.state_keys(flags)[1:]}}

    def update(self, ops, p, g, state, h, flags) -> None:
        one = ops.const(1.0)
        if flags["maximize"]:
            g = -g
        ops.output("step", state["step"] + one)
        g = _decay(flags, g, p, h)
        alpha = h["alpha"]
        square_avg = ops.output("square_avg", state["square_avg"] * alpha + (one - alpha) * (g * g))
        if flags["centered"]:
            grad_avg = ops.output("grad_avg", _lerp(ops, state["grad_avg"], g, one - alpha))
            avg = ops.sqrt(square_avg - grad_avg * grad_avg)
        else:
            avg = ops.sqrt(square_avg)
        avg = avg + h["eps"]
        if flags["momentum"]:
            buf = ops.output("momentum_buffer", state["momentum_buffer"] * h["momentum"] + g / avg)
            ops.output(PARAM, p - h["lr"] * buf)
        else:
            ops.output(PARAM, p - h["lr"] * (g / avg))


class Adagrad(UpdateRule):
    """torch.optim.Adagrad: lr_decay, weight_decay, initial_accumulator_value, eps, maximize."""

    name = "adagrad"
    optimizer_class = torch.optim.Adagrad
    hyper_keys = ("lr", "lr_decay", "weight_decay", "eps")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "sum")

    def hyper_values(self, group: dict) -> list[float]:
        return [_lr(group), float(group["lr_decay"]), float(group["weight_decay"]), float(group["eps"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        # torch creates this state in Adagrad.__init__; here only for state that was cleared.
        return {"step": _scalar(0.0),
                "sum": torch.full_like(param, float(group["initial_accumulator_value"]))}

    def update(self, ops, p, g, state, h, flags) -> None:
        one = ops.const(1.0)
        step = ops.output("step", state["step"] + one)
        if flags["maximize"]:
            g = -g
        g = _decay(flags, g, p, h)
        clr = h["lr"] / (one + (step - one) * h["lr_decay"])
        state_sum = ops.output("sum", state["sum"] + g * g)
        std = ops.sqrt(state_sum) + h["eps"]
        ops.output(PARAM, p - clr * (g / std))


class Adamax(UpdateRule):
    """torch.optim.Adamax: betas, eps, weight_decay, maximize."""

    name = "adamax"
    optimizer_class = torch.optim.Adamax
    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_inf")

    def hyper_values(self, group: dict) -> list[float]:
        return _adam_hypers(group)

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), "exp_avg": torch.zeros_like(param), "exp_inf": torch.zeros_like(param)}

    def update(self, ops, p, g, state, h, flags) -> None:
        one = ops.const(1.0)
        if flags["maximize"]:
            g = -g
        step = ops.output("step", state["step"] + one)
        g = _decay(flags, g, p, h)
        exp_avg = ops.output("exp_avg", _lerp(ops, state["exp_avg"], g, one - h["beta1"]))
        exp_inf = ops.output("exp_inf", ops.maximum(state["exp_inf"] * h["beta2"], ops.abs(g) + h["eps"]))
        clr = h["lr"] / (one - ops.pow(h["beta1"], step))
        ops.output(PARAM, p - clr * (exp_avg / exp_inf))


class NAdam(UpdateRule):
    """torch.optim.NAdam: betas, eps, weight_decay, momentum_decay, decoupled_weight_decay,
    maximize. `mu_product` is per-parameter scalar state, like `step`."""

    name = "nadam"
    optimizer_class = torch.optim.NAdam
    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay", "momentum_decay")
    scalar_keys = ("step", "mu_product")

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0,
                "decoupled": bool(group["decoupled_weight_decay"])}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "mu_product", "exp_avg", "exp_avg_sq")

    def hyper_values(self, group: dict) -> list[float]:
        return [*_adam_hypers(group), float(group["momentum_decay"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), "mu_product": _scalar(1.0),
                "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def update(self, ops, p, g, state, h, flags) -> None:
        one, half = ops.const(1.0), ops.const(0.5)
        if flags["maximize"]:
            g = -g
        step = ops.output("step", state["step"] + one)
        beta1, beta2, lr = h["beta1"], h["beta2"], h["lr"]
        bias_correction2 = one - ops.pow(beta2, step)
        p, g = _adam_decay(ops, flags, p, g, h)
        # The momentum cache mu_t and mu_{t+1}.
        mu = beta1 * (one - half * ops.pow(ops.const(0.96), step * h["momentum_decay"]))
        mu_next = beta1 * (one - half * ops.pow(ops.const(0.96), (step + one) * h["momentum_decay"]))
        mu_product = ops.output("mu_product", state["mu_product"] * mu)
        exp_avg = ops.output("exp_avg", _lerp(ops, state["exp_avg"], g, one - beta1))
        exp_avg_sq = ops.output("exp_avg_sq", state["exp_avg_sq"] * beta2 + (one - beta2) * (g * g))
        denom = ops.sqrt(exp_avg_sq / bias_correction2) + h["eps"]
        p = p + (-lr * (one - mu) / (one - mu_product)) * (g / denom)
        ops.output(PARAM, p + (-lr * mu_next / (one - mu_product * mu_next)) * (exp_avg / denom))


class RAdam(UpdateRule):
    """torch.optim.RAdam: betas, eps, weight_decay, decoupled_weight_decay, maximize.

    The variance rectification applies from the step where the SMA length exceeds 5; the step
    is runtime state, so both updates are computed and a select on that scalar picks one."""

    name = "radam"
    optimizer_class = torch.optim.RAdam
    hyper_keys = ("lr", "beta1", "beta2", "eps", "weight_decay")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0,
                "decoupled": bool(group["decoupled_weight_decay"])}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "exp_avg", "exp_avg_sq")

    def hyper_values(self, group: dict) -> list[float]:
        return _adam_hypers(group)

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}

    def update(self, ops, p, g, state, h, flags) -> None:
        one, two, four = ops.const(1.0), ops.const(2.0), ops.const(4.0)
        if flags["maximize"]:
            g = -g
        step = ops.output("step", state["step"] + one)
        beta1, beta2, lr = h["beta1"], h["beta2"], h["lr"]
        p, g = _adam_decay(ops, flags, p, g, h)
        exp_avg = ops.output("exp_avg", _lerp(ops, state["exp_avg"], g, one - beta1))
        exp_avg_sq = ops.output("exp_avg_sq", state["exp_avg_sq"] * beta2 + (one - beta2) * (g * g))
        bias_correction1 = one - ops.pow(beta1, step)
        bias_correction2 = one - ops.pow(beta2, step)
        corrected = exp_avg / bias_correction1
        rho_inf = two / (one - beta2) - one  # the maximum length of the approximated SMA
        rho_t = rho_inf - two * step * ops.pow(beta2, step) / bias_correction2
        rect = ops.sqrt((rho_t - four) * (rho_t - two) * rho_inf / ((rho_inf - four) * (rho_inf - two) * rho_t))
        adaptive_lr = ops.sqrt(bias_correction2) / (ops.sqrt(exp_avg_sq) + h["eps"])
        update = ops.where_gt(rho_t, ops.const(5.0), corrected * lr * adaptive_lr * rect, corrected * lr)
        ops.output(PARAM, p - update)


class Adadelta(UpdateRule):
    """torch.optim.Adadelta: lr, rho, eps, weight_decay, maximize.

    The parameter's step reads the old `acc_delta`, so the parameter is stored first; with
    weight decay the new `acc_delta` reads the old parameter too, and the update cannot be
    done in place."""

    name = "adadelta"
    optimizer_class = torch.optim.Adadelta
    hyper_keys = ("lr", "rho", "eps", "weight_decay")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "square_avg", "acc_delta")

    def hyper_values(self, group: dict) -> list[float]:
        return [_lr(group), float(group["rho"]), float(group["eps"]), float(group["weight_decay"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), "square_avg": torch.zeros_like(param),
                "acc_delta": torch.zeros_like(param)}

    def in_place(self, flags: dict[str, bool]) -> bool:
        return not flags["weight_decay"]

    def update(self, ops, p, g, state, h, flags) -> None:
        one, rho, eps = ops.const(1.0), h["rho"], h["eps"]
        ops.output("step", state["step"] + one)
        if flags["maximize"]:
            g = -g
        g = _decay(flags, g, p, h)
        square_avg = ops.output("square_avg", state["square_avg"] * rho + (one - rho) * (g * g))
        std = ops.sqrt(square_avg + eps)
        delta = ops.sqrt(state["acc_delta"] + eps) / std * g
        ops.output(PARAM, p - h["lr"] * delta)
        ops.output("acc_delta", state["acc_delta"] * rho + (one - rho) * (delta * delta))


class Rprop(UpdateRule):
    """torch.optim.Rprop: etas, step_sizes, maximize (lr is only the initial step size)."""

    name = "rprop"
    optimizer_class = torch.optim.Rprop
    hyper_keys = ("etaminus", "etaplus", "step_size_min", "step_size_max")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"])}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "step_size", "prev")  # the order the formula stores them in

    def hyper_values(self, group: dict) -> list[float]:
        (etaminus, etaplus), (low, high) = group["etas"], group["step_sizes"]
        return [float(etaminus), float(etaplus), float(low), float(high)]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), "prev": torch.zeros_like(param),
                "step_size": torch.full_like(param, _lr(group))}

    def update(self, ops, p, g, state, h, flags) -> None:
        zero, one = ops.const(0.0), ops.const(1.0)
        etaminus = h["etaminus"]
        if flags["maximize"]:
            g = -g
        ops.output("step", state["step"] + one)
        product = g * state["prev"]
        factor = ops.where_gt(product, zero, h["etaplus"], ops.where_gt(zero, product, etaminus, one))
        step_size = ops.output("step_size", ops.minimum(ops.maximum(state["step_size"] * factor, h["step_size_min"]),
                                                        h["step_size_max"]))
        # torch zeroes the gradient where the factor equals etaminus (where the sign flipped).
        g = ops.where_gt(factor, etaminus, g, ops.where_gt(etaminus, factor, g, zero))
        prev = ops.output("prev", g)
        ops.output(PARAM, p - ops.sign(prev) * step_size)


class ASGD(UpdateRule):
    """torch.optim.ASGD: lambd, alpha, t0, weight_decay, maximize. `eta` and `mu` are
    per-parameter scalar state, like `step`; `ax` is the running average of the parameter."""

    name = "asgd"
    optimizer_class = torch.optim.ASGD
    hyper_keys = ("lr", "lambd", "alpha", "t0", "weight_decay")
    scalar_keys = ("step", "eta", "mu")

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "ax", "eta", "mu")

    def hyper_values(self, group: dict) -> list[float]:
        return [_lr(group), float(group["lambd"]), float(group["alpha"]), float(group["t0"]),
                float(group["weight_decay"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        return {"step": _scalar(0.0), "eta": _scalar(_lr(group)),
                "mu": _scalar(1.0), "ax": torch.zeros_like(param)}

    def update(self, ops, p, g, state, h, flags) -> None:
        one = ops.const(1.0)
        if flags["maximize"]:
            g = -g
        step = ops.output("step", state["step"] + one)
        g = _decay(flags, g, p, h)
        eta, mu, lr = state["eta"], state["mu"], h["lr"]
        p = p * (one - h["lambd"] * eta) - eta * g
        # Averaging starts once mu < 1 (after t0 steps); until then ax is a copy of p.
        ops.output("ax", ops.where_gt(one, mu, state["ax"] + (p - state["ax"]) * mu, p))
        ops.output("eta", lr / ops.pow(one + h["lambd"] * lr * step, h["alpha"]))
        ops.output("mu", one / ops.maximum(one, step - h["t0"]))
        ops.output(PARAM, p)


class Adafactor(UpdateRule):
    """torch.optim.Adafactor: beta2_decay, eps (eps1 None: the dtype's machine epsilon), d,
    weight_decay, maximize.

    A parameter of two or more dims keeps its second moment factored, a row mean (`row_var`, its
    last dim reduced) and a column mean (`col_var`, its second to last), and a vector the whole
    `variance`; torch keeps only the state a parameter uses, and so does the graph (`state_shape`
    None for the other keys). The step size reads the norms of the parameter and of the update,
    so the formula has whole-tensor reductions: not an in-place kernel (FuseModelUpdate), Relax ops."""

    name = "adafactor"
    optimizer_class = torch.optim.Adafactor
    hyper_keys = ("lr", "beta2_decay", "eps1", "eps2", "d", "weight_decay")
    scalar_keys = ("step",)

    def flags(self, group: dict) -> dict[str, bool]:
        return {"maximize": bool(group["maximize"]), "weight_decay": group["weight_decay"] != 0,
                "machine_eps1": group["eps"][0] is None}

    def state_keys(self, flags: dict[str, bool]) -> tuple[str, ...]:
        return ("step", "row_var", "col_var", "variance")

    def state_shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        factored = len(shape) > 1
        if key == "row_var":
            return (*shape[:-1], 1) if factored else None
        if key == "col_var":
            return (*shape[:-2], 1, shape[-1]) if factored else None
        if key == "variance":
            return None if factored else shape
        return super().state_shape(key, shape)

    def hyper_values(self, group: dict) -> list[float]:
        eps1, eps2 = group["eps"]
        return [_lr(group), float(group["beta2_decay"]), 0.0 if eps1 is None else float(eps1), float(eps2),
                float(group["d"]), float(group["weight_decay"])]

    def init_state(self, param: torch.Tensor, flags: dict[str, bool], group: dict) -> dict[str, torch.Tensor]:
        state = {"step": _scalar(0.0)}
        for key in ("row_var", "col_var", "variance"):
            shape = self.state_shape(key, tuple(param.shape))
            if shape is not None:
                state[key] = param.new_zeros(shape)
        return state

    def in_place(self, flags: dict[str, bool]) -> bool:
        return False  # the norms of p and of the update reduce whole tensors

    def update(self, ops, p, g, state, h, flags) -> None:
        one = ops.const(1.0)
        if flags["maximize"]:
            g = -g
        shape = ops.shape(p)
        numel = math.prod(shape)
        step = ops.output("step", state["step"] + one)
        beta2_t = ops.pow(step, h["beta2_decay"])
        rho = ops.minimum(h["lr"], one / ops.sqrt(step))
        alpha = ops.maximum(h["eps2"], ops.norm(p) / ops.const(math.sqrt(numel))) * rho
        eps1 = ops.const(torch.finfo(getattr(torch, p.dtype)).eps) if flags["machine_eps1"] else h["eps1"]
        if flags["weight_decay"]:
            p = p * (one - h["lr"] * h["weight_decay"])
        squared = g * g
        if len(shape) > 1:
            row = ops.output("row_var", _lerp(ops, state["row_var"], ops.mean(squared, -1), beta2_t))
            col = ops.output("col_var", _lerp(ops, state["col_var"], ops.mean(squared, -2), beta2_t))
            ops.output("variance", state["variance"])  # a placeholder: torch keeps none
            estimate = row * col / ops.maximum(ops.mean(row, -2), eps1)
        else:
            ops.output("row_var", state["row_var"])
            ops.output("col_var", state["col_var"])
            estimate = ops.output("variance", _lerp(ops, state["variance"], squared, beta2_t))
        update = ops.rsqrt(ops.maximum(estimate, eps1 * eps1)) * g
        denom = ops.maximum(one, ops.norm(update) / (ops.const(math.sqrt(numel)) * h["d"]))
        ops.output(PARAM, p - (alpha / denom) * update)


RULES: dict[str, UpdateRule] = {rule.name: rule for rule in (
    SGD(), Adam(), AdamW(), RMSprop(), Adagrad(), Adamax(), NAdam(), RAdam(), Adadelta(), Rprop(), ASGD(),
    Adafactor())}


def rule_for(optimizer: torch.optim.Optimizer, where: str) -> UpdateRule:
    """The rule for `optimizer`'s exact class; a clear error listing the supported ones otherwise."""
    for rule in RULES.values():
        if type(optimizer) is rule.optimizer_class:
            return rule
    names = ", ".join(f"torch.optim.{r.optimizer_class.__name__}" for r in RULES.values())
    cls = type(optimizer)
    # A subclass may override step(): running its base class's update would be silently wrong.
    base = next((r.optimizer_class for r in RULES.values() if isinstance(optimizer, r.optimizer_class)), None)
    why = (f" (it subclasses torch.optim.{base.__name__}, but graph mode runs only torch's own update rules, "
           f"not an overridden step(); train it eagerly, or use torch.optim.{base.__name__} itself)"
           if base is not None else "")
    raise OptimizerError(f"{where}: {cls.__module__}.{cls.__qualname__} cannot be lowered into a graph{why}; "
                         f"supported optimizers: {names}.")

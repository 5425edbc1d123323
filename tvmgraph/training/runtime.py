"""Running a training step: optimizer state in, trained values out.

Optimizer state lives where torch keeps it, in `optimizer.state[p]` (the same keys and tensor
shapes as eager torch), so `optimizer.state_dict()` and `torch.save` work as usual and eager and
graph training can take turns. Before each step `TrainingBinding.inputs` creates missing state
the way torch does lazily and packs each group's hyperparameters (read from `param_groups` at
every call, so lr schedulers need no recompile); after it, `write_back` stores the new parameter
values and state. Parameters keep their identity and their storage: the program updates them
in place (or its new values are copied into them), as eager's in-place step does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ..amp import scaler_hypers, scaler_tensors
from ..errors import OptimizerError, UnsupportedOptionError
from .plan import GroupPlan, TrainingPlan
from .train_step import TrainStepLayout


def kept(group: GroupPlan, param: torch.nn.Parameter, key: str) -> bool:
    """Whether torch keeps state `key` for `param` (Adafactor keeps a matrix's factored moments
    and a vector's whole one; the program passes a placeholder for the other)."""
    return group.rule.state_shape(key, tuple(param.shape)) is not None


def placeholder(device: torch.device) -> torch.Tensor:
    """What the program reads for state torch does not keep (a float32 0-d zero)."""
    return torch.zeros((), dtype=torch.float32, device=device)


def lazy_state(group: GroupPlan, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The state entries torch creates before `param`'s first step that `group`'s optimizer does
    not hold yet (none after the first step); the optimizer itself is left as it is."""
    state = group.optimizer.state.get(param, {})
    if all(k in state for k in group.state_keys if kept(group, param, k)):
        return {}
    created = group.rule.init_state(param, group.flags, group.group)
    return {k: v for k, v in created.items() if k not in state}


def _refuse_step_hooks(plan: TrainingPlan) -> None:
    """An optimizer step hook (`register_step_pre_hook` / `register_step_post_hook`, or torch's
    global ones) runs around eager's `opt.step()`; the step inside the program runs none, and a
    post-hook clamping weights (WGAN) trained silently without it. Checked at every call: a hook
    may be added after the first."""
    from torch.optim import optimizer as optimizer_module

    global_hooks = optimizer_module._global_optimizer_pre_hooks or optimizer_module._global_optimizer_post_hooks
    for group in plan.groups:
        opt = group.optimizer
        if global_hooks or opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
            raise UnsupportedOptionError(
                f"{plan.graph_name}: {type(opt).__name__} has an optimizer step hook (register_step_pre_hook / "
                f"register_step_post_hook{', or a global one' if global_hooks else ''}); the step inside a "
                f"training graph runs no hook. Remove it (handle.remove()) and do what it does after each graph "
                f"call (e.g. clamp the weights under torch.no_grad()), or train eagerly")


class TrainingBinding:
    """Extra inputs and outputs of `train_step` for one compiled entry."""

    __slots__ = ("plan", "layout", "device", "created", "scale_before")

    def __init__(self, plan: TrainingPlan, layout: TrainStepLayout, device: torch.device):
        self.plan = plan
        self.layout = layout
        self.device = device
        # The state entries `inputs` created for this call, and the loss scale it started from
        # (see `_forget_state_of_a_skipped_step`).
        self.created: list[tuple[torch.optim.Optimizer, torch.nn.Parameter, list[str]]] = []
        self.scale_before: float | None = None

    def inputs(self) -> list[torch.Tensor]:
        """State tensors in layout order, one hyperparameter vector per group, then with loss
        scaling the GradScaler's scale, growth tracker and factors (training/loss_scale.py)."""
        _refuse_step_hooks(self.plan)
        states, hypers = [], []
        self.created = []
        for group in self.plan.groups:
            fresh = []
            keys = group.state_keys
            for param in group.params:
                missing = lazy_state(group, param)
                state = group.optimizer.state[param]
                state.update(missing)
                fresh.append(bool(missing))
                if missing:
                    self.created.append((group.optimizer, param, list(missing)))
                for key in keys:
                    if not kept(group, param, key):
                        states.append(placeholder(self.device))
                        continue
                    value = state[key]
                    if value.device != self.device:  # e.g. torch keeps Adam's step on the CPU
                        value = state[key] = value.to(self.device)
                    if value.dtype != param.dtype and not group.rule.scalar_state(key) and value.is_floating_point():
                        # The program keeps state in its parameter's dtype (train_step.state_type);
                        # after `model.double()` mid-run the state is cast as torch's
                        # Optimizer.load_state_dict casts it.
                        value = state[key] = value.to(param.dtype)
                    states.append(value)
            try:
                values = group.rule.hyper_vector(group.group, fresh)
            except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as e:
                # e.g. betas=(0.9,), a deleted 'eps', lr=None set between calls
                raise OptimizerError(
                    f"{self.plan.graph_name}: {type(group.optimizer).__name__} param group {group.group_index}: "
                    f"its hyperparameters could not be read before the step ({type(e).__name__}: {e}); give the "
                    f"group the values its optimizer takes (as torch.optim's constructor does)") from e
            hypers.append(torch.tensor(values, dtype=torch.float64, device=self.device))
        if self.layout.loss_scaling:
            scaler = self.plan.grad_scaler
            hypers += [*scaler_tensors(scaler, self.device), scaler_hypers(scaler, self.device)]
            self.scale_before = float(scaler._scale) if self.created else None
        return states + hypers

    def scale_input(self) -> list[torch.Tensor]:
        """With loss scaling, the GradScaler's current scale (what `accumulate_grads` multiplies
        the loss by); else nothing."""
        return [scaler_tensors(self.plan.grad_scaler, self.device)[0]] if self.layout.loss_scaling else []

    def write_back(self, results: Sequence[torch.Tensor], copied: Collection[int] = ()) -> None:
        """Store `new_params..., new_states...[, scale, growth_tracker]` (the tail of
        train_step's results); the scale and tracker go back into the GradScaler.

        `copied` holds the `id`s of parameters the program was given a copy of (a misaligned
        view, channels_last: see inputs.py); their new values are copied into them, keeping
        their storage and layout, as torch's in-place optimizer step does.
        """
        params = [p for g in self.plan.groups for p in g.params]
        new_params, new_states = results[:len(params)], results[len(params):]
        if self.layout.loss_scaling:
            scaler = self.plan.grad_scaler
            scaler._scale, scaler._growth_tracker = new_states[-2:]
            new_states = new_states[:-2]
        for param, value in zip(params, new_params):
            if id(param) in copied:
                with torch.no_grad():
                    param.copy_(value)
            elif value.data_ptr() != param.data_ptr():  # a rule that returns a new tensor (Adafactor)
                with torch.no_grad():  # into the parameter's storage: views of it stay live, as in eager
                    param.copy_(value)
        # The kernels wrote the parameters in place, out of torch's sight: count it, as eager's
        # in-place step does, so that what reads the version (frozen weights packed by an
        # inference graph of the same model, autograd's saved tensors) sees the change.
        torch.autograd.graph.increment_version(params)
        cursor = 0
        for group in self.plan.groups:
            keys = group.state_keys
            for param in group.params:
                state = group.optimizer.state[param]
                for key in keys:
                    if kept(group, param, key):
                        state[key] = new_states[cursor]
                    cursor += 1
        if self.layout.loss_scaling:
            self._forget_state_of_a_skipped_step()
        for group in self.plan.groups:
            # Tell torch's lr schedulers that the optimizer did step (else they warn).
            group.optimizer._opt_called = True

    def _forget_state_of_a_skipped_step(self) -> None:
        """After a step the GradScaler skipped (non-finite gradients: the scale backed off, and
        GradScaler's backoff factor is below 1), drop the state this call created: eager's
        optimizer never stepped, so it has none, and its next step starts it (SGD's momentum
        buffer as a copy of the gradient, undamped; Rprop's step sizes and ASGD's eta from the
        lr of then). Exact with one optimizer; with several the program does not say which
        overflowed, and their state is kept (docs/training.md)."""
        if not self.created or self.scale_before is None:
            return
        if float(self.plan.grad_scaler._scale) >= self.scale_before:
            return
        if len({id(group.optimizer) for group in self.plan.groups}) != 1:
            return
        for optimizer, param, keys in self.created:
            state = optimizer.state[param]
            for key in keys:
                state.pop(key, None)
            if not state:
                del optimizer.state[param]

"""`tvmgraph.save(graph, path, program="train_step")`: the training step itself, saved.

The saved directory holds the compiled `train_step` function (forward, autodiff, optimizer
update) with everything it reads besides the batch: parameters and buffers as for an inference
save, plus the optimizer state in the program's order (`optimizer/<param path>/<key>` in
params.safetensors) and each param group's hyperparameters (`training.groups` in the
manifest). `tvmgraph.load` then returns a runner that trains on each call and keeps its own
state (tvmgraph/deploy_runtime.py), with no torch, no optimizer object and no model code:
fine-tuning on the deployment machine.

What a saved step does not carry: lr schedulers (set the lr on the runner instead), a grad
scaler, gradient accumulation and data parallelism, each refused with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from . import entry
from .errors import SaveError, UnsupportedOptionError
from .graph import Graph, _enabled
from .stages import LoweredGraph, TracedGraph
from .training.runtime import kept, lazy_state, placeholder


def train_step_program(graph: Graph, example_args: tuple | None
                       ) -> tuple[TracedGraph, LoweredGraph, dict[str, torch.Tensor], dict[str, Any]]:
    """The lowered training step of `graph` (its last call's, or traced for `example_args`),
    the optimizer state tensors to save by name, and the manifest's `training` section."""
    if not graph.training:
        raise SaveError(f"{graph.name}: program='train_step' saves a training step, but the graph has no "
                        f"optimizer; save its inference program (the default, program='inference')")
    st = graph._state("saving the graph")
    if _enabled(st.grad_scaler) is not None:
        raise UnsupportedOptionError(f"{graph.name}: a saved train step cannot carry a grad scaler yet; save it "
                                     f"without one (graph.set_grad_scaler(None); bfloat16 AMP needs none)")
    if st.config.pipeline_stages:
        raise UnsupportedOptionError(f"{graph.name}: a saved train step runs in one process; it cannot carry "
                                     f"pipeline stages (set_stage). Save the model's weights "
                                     f"(tvmgraph.save(graph.state_dict(), path)) or a graph built without stages")
    if example_args is None:
        compiled = graph.compiled
        if compiled is None or compiled.train_layout is None:
            raise SaveError(f"{graph.name}: the graph has not been called, so there is no compiled train step to "
                            f"save; call it once, or pass inputs: tvmgraph.save(graph, path, example_args=(x, y), "
                            f"program='train_step')")
        from .deploy import last_call_holds, last_call_zeros  # deploy imports this module

        if not last_call_holds(graph):  # the model or optimizer changed since: trace it as it is now
            example_args = last_call_zeros(graph)
    if example_args is None:
        traced, plan = compiled.traced, compiled.plan
    else:
        traced = graph.trace(*(example_args if isinstance(example_args, tuple) else (example_args,)))
        plan = entry.training_plan(graph.name, st.optimizers, traced, graph.named_parameters,
                                   traced.signature.options, named_modules=graph.named_modules)
    options = traced.signature.options
    if options.gradient_accumulation_steps > 1 or options.data_parallel > 1:
        raise UnsupportedOptionError(
            f"{graph.name}: a saved train step runs one batch per step in one process; turn gradient "
            f"accumulation and data parallelism off before saving it (set_gradient_accumulation_steps(1), "
            f"enable_data_parallel(False)) and call the graph once more, or pass example_args")
    if plan.lr_schedulers:
        st.log.note("the saved train step keeps the current learning rate; its lr scheduler is not saved "
                    "(set the lr on the loaded graph: loaded.set_hyperparameter('lr', value))")
    lowered = traced.lower(plan)
    states, groups = {}, []
    for g_index, group in enumerate(plan.groups):
        fresh = []
        for target, param in zip(group.targets, group.params):
            # Not put into the optimizer: its next graph step must still find them missing (fresh).
            missing = lazy_state(group, param)
            fresh.append(bool(missing))
            current = {**group.optimizer.state.get(param, {}), **missing}
            for key in group.state_keys:
                value = current[key] if kept(group, param, key) else placeholder(param.device)
                states[f"optimizer/{target}/{key}"] = value
        groups.append({"optimizer": type(group.optimizer).__name__, "rule": group.rule.name,
                       "index": g_index, "params": list(group.targets), "state_keys": list(group.state_keys),
                       "hyper_keys": list(group.rule.hyper_keys),
                       "first_call": group.rule.hyper_vector(group.group, fresh),
                       "later_calls": group.rule.hyper_vector(group.group, [False] * len(fresh)),
                       "compiled_zero": _compiled_zero(group.rule, group.group)})
    training = {"params": plan.targets, "states": list(states), "groups": groups}
    return traced, lowered, states, training


def _compiled_zero(rule: Any, group: dict) -> dict[str, bool]:
    """For each hyperparameter whose being zero shapes the program (SGD's momentum, dampening,
    weight decay: the terms left out at zero), whether it was zero when compiled: the loaded
    step refuses a value on the other side of zero, which its program would ignore."""
    out = {}
    for key in rule.hyper_keys:
        value = group.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if rule.flags({**group, key: 0.0}) != rule.flags({**group, key: 1.0}):
            out[key] = value == 0
    return out

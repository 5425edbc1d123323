"""What a training graph updates: every optimizer param group, resolved to module paths.

`TrainingPlan.build` reads the optimizers given to `Graph.add_optimizer` and finds each of their
parameters among the graph's modules (by identity), so that the compiled program can address
them by path (`model.0.weight`), like every other tensor it reads.

Gradient clipping follows OneFlow: a param group with `clip_grad_max_norm` (and optionally
`clip_grad_norm_type`, default 2.0) has its gradients scaled so that their joint norm is at most
`clip_grad_max_norm`, exactly as `torch.nn.utils.clip_grad_norm_` over that group would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import OptimizerError
from .optimizers import UpdateRule, rule_for

CLIP_MAX_NORM = "clip_grad_max_norm"
CLIP_NORM_TYPE = "clip_grad_norm_type"


@dataclass
class GroupPlan:
    """One param group of one optimizer: its rule, its live dict, its parameters by path."""

    optimizer: torch.optim.Optimizer
    group_index: int
    rule: UpdateRule
    targets: list[str]
    params: list[torch.nn.Parameter]
    clip: tuple[float, float] | None  # (max_norm, norm_type)
    # The program-shaping options, fixed when the plan (and so the compiled entry) is made: a
    # change to them changes the call signature and selects another entry.
    flags: dict[str, bool] = field(default_factory=dict)
    state_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.flags = self.rule.flags(self.group)
        self.state_keys = self.rule.state_keys(self.flags)

    @property
    def group(self) -> dict:
        return self.optimizer.param_groups[self.group_index]

    def structure(self) -> tuple:
        return (self.rule.name, self.rule.structure(self.group), tuple(self.targets), self.clip)


@dataclass
class TrainingPlan:
    """All groups of all optimizers of one graph, in `add_optimizer` order."""

    groups: list[GroupPlan] = field(default_factory=list)
    lr_schedulers: list[object] = field(default_factory=list)
    # The backward pass recomputes attention probabilities (GraphConfig.enable_recompute_attention).
    recompute_attention: bool = True
    # Paths of the modules whose activations the backward pass recomputes (GraphModule).
    activation_checkpointing: tuple[str, ...] = ()
    # Graph.set_grad_scaler's torch.amp.GradScaler, when enabled: the step scales the loss
    # (tvmgraph/training/loss_scale.py) and reads and writes the scaler's state.
    grad_scaler: torch.amp.GradScaler | None = None
    graph_name: str = "graph"  # for errors found while the program runs

    @property
    def loss_scaling(self) -> bool:
        return self.grad_scaler is not None

    @property
    def targets(self) -> list[str]:
        """Paths of every trained parameter, in update order (one entry per parameter)."""
        return [t for g in self.groups for t in g.targets]

    def structure(self) -> tuple:
        """Everything about the optimizers (and loss scaling) that changes the compiled program."""
        return tuple(g.structure() for g in self.groups) + (("loss_scaling",) if self.loss_scaling else ())

    def owned(self, graph_name: str, rank: int, world: int) -> TrainingPlan:
        """ZeRO: the groups cut down to the parameters `rank` updates (data_parallel.owners);
        a group left with none is dropped."""
        from .data_parallel import owners

        params = [p for g in self.groups for p in g.params]
        owner = iter(owners([p.numel() for p in params], world))
        groups = []
        for g in self.groups:
            keep = [next(owner) == rank for _ in g.params]
            if g.clip is not None:
                raise OptimizerError(f"{graph_name}: gradient clipping (clip_grad_max_norm) with ZeRO is not "
                                     f"implemented: each rank sees only its share of a group's gradients. Clip "
                                     f"without ZeRO (graph.config.enable_zero(False)).")
            if any(keep):
                groups.append(GroupPlan(g.optimizer, g.group_index, g.rule,
                                        [t for t, k in zip(g.targets, keep) if k],
                                        [p for p, k in zip(g.params, keep) if k], g.clip))
        return TrainingPlan(groups, self.lr_schedulers, self.recompute_attention)

    @staticmethod
    def build(graph_name: str, optimizers: list[tuple[torch.optim.Optimizer, object]],
              named_parameters: list[tuple[str, torch.nn.Parameter]],
              recompute_attention: bool = True, activation_checkpointing: tuple[str, ...] = (),
              grad_scaler: torch.amp.GradScaler | None = None, only_present: bool = False,
              reached: frozenset[str] | None = None) -> TrainingPlan:
        """The plan of `optimizers` over the parameters in `named_parameters`. `only_present` (a
        pipeline stage, which holds part of the model): the parameters of the others are left
        out, and so is a group left with none; else each of them is an error. `reached`: the
        paths of the parameters the loss gives a gradient (training/reached.py); the others
        are not updated, as torch's optimizers skip a parameter whose `.grad` is None."""
        path_of: dict[int, str] = {}
        for path, p in named_parameters:  # a shared parameter goes by its first path, as in lowering
            path_of.setdefault(id(p), path)
        plan = TrainingPlan(lr_schedulers=[s for _, s in optimizers if s is not None],
                            recompute_attention=recompute_attention,
                            activation_checkpointing=activation_checkpointing, grad_scaler=grad_scaler,
                            graph_name=graph_name)
        seen: dict[int, str] = {}
        for opt_index, (optimizer, _) in enumerate(optimizers):
            rule = rule_for(optimizer, f"{graph_name}: add_optimizer() #{opt_index}")
            for group_index, group in enumerate(optimizer.param_groups):
                where = f"{graph_name}: optimizer #{opt_index} ({type(optimizer).__name__}) param group {group_index}"
                rule.check_group(group, where)
                targets, params = [], []
                for param_index, p in enumerate(group["params"]):
                    if id(p) not in path_of:
                        if only_present:
                            continue
                        raise OptimizerError(
                            f"{where}: parameter #{param_index} {tuple(p.shape)} belongs to no module "
                            f"of the graph; assign the module that owns it in __init__ "
                            f"(self.model = model) before add_optimizer(). If a module's parameter was "
                            f"replaced by a new nn.Parameter, give the optimizer the new one too "
                            f"(a new optimizer, or optimizer.param_groups[i]['params'])")
                    if not p.requires_grad:
                        continue  # torch skips parameters without a gradient, so do we
                    path = path_of[id(p)]
                    if reached is not None and path not in reached:
                        continue  # unused by the loss: its .grad stays None in torch
                    if path in seen:
                        raise OptimizerError(f"{where}: parameter '{path}' is also updated by {seen[path]}; "
                                             f"give each parameter to one optimizer group only")
                    seen[path] = where
                    targets.append(path)
                    params.append(p)
                if params or not only_present:
                    plan.groups.append(GroupPlan(optimizer, group_index, rule, targets, params, _clip(group, where)))
        return plan


def _clip(group: dict, where: str) -> tuple[float, float] | None:
    if CLIP_MAX_NORM not in group:
        if CLIP_NORM_TYPE in group:
            raise OptimizerError(f"{where}: {CLIP_NORM_TYPE} is set but {CLIP_MAX_NORM} is not; set both")
        return None
    if group[CLIP_MAX_NORM] is None:  # a config's way of saying "no clipping"
        return None
    try:
        max_norm = float(group[CLIP_MAX_NORM])
        norm_type = float(group.get(CLIP_NORM_TYPE, 2.0))
    except (TypeError, ValueError):
        raise OptimizerError(f"{where}: {CLIP_MAX_NORM} and {CLIP_NORM_TYPE} must be numbers, got "
                             f"{group[CLIP_MAX_NORM]!r} and {group.get(CLIP_NORM_TYPE, 2.0)!r}; delete "
                             f"{CLIP_MAX_NORM} (or set it to None) for no clipping") from None
    if not max_norm > 0:
        raise OptimizerError(f"{where}: {CLIP_MAX_NORM} must be > 0, got {group[CLIP_MAX_NORM]!r}")
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise OptimizerError(f"{where}: {CLIP_NORM_TYPE} must be > 0, inf or -inf, got {group[CLIP_NORM_TYPE]!r}")
    return max_norm, norm_type

"""The training pass: `main` plus Relax autodiff plus the optimizer update, in one function.

Input contract (what tvmgraph.lower produces for a build() that called loss.backward()):

    @R.function
    def main(inputs..., params..., buffers..., constants...):
        ...
        return (mutations..., outputs..., loss)

Output: the module with `main` replaced by

    @R.function
    def train_step(inputs..., params..., buffers..., constants..., states..., hypers...):
        (outs, grads) = main_adjoint(inputs..., params..., buffers..., constants...)  # inlined
        grads = clip(grads)                                    # per group, when configured
        new_params, new_states = optimizer updates             # per parameter
        return (mutations..., outputs..., loss, new_params..., new_states...)

where `states` are one tensor per (trained parameter, state key) in plan order and `hypers` one
float32 vector per param group (its `UpdateRule.hyper_keys`). `main_adjoint` comes from
`relax.transform.Gradient` and is inlined, so the update can fuse with the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm
from tvm import relax

from .. import gradients as _gradients  # noqa: F401  (registers the gradients TVM lacks)
from .optimizers import UpdateInputs
from .plan import GroupPlan, TrainingPlan

FUNC_NAME = "train_step"


@dataclass(frozen=True)
class TrainStepLayout:
    """How `train_step` extends `main`'s calling convention (for the runtime)."""

    grad_indices: tuple[int, ...]  # main parameters that are trained, in plan order
    state_shapes: tuple[tuple[str, str, tuple[int, ...], str], ...]  # (target, key, shape, dtype)
    num_groups: int


def _take(bb: relax.BlockBuilder, vector: relax.Expr, index: int) -> relax.Var:
    return bb.emit(relax.op.take(vector, relax.const(index, "int64"), axis=0))


def _clip(bb: relax.BlockBuilder, grads: list[relax.Expr], max_norm: float, norm_type: float) -> list[relax.Expr]:
    """torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (total_norm + 1e-6))."""
    op = relax.op
    dtype = grads[0].ty.dtype.dtype
    if math.isinf(norm_type):
        norms = [op.max(op.abs(g)) for g in grads]
        total = bb.emit(op.max(op.stack(norms)) if len(norms) > 1 else norms[0])
    else:
        p = relax.const(norm_type, dtype)
        powered = [op.sum(op.power(op.abs(g), p)) if norm_type != 2 else op.sum(op.multiply(g, g)) for g in grads]
        summed = powered[0]
        for term in powered[1:]:
            summed = op.add(summed, term)
        total = bb.emit(op.sqrt(summed) if norm_type == 2 else op.power(summed, relax.const(1.0 / norm_type, dtype)))
    coef = op.divide(relax.const(max_norm, dtype), op.add(total, relax.const(1e-6, dtype)))
    coef = bb.emit(op.minimum(coef, relax.const(1.0, dtype)))
    return [bb.emit(op.multiply(g, coef)) for g in grads]


def append_train_step(mod: tvm.IRModule, plan: TrainingPlan, grad_indices: list[int],
                      loss_index: int) -> tuple[tvm.IRModule, TrainStepLayout]:
    """Replace `main` with `train_step` (see the module docstring for the contract)."""
    main = mod["main"]
    mod = relax.transform.Gradient("main", require_grads=[main.params[i] for i in grad_indices],
                                   target_index=loss_index)(mod)
    adjoint_gv = mod.get_global_var("main_adjoint")
    num_outputs = len(main.ret_ty.fields)

    bb = relax.BlockBuilder(mod)
    inputs = [relax.Var(v.name, v.ty) for v in main.params]
    state_vars, state_shapes = [], []
    for group in plan.groups:
        for target, index in zip(group.targets, _indices_of(group, plan, grad_indices)):
            ty = main.params[index].ty
            for key in group.state_keys:
                shape, dtype = ((), "float32") if key == "step" else (tuple(int(d) for d in ty.shape), ty.dtype.dtype)
                state_vars.append(relax.Var(f"{_ident(target)}__{key}", relax.TensorType(shape, dtype)))
                state_shapes.append((target, key, shape, dtype))
    hyper_vars = [relax.Var(f"hyper_{i}", relax.TensorType((len(g.rule.hyper_keys),), "float32"))
                  for i, g in enumerate(plan.groups)]

    with bb.function(FUNC_NAME, inputs + state_vars + hyper_vars):
        with bb.dataflow():
            ret = bb.emit(relax.Call(adjoint_gv, inputs))
            outs = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 0), i)) for i in range(num_outputs)]
            grads = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 1), j)) for j in range(len(grad_indices))]
            new_params, new_states = [], []
            cursor, state_cursor = 0, 0
            for group, hyper in zip(plan.groups, hyper_vars):
                n = len(group.targets)
                group_grads = grads[cursor:cursor + n]
                if group.clip is not None and n:
                    group_grads = _clip(bb, group_grads, *group.clip)
                h = {key: _take(bb, hyper, i) for i, key in enumerate(group.rule.hyper_keys)}
                for k in range(n):
                    param = inputs[grad_indices[cursor + k]]
                    keys = group.state_keys
                    state = dict(zip(keys, state_vars[state_cursor:state_cursor + len(keys)]))
                    state_cursor += len(keys)
                    new_p, new_s = group.rule.emit_update(bb.emit, UpdateInputs(param, group_grads[k], state, h), group.group)
                    new_params.append(new_p)
                    new_states.extend(new_s[key] for key in keys)
                cursor += n
            result = bb.emit_output(relax.Tuple(outs + new_params + new_states))
        bb.emit_func_output(result)
    mod = bb.get()

    # Inline the adjoint so that the update fuses with the backward pass; drop what is unused.
    mod["main_adjoint"] = mod["main_adjoint"].without_attr("global_symbol")
    mod = tvm.transform.Sequential([
        relax.transform.InlinePrivateFunctions(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.DeadCodeElimination([FUNC_NAME]),
    ])(mod)
    layout = TrainStepLayout(tuple(grad_indices), tuple(state_shapes), len(plan.groups))
    return mod, layout


def _indices_of(group: GroupPlan, plan: TrainingPlan, grad_indices: list[int]) -> list[int]:
    start = sum(len(g.targets) for g in plan.groups[:plan.groups.index(group)])
    return grad_indices[start:start + len(group.targets)]


def _ident(path: str) -> str:
    return path.replace(".", "_")

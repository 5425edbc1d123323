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
        grads = clip(grads)                                   # per group, when configured
        upd_0 = update_0(hyper_0, p, g, states..., p, g, states..., ...)   # one call per group
        ...
        return (mutations..., outputs..., loss, new_params..., new_states...)

    @R.function(private=True)
    def update_0(hyper, p, g, s..., ...):   # attrs: tvmgraph.model_update = rule name, flags
        ...elementwise update of every parameter of group 0...
        return (new_s..., new_p, new_s..., new_p, ...)

`states` are one tensor per (trained parameter, state key) in plan order and `hypers` one
float64 vector per param group (its `UpdateRule.hyper_keys`). `main_adjoint` comes from
`relax.transform.Gradient` and is inlined, so the update can fuse with the backward pass. The
update functions are inlined by the pipeline, or replaced by one in-place kernel each by
relay_passes/fuse_model_update.py. All updates come after all gradients, so an in-place update
never overwrites a parameter that the backward pass still reads (a later pass that moves an
update earlier keeps it after every other reader of what it overwrites).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import tvm
from tvm import relax

from .. import gradients as _gradients  # noqa: F401  (registers the gradients TVM lacks)
from ..errors import UnsupportedOpError, reason_of
from . import symbolic_shapes
from .gradient_check import check_gradients
from .optimizers import PARAM, UpdateRule
from .plan import GroupPlan, TrainingPlan
from .update_ops import SCALAR_DTYPE, RelaxUpdateOps

FUNC_NAME = "train_step"
MODEL_UPDATE_ATTR = "tvmgraph.model_update"  # rule name, on each group's update function
FLAGS_ATTR = "tvmgraph.update_flags"


@dataclass(frozen=True)
class TrainStepLayout:
    """How `train_step` extends `main`'s calling convention (for the runtime)."""

    grad_indices: tuple[int, ...]  # main parameters that are trained, in plan order
    state_shapes: tuple[tuple[str, str, tuple[int, ...], str], ...]  # (target, key, shape, dtype)
    num_groups: int


def update_function(rule: UpdateRule, flags: dict[str, bool], param_types: list[relax.TensorType],
                    name: str) -> relax.Function:
    """The Relax function updating every parameter of one group (see the module docstring)."""
    keys = rule.state_keys(flags)
    bb = relax.BlockBuilder()
    hyper = relax.Var("hyper", relax.TensorType((len(rule.hyper_keys),), SCALAR_DTYPE))
    params, per_param = [hyper], []
    for i, ty in enumerate(param_types):
        p, g = relax.Var(f"p{i}", ty), relax.Var(f"g{i}", ty)
        states = {k: relax.Var(f"{k}{i}", relax.TensorType((), "float32") if rule.scalar_state(k) else ty)
                  for k in keys}
        params += [p, g, *states.values()]
        per_param.append((p, g, states))
    # Public while the adjoint is inlined (see append_train_step), private afterwards.
    with bb.function(name, params, attrs={MODEL_UPDATE_ATTR: rule.name, FLAGS_ATTR: flags}):
        with bb.dataflow():
            h = {k: bb.emit(relax.op.take(hyper, relax.const(i, "int64"), axis=0, mode="clip"))
                 for i, k in enumerate(rule.hyper_keys)}
            results = []
            for p, g, states in per_param:
                dtype = p.ty.dtype.dtype
                ops = RelaxUpdateOps(bb, dtype, {PARAM: dtype, **{k: v.ty.dtype.dtype for k, v in states.items()}})
                rule.update(ops, ops.wrap(p), ops.wrap(g),
                            {k: ops.wrap(v, rule.scalar_state(k)) for k, v in states.items()},
                            {k: ops.wrap(v, scalar=True) for k, v in h.items()}, flags)
                results += [ops.outputs[k] for k in keys] + [ops.outputs[PARAM]]
            out = bb.emit_output(relax.Tuple(results))
        bb.emit_func_output(out)
    return bb.get()[name]


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


def append_train_step(mod: tvm.IRModule, plan: TrainingPlan, grad_indices: list[int], loss_index: int,
                      report: Callable[[str], None] | None = None, graph: str = "graph",
                      origins: Mapping[str, str] | None = None) -> tuple[tvm.IRModule, TrainStepLayout]:
    """Replace `main` with `train_step` (see the module docstring for the contract); `graph`
    names the graph in warnings and errors, `origins` the torch op each Relax variable came
    from (`tvmgraph.lower.relax_origins`) in the error listing the ops without gradients."""
    from relay_passes.recompute_attention import RecomputeAttention  # relay_passes import tvmgraph

    from ..pipeline import run_pass

    # Checked always (one check of the forward program): a broken result would fail in autodiff.
    mod = run_pass(RecomputeAttention(plan.recompute_attention, report), mod, graph, check=True)
    main = mod["main"]
    check_gradients(main, loss_index, origins or {}, graph)
    num_outputs = len(main.ret_ty.fields)
    symbolic = symbolic_shapes.is_symbolic(main)  # a dynamic batch (symbolic_shapes.py)
    mod, lifted = symbolic_shapes.lift_shapes(mod) if symbolic else (mod, [])
    mod = _differentiate(mod, grad_indices, loss_index, graph)
    if symbolic:
        mod = symbolic_shapes.bind_shapes(mod, lifted)
    adjoint_gv = mod.get_global_var("main_adjoint")

    bb = relax.BlockBuilder(mod)
    inputs = [relax.Var(v.name, v.ty) for v in main.params]
    state_vars, state_shapes = [], []
    update_gvs = []
    for index, group in enumerate(plan.groups):
        types = [main.params[i].ty for i in _indices_of(group, plan, grad_indices)]
        name = f"update_{index}_{group.rule.name}"
        update_gvs.append(bb.add_func(update_function(group.rule, group.flags, types, name), name))
        for target, ty in zip(group.targets, types):
            for key in group.state_keys:
                scalar = group.rule.scalar_state(key)
                shape, dtype = ((), "float32") if scalar else (tuple(int(d) for d in ty.shape), ty.dtype.dtype)
                state_vars.append(relax.Var(f"{target.replace('.', '_')}__{key}", relax.TensorType(shape, dtype)))
                state_shapes.append((target, key, shape, dtype))
    hyper_vars = [relax.Var(f"hyper_{i}", relax.TensorType((len(g.rule.hyper_keys),), SCALAR_DTYPE))
                  for i, g in enumerate(plan.groups)]

    with bb.function(FUNC_NAME, inputs + state_vars + hyper_vars):
        with bb.dataflow():
            ret = bb.emit(relax.Call(adjoint_gv, inputs))
            outs = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 0), i)) for i in range(num_outputs)]
            grads = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 1), j)) for j in range(len(grad_indices))]
            new_params, new_states = [], []
            cursor, state_cursor = 0, 0
            for group, hyper, update_gv in zip(plan.groups, hyper_vars, update_gvs):
                n, keys = len(group.targets), group.state_keys
                group_grads = grads[cursor:cursor + n]
                if group.clip is not None and n:
                    group_grads = _clip(bb, group_grads, *group.clip)
                args = [hyper]
                for k in range(n):
                    args += [inputs[grad_indices[cursor + k]], group_grads[k],
                             *state_vars[state_cursor:state_cursor + len(keys)]]
                    state_cursor += len(keys)
                updated = bb.emit(relax.Call(update_gv, args))
                for k in range(n):
                    base = k * (len(keys) + 1)
                    new_states += [bb.emit(relax.TupleGetItem(updated, base + j)) for j in range(len(keys))]
                    new_params.append(bb.emit(relax.TupleGetItem(updated, base + len(keys))))
                cursor += n
            result = bb.emit_output(relax.Tuple(outs + new_params + new_states))
        bb.emit_func_output(result)
    mod = bb.get()

    # Inline the adjoint so that the update can fuse with the backward pass; drop what is unused,
    # `main` included: a training graph's calls run train_step, and compiling the forward pass
    # a second time on its own made the CNN's training graph compile 1 s longer.
    del mod["main"]
    mod["main_adjoint"] = mod["main_adjoint"].without_attr("global_symbol")
    mod = tvm.transform.Sequential([
        relax.transform.InlinePrivateFunctions(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.DeadCodeElimination([FUNC_NAME]),
    ])(mod)
    if symbolic:
        mod[FUNC_NAME] = symbolic_shapes.unify_symbolic_vars(mod[FUNC_NAME])
    for gv in update_gvs:  # the pipeline fuses them (FuseModelUpdate) or inlines them
        mod[gv] = mod[gv].without_attr("global_symbol")
    layout = TrainStepLayout(tuple(grad_indices), tuple(state_shapes), len(plan.groups))
    return mod, layout


# The NotImplementedError messages of tvmgraph/gradients: a configuration they do not cover.
_NOT_COVERED = re.compile(r"gradient of relax\.[\w.]+ .*|tvmgraph\.gradients need static shapes.*")


def _differentiate(mod: tvm.IRModule, grad_indices: list[int], loss_index: int, graph: str) -> tvm.IRModule:
    """`main_adjoint` added to `mod`: `Gradient` of the loss w.r.t. the parameters at `grad_indices`.

    `Gradient` takes float16/32/64 targets only: a bfloat16 loss is differentiated through an
    extra float32 output (a cast, exact), which the train step does not return. Gradients that
    tvmgraph cannot compute become UnsupportedOpError: a configuration a registered gradient does
    not cover (its NotImplementedError), and shapes that depend on data (`match_cast`, from
    `nonzero` or boolean masks), which `Gradient` rejects ("Check failed: (var_binding)").
    """
    main = mod["main"]
    loss = main.body.body.fields[loss_index]
    target_index = loss_index
    if loss.ty.dtype.dtype not in ("float16", "float32", "float64"):
        cast = relax.Var("loss_float32", relax.TensorType((), "float32"))
        blocks = list(main.body.blocks)
        bindings = [*blocks[-1].bindings, relax.VarBinding(cast, relax.op.astype(loss, "float32"))]
        blocks[-1] = relax.DataflowBlock(bindings)
        fields = [*main.body.body.fields, cast]
        body = relax.SeqExpr(blocks, relax.Tuple(fields))
        main = relax.Function(main.params, body, relax.TupleType([f.ty for f in fields]), attrs=main.attrs)
        mod = mod.clone()
        mod["main"] = main
        target_index = len(fields) - 1
    try:
        return relax.transform.Gradient("main", require_grads=[main.params[i] for i in grad_indices],
                                        target_index=target_index)(mod)
    except Exception as e:  # TVM hands a gradient's NotImplementedError back as a RuntimeError
        not_covered = _NOT_COVERED.match(str(e))
        if not_covered:
            raise UnsupportedOpError(f"{graph}: build() needs a gradient that tvmgraph does not cover: "
                                     f"{not_covered.group(0)}. Rewrite that part with covered ops or run it "
                                     f"outside the graph (TVM's autodiff differentiates everything the loss "
                                     f"depends on, so freezing parameters does not help).") from None
        data_dependent = any(isinstance(b, relax.MatchCast) for block in main.body.blocks for b in block.bindings)
        if not (data_dependent and "var_binding" in str(e)):
            if symbolic_shapes.is_symbolic(main) and not data_dependent:  # a dynamic batch
                raise UnsupportedOpError(
                    f"{graph}: TVM's autodiff failed on this program with a dynamic batch "
                    f"(config.enable_dynamic_batch(); {type(e).__name__}: {reason_of(e)}). Train it with a "
                    f"static batch (the option off; a smaller last batch then compiles once more); an MLP or "
                    f"a CNN trains with a dynamic batch (docs/training.md, \"Dynamic batch\").") from e
            raise
        raise UnsupportedOpError(f"{graph}: build() computes a shape from tensor values (nonzero, boolean masks, "
                                 f"torch.combinations) on the way to the loss; tvmgraph cannot differentiate "
                                 f"through it. Run that part outside the graph (compute it before calling the "
                                 f"graph).") from None


def _indices_of(group: GroupPlan, plan: TrainingPlan, grad_indices: list[int]) -> list[int]:
    start = sum(len(g.targets) for g in plan.groups[:plan.groups.index(group)])
    return grad_indices[start:start + len(group.targets)]

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
                                            # (loss scaling: hyper, skip, unscale, p, g, ...)
        ...elementwise update of every parameter of group 0...
        return (new_s..., new_p, new_s..., new_p, ...)

`states` are one tensor per (trained parameter, state key) in plan order and `hypers` one
float64 vector per param group (its `UpdateRule.hyper_keys`, then each parameter's
`param_hyper_keys`: SGD's `first`). `main_adjoint` comes from
`relax.transform.Gradient` and is inlined, so the update can fuse with the backward pass. The
update functions are inlined by the pipeline, or replaced by one in-place kernel each by
relay_passes/fuse_model_update.py. All updates come after all gradients, so an in-place update
never overwrites a parameter that the backward pass still reads (a later pass that moves an
update earlier keeps it after every other reader of what it overwrites).

With a GradScaler (`plan.loss_scaling`), train_step also takes `loss_scale, growth_tracker,
scaler_hyper` last and returns the new scale and tracker last; the gradient is that of the
scaled loss, unscaled before clipping, and an overflow keeps every old value (loss_scale.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import tvm
from tvm import relax

from .. import gradients as _gradients  # noqa: F401  (registers the gradients TVM lacks)
from ..errors import UnsupportedOpError, reason_of
from . import loss_scale, symbolic_shapes
from .gradient_check import check_gradients
from .optimizers import PARAM, UpdateRule
from .plan import TrainingPlan
from .update_ops import SCALAR_DTYPE, RelaxUpdateOps

FUNC_NAME = "train_step"
MODEL_UPDATE_ATTR = "tvmgraph.model_update"  # rule name, on each group's update function
FLAGS_ATTR = "tvmgraph.update_flags"
SKIP_ATTR = "tvmgraph.update_skippable"  # takes SKIP_INPUTS after `hyper` (loss scaling)
SKIP_INPUTS = ("skip", "unscale")


@dataclass(frozen=True)
class TrainStepLayout:
    """How `train_step` extends `main`'s calling convention (for the runtime)."""

    grad_indices: tuple[int, ...]  # main parameters that are trained, in plan order
    state_shapes: tuple[tuple[str, str, tuple[int, ...], str], ...]  # (target, key, shape, dtype)
    num_groups: int
    # > 1: the module holds accumulate_grads and apply_update instead (accumulation.py)
    accumulation_steps: int = 1
    loss_scaling: bool = False  # a GradScaler's scale and tracker go in and out last (loss_scale.py)
    # > 1: data parallel over that many ranks, also split in two (data_parallel.py)
    ranks: int = 1
    # One stage of a pipeline (pipeline_parallel.py), also split in two; accumulate_grads
    # returns the gradients of these main parameters (user inputs) last, not accumulated.
    pipelined: bool = False
    input_grads: tuple[int, ...] = ()

    @property
    def split(self) -> bool:
        """The program is accumulate_grads + apply_update, not one train_step."""
        return self.accumulation_steps > 1 or self.ranks > 1 or self.pipelined


def state_type(rule: UpdateRule, key: str, param: relax.TensorType) -> relax.TensorType:
    """The type of state `key` of a parameter of type `param`: a float32 scalar for scalar
    state and for state torch does not keep for this parameter (a placeholder, passed through),
    else the rule's shape in the parameter's dtype."""
    shape = rule.state_shape(key, tuple(int(d) for d in param.shape.values))
    if rule.scalar_state(key) or shape is None:
        return relax.TensorType((), "float32")
    return relax.TensorType(shape, param.dtype.dtype)


def hyper_reads(bb: relax.BlockBuilder, rule: UpdateRule, hyper: relax.Expr,
                params: int) -> list[dict[str, relax.Expr]]:
    """Each parameter's hyperparameters read out of its group's vector (`UpdateRule.hyper_slots`):
    the group's keys emitted once, shared, and each parameter's own keys per parameter."""

    def read(i: int) -> relax.Expr:
        return bb.emit(relax.op.take(hyper, relax.const(i, "int64"), axis=0, mode="clip"))

    shared = {k: read(i) for i, k in enumerate(rule.hyper_keys)}
    return [{**shared, **{k: read(i) for k, i in rule.hyper_slots(j).items() if k not in shared}}
            for j in range(params)]


def update_function(rule: UpdateRule, flags: dict[str, bool], param_types: list[relax.TensorType],
                    name: str, skippable: bool = False) -> relax.Function:
    """The Relax function updating every parameter of one group (see the module docstring).
    `skippable` (loss scaling): two float32 scalar inputs after `hyper`: `skip`, where it is
    above 0 (the step overflowed) every result is its old value (loss_scale.keep_if_found),
    and `unscale`, which each gradient is multiplied by first (1 / the loss scale)."""
    keys = rule.state_keys(flags)
    bb = relax.BlockBuilder()
    hyper = relax.Var("hyper", relax.TensorType((rule.hyper_length(len(param_types)),), SCALAR_DTYPE))
    scalars = [relax.Var(name, relax.TensorType((), "float32")) for name in SKIP_INPUTS] if skippable else []
    skip, unscale = scalars or (None, None)
    params, per_param = [hyper, *scalars], []
    for i, ty in enumerate(param_types):
        p, g = relax.Var(f"p{i}", ty), relax.Var(f"g{i}", ty)
        states = {k: relax.Var(f"{k}{i}", state_type(rule, k, ty)) for k in keys}
        params += [p, g, *states.values()]
        per_param.append((p, g, states))
    # Public while the adjoint is inlined (see append_train_step), private afterwards.
    with bb.function(name, params, attrs={MODEL_UPDATE_ATTR: rule.name, FLAGS_ATTR: flags, SKIP_ATTR: skippable}):
        with bb.dataflow():
            results = []
            for h, (p, g, states) in zip(hyper_reads(bb, rule, hyper, len(per_param)), per_param):
                dtype = p.ty.dtype.dtype
                ops = RelaxUpdateOps(bb, dtype, {PARAM: dtype, **{k: v.ty.dtype.dtype for k, v in states.items()}})
                grad = loss_scale.unscaled(bb, g, unscale) if unscale is not None else g
                rule.update(ops, ops.wrap(p), ops.wrap(grad),
                            {k: ops.wrap(v, rule.scalar_state(k) or v.ty.ndim == 0) for k, v in states.items()},
                            {k: ops.wrap(v, scalar=True) for k, v in h.items()}, flags)
                new = [ops.outputs[k] for k in keys] + [ops.outputs[PARAM]]
                if skip is not None:
                    new = [loss_scale.keep_if_found(bb, skip, old, value)
                           for old, value in zip([*states.values(), p], new)]
                results += new
            out = bb.emit_output(relax.Tuple(results))
        bb.emit_func_output(out)
    return bb.get()[name]


def _clip(bb: relax.BlockBuilder, grads: list[relax.Expr], max_norm: float, norm_type: float) -> list[relax.Expr]:
    """torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (total_norm + 1e-6)), the total the
    norm of the gradients' norms. Each norm is computed in float32 (float64 for float64) and
    rounded to its gradient's dtype, as torch's `_foreach_norm`: in float16, the sum of squares of
    a (100, 100) gradient of 3s (90000) overflowed, the factor became 0 and training stopped."""
    op = relax.op
    dtypes = [g.ty.dtype.dtype for g in grads]
    wide = "float64" if "float64" in dtypes else "float32"

    def norm(values: list[relax.Expr]) -> relax.Expr:
        if math.isinf(norm_type):  # inf: the largest |g|; -inf: the smallest, as torch's vector_norm
            extreme = op.max if norm_type > 0 else op.min
            norms = [extreme(op.abs(v)) for v in values]
            return extreme(op.stack(norms)) if len(norms) > 1 else norms[0]
        p = relax.const(norm_type, wide)
        powered = [op.sum(op.power(op.abs(v), p)) if norm_type != 2 else op.sum(op.multiply(v, v)) for v in values]
        summed = powered[0]
        for term in powered[1:]:
            summed = op.add(summed, term)
        return op.sqrt(summed) if norm_type == 2 else op.power(summed, relax.const(1.0 / norm_type, wide))

    def widened(x: relax.Expr, dtype: str) -> relax.Expr:
        return x if dtype == wide else op.astype(x, wide)

    def rounded(x: relax.Expr, dtype: str) -> relax.Expr:  # to `dtype` and back, as torch's result
        return x if dtype == wide else op.astype(op.astype(x, dtype), wide)

    per_grad = [rounded(norm([widened(g, d)]), d) for g, d in zip(grads, dtypes)]
    total = bb.emit(per_grad[0] if len(per_grad) == 1 else norm(per_grad))
    coef = op.divide(relax.const(max_norm, wide), op.add(total, relax.const(1e-6, wide)))
    coef = bb.emit(op.minimum(coef, relax.const(1.0, wide)))
    return [bb.emit(op.multiply(g, coef if d == wide else op.astype(coef, d))) for g, d in zip(grads, dtypes)]


def append_train_step(mod: tvm.IRModule, plan: TrainingPlan, grad_indices: list[int], loss_index: int,
                      report: Callable[[str], None] | None = None, graph: str = "graph",
                      origins: Mapping[str, str] | None = None,
                      checkpoint_regions: Sequence[Collection[str]] = ()) -> tuple[tvm.IRModule, TrainStepLayout]:
    """Replace `main` with `train_step` (see the module docstring for the contract); `graph`
    names the graph in warnings and errors, `origins` the torch op each Relax variable came
    from (`tvmgraph.lower.relax_origins`) in the error listing the ops without gradients,
    `checkpoint_regions` the bindings of each module call whose activations are recomputed."""
    main = mod["main"]
    num_outputs = len(main.ret_ty.fields)
    scaling = plan.loss_scaling
    mod = differentiate_main(mod, plan, grad_indices, loss_index, report, graph, origins,
                             checkpoint_regions=checkpoint_regions, scaling=scaling)
    adjoint_gv = mod.get_global_var("main_adjoint")

    bb = relax.BlockBuilder(mod)
    inputs = [relax.Var(v.name, v.ty) for v in main.params]
    updates = declare_updates(bb, plan, [main.params[i].ty for i in grad_indices])
    scaler = loss_scale.scaler_vars() if scaling else ()
    with bb.function(FUNC_NAME, inputs + updates.state_vars + updates.hyper_vars + list(scaler)):
        with bb.dataflow():
            ret = bb.emit(relax.Call(adjoint_gv, inputs + list(scaler[:1])))
            outs = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 0), i)) for i in range(num_outputs)]
            grads = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 1), j)) for j in range(len(grad_indices))]
            found = unscale_per_optimizer(bb, plan, grads, scaler[0]) if scaling else None
            new_params, new_states = updates.emit(bb, [inputs[i] for i in grad_indices], grads, found)
            scaler_out = list(loss_scale.update_scale(bb, scaler[0], scaler[1], found["any"], scaler[2])) \
                if found is not None else []
            result = bb.emit_output(relax.Tuple(outs + new_params + new_states + scaler_out))
        bb.emit_func_output(result)
    # `main` is dropped: a training graph's calls run train_step, and compiling the forward pass
    # a second time on its own made the CNN's training graph compile 1 s longer.
    mod = finish_module(bb.get(), updates, [FUNC_NAME])
    return mod, TrainStepLayout(tuple(grad_indices), tuple(updates.state_shapes), len(plan.groups),
                                loss_scaling=scaling)


def differentiate_main(mod: tvm.IRModule, plan: TrainingPlan, grad_indices: list[int], loss_index: int,
                       report: Callable[[str], None] | None, graph: str, origins: Mapping[str, str] | None,
                       loss_divisor: int = 1, checkpoint_regions: Sequence[Collection[str]] = (),
                       scaling: bool = False) -> tvm.IRModule:
    """`mod` plus `main_adjoint`, the gradients of `loss / loss_divisor` (after the checks,
    CheckpointModules and RecomputeAttention that every training program gets); with `scaling`,
    of the loss times a new last parameter `loss_scale` (loss_scale.py)."""
    from relay_passes.checkpoint_modules import CheckpointModules  # relay_passes import tvmgraph
    from relay_passes.recompute_attention import RecomputeAttention

    from ..pipeline import run_pass

    # Checked always (one check of the forward program): a broken result would fail in autodiff.
    # Module checkpointing first: it finds its bindings by the names the importer gave them.
    mod = run_pass(CheckpointModules(checkpoint_regions, report), mod, graph, check=True)
    mod = run_pass(RecomputeAttention(plan.recompute_attention, report), mod, graph, check=True)
    check_gradients(mod["main"], loss_index, origins or {}, graph)
    symbolic = symbolic_shapes.is_symbolic(mod["main"])  # a dynamic batch (symbolic_shapes.py)
    mod, lifted = symbolic_shapes.lift_shapes(mod) if symbolic else (mod, [])
    mod = _differentiate(mod, grad_indices, loss_index, graph, loss_divisor, scaling)
    return symbolic_shapes.bind_shapes(mod, lifted) if symbolic else mod


@dataclass
class GroupUpdates:
    """The update functions, state and hyperparameter variables of a plan (`declare_updates`)."""

    plan: TrainingPlan
    update_gvs: list[relax.GlobalVar]
    state_vars: list[relax.Var]
    state_shapes: list[tuple[str, str, tuple[int, ...], str]]
    hyper_vars: list[relax.Var]

    def emit(self, bb: relax.BlockBuilder, params: list[relax.Expr], grads: list[relax.Expr],
             found: dict[int | str, relax.Expr] | None = None) -> tuple[list[relax.Expr], list[relax.Expr]]:
        """Clip each group's gradients when configured, then call its update: new params, new
        states. `found` (loss scaling, unscale_per_optimizer): each optimizer's overflow flag,
        which keeps the old values, and the reciprocal of the scale."""
        new_params, new_states = [], []
        cursor, state_cursor = 0, 0
        for group, hyper, update_gv in zip(self.plan.groups, self.hyper_vars, self.update_gvs):
            n, keys = len(group.targets), group.state_keys
            group_grads = grads[cursor:cursor + n]
            # Loss scaling: the update unscales the gradients (clipping needs them unscaled
            # first), and an overflow skips the step: the update keeps every old value.
            unscale = found["unscale"] if found is not None else None
            if unscale is not None and group.clip is not None and n:
                group_grads = [loss_scale.unscaled(bb, g, unscale) for g in group_grads]
                unscale = relax.const(1.0, "float32")
            if group.clip is not None and n:
                group_grads = _clip(bb, group_grads, *group.clip)
            args = [hyper, *([found[id(group.optimizer)], unscale] if found is not None else [])]
            for k in range(n):
                states = self.state_vars[state_cursor:state_cursor + len(keys)]
                args += [params[cursor + k], group_grads[k], *states]
                state_cursor += len(keys)
            updated = bb.emit(relax.Call(update_gv, args))
            results = [bb.emit(relax.TupleGetItem(updated, i)) for i in range(n * (len(keys) + 1))]
            for k in range(n):
                base = k * (len(keys) + 1)
                new_states += results[base:base + len(keys)]
                new_params.append(results[base + len(keys)])
            cursor += n
        return new_params, new_states


def declare_updates(bb: relax.BlockBuilder, plan: TrainingPlan, param_types: list[relax.TensorType]) -> GroupUpdates:
    """Add one update function per param group to `bb`'s module; `param_types` in plan order."""
    state_vars, state_shapes, update_gvs = [], [], []
    cursor = 0
    for index, group in enumerate(plan.groups):
        types = param_types[cursor:cursor + len(group.targets)]
        cursor += len(group.targets)
        name = f"update_{index}_{group.rule.name}"
        update_gvs.append(bb.add_func(update_function(group.rule, group.flags, types, name, plan.loss_scaling), name))
        for target, ty in zip(group.targets, types):
            for key in group.state_keys:
                state_ty = state_type(group.rule, key, ty)
                shape, dtype = tuple(int(d) for d in state_ty.shape.values), state_ty.dtype.dtype
                state_vars.append(relax.Var(f"{target.replace('.', '_')}__{key}", relax.TensorType(shape, dtype)))
                state_shapes.append((target, key, shape, dtype))
    hyper_vars = [relax.Var(f"hyper_{i}", relax.TensorType((g.rule.hyper_length(len(g.targets)),), SCALAR_DTYPE))
                  for i, g in enumerate(plan.groups)]
    return GroupUpdates(plan, update_gvs, state_vars, state_shapes, hyper_vars)


def finish_module(mod: tvm.IRModule, updates: GroupUpdates, entries: list[str]) -> tvm.IRModule:
    """Drop `main`, inline the adjoint into `entries` (so that the update can fuse with the
    backward pass), drop what is unused, and make the update functions private."""
    del mod["main"]
    mod["main_adjoint"] = mod["main_adjoint"].without_attr("global_symbol")
    mod = tvm.transform.Sequential([
        relax.transform.InlinePrivateFunctions(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.DeadCodeElimination(entries),
    ])(mod)
    for name in entries:  # a dynamic batch: one symbolic variable per dim (symbolic_shapes.py)
        if symbolic_shapes.is_symbolic(mod[name]):
            mod[name] = symbolic_shapes.unify_symbolic_vars(mod[name])
    for gv in updates.update_gvs:  # the pipeline fuses them (FuseModelUpdate) or inlines them
        mod[gv] = mod[gv].without_attr("global_symbol")
    return mod


def unscale_per_optimizer(bb: relax.BlockBuilder, plan: TrainingPlan, grads: list[relax.Expr],
             scale: relax.Var) -> dict[int | str, relax.Expr]:
    """Each optimizer's overflow flag of the scaled `grads` (by `id`), under "any" the flag of
    the whole step, which updates the scale, and under "unscale" 1 / scale, which the updates
    multiply the gradients by (GroupUpdates.emit)."""
    by_optimizer: dict[int, list[int]] = {}
    cursor = 0
    for group in plan.groups:
        by_optimizer.setdefault(id(group.optimizer), []).extend(range(cursor, cursor + len(group.targets)))
        cursor += len(group.targets)
    found: dict[int | str, relax.Expr] = {}
    for key, indices in by_optimizer.items():
        found[key] = loss_scale.overflow(bb, [grads[i] for i in indices])
    flags = list(found.values())
    found["any"] = flags[0] if len(flags) == 1 else bb.emit(relax.op.max(relax.op.stack(flags)))
    found["unscale"] = loss_scale.reciprocal(bb, scale)
    return found


# The NotImplementedError messages of tvmgraph/gradients: a configuration they do not cover.
_NOT_COVERED = re.compile(r"gradient of relax\.[\w.]+ .*|(relax\.[\w.]+: )?tvmgraph\.gradients need static shapes.*")


def _differentiate(mod: tvm.IRModule, grad_indices: list[int], loss_index: int, graph: str,
                   loss_divisor: int = 1, scaling: bool = False) -> tvm.IRModule:
    """`main_adjoint` added to `mod`: `Gradient` of the loss (over `loss_divisor`) w.r.t. the
    parameters at `grad_indices`; with `scaling`, of the loss times a new last parameter
    `loss_scale` (loss_scale.py), divided by `loss_divisor` first.

    `Gradient` takes float16/32/64 targets only: a bfloat16 loss is differentiated through an
    extra float32 output (a cast, exact), which the train step does not return; so is the loss
    over a `loss_divisor` other than 1 (gradient accumulation's n). Gradients that
    tvmgraph cannot compute become UnsupportedOpError: a configuration a registered gradient does
    not cover (its NotImplementedError), and shapes that depend on data (`match_cast`, from
    `nonzero` or boolean masks), which `Gradient` rejects ("Check failed: (var_binding)").
    """
    main = mod["main"]
    for i in grad_indices:  # Gradient checks float16/32/64 only and fails with an internal error
        if main.params[i].ty.dtype.dtype == "bfloat16":
            raise UnsupportedOpError(
                f"{graph}: parameter {main.params[i].name.removeprefix('p_')} is bfloat16, and TVM "
                "0.27's autodiff differentiates float16/32/64 parameters only. Keep the parameters in "
                "float32 and train in bfloat16 with graph.config.enable_amp(True, dtype=torch.bfloat16) "
                "(float32 master weights, as torch.autocast does).")
    loss = main.body.body.fields[loss_index]
    target_index = loss_index
    dtype = loss.ty.dtype.dtype
    if scaling:
        main, target_index = loss_scale.with_scaled_loss(main, loss_index, loss_divisor)
        mod = mod.clone()
        mod["main"] = main
    elif dtype not in ("float16", "float32", "float64") or loss_divisor != 1:
        target_dtype = dtype if dtype in ("float16", "float32", "float64") else "float32"
        cast = relax.Var("loss_target", relax.TensorType((), target_dtype))
        value = relax.op.astype(loss, target_dtype) if target_dtype != dtype else loss
        if loss_divisor != 1:  # as eager's (loss / n).backward()
            value = relax.op.divide(value, relax.const(loss_divisor, target_dtype))
        blocks = list(main.body.blocks)
        bindings = [*blocks[-1].bindings, relax.VarBinding(cast, value)]
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
                    f"static batch (the option off; a smaller last batch then compiles once more); MLPs, "
                    f"CNNs and transformers train with a dynamic batch (docs/training.md, \"Dynamic batch\").") from e
            raise
        raise UnsupportedOpError(f"{graph}: build() computes a shape from tensor values (nonzero, boolean masks, "
                                 f"torch.combinations) on the way to the loss; tvmgraph cannot differentiate "
                                 f"through it. Keep the shapes fixed and mask the values instead: "
                                 f"`F.cross_entropy(out[m], y[m])` -> `F.cross_entropy(out, y.masked_fill(~m, "
                                 f"-100))` (its ignore_index), `(loss * m).sum() / m.sum()` for a masked mean, "
                                 f"`h[m] = f(h[m])` -> `h = torch.where(m, f(h), h)`; or compute that part "
                                 f"outside the graph.") from None


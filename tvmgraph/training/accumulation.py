"""Gradient accumulation (`GraphConfig.set_gradient_accumulation_steps(n)`): one call, n micro-batches.

A call takes the full batch; every argument with a dimension is split on dim 0 into n equal
micro-batches (zero-copy views; a 0-d argument goes whole to each). The program is compiled for
one micro-batch as two Relax functions in one module:

    @R.function
    def accumulate_grads(inputs..., params..., buffers..., constants..., accs...):
        (outs, grads) = main_adjoint(...)         # inlined; the gradients of loss / n
        return (mutations..., outputs..., loss, accs + grads...)

    @R.function
    def apply_update(trained_params..., grads..., states..., hypers...):
        grads = clip(grads)                       # per group, when configured
        upd_0 = update_0(hyper_0, p, g, states..., ...)   # as in train_step.py
        return (new_params..., new_states...)

The runtime calls `accumulate_grads` once per micro-batch, one after another, so only one
micro-batch's activations are alive at a time (peak memory close to a call with the micro-batch
alone, not n inlined copies of the forward and backward pass held at once), then `apply_update`
once. This is eager accumulation exactly: each micro-batch loss divided by n (the backward seed
is 1/n, as `(loss / n).backward()`), the gradients summed, clipping on the sum, one optimizer
step. Buffer mutations (batch norm running stats) are written back after each micro-batch, so
the next one sees them, as in eager. The update functions are the ones of train_step.py, so
FuseModelUpdate still makes them in-place kernels. With n == 1 none of this runs: the graph
compiles the single `train_step` function.

What a call returns (OneFlow documents only "Set num of steps to accumulate gradient"; these
are tvmgraph's choices, the natural reading of one call covering the full batch):
- the loss: the mean of the n micro-batch losses (for a mean-reduced loss, the full batch's loss);
- an output with a dimension: the n micro-batch outputs concatenated on dim 0;
- any other 0-d output: the mean over micro-batches (floating point), the sum (integers, bool:
  counts add up).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import tvm
from tvm import relax

from ..errors import ConfigError, MicroBatchError
from ..inputs import runnable_all
from ..vm_results import releasing
from .plan import TrainingPlan
from . import loss_scale
from .train_step import TrainStepLayout, declare_updates, differentiate_main, finish_module, \
    unscale_per_optimizer

if TYPE_CHECKING:
    from ..stages import CompiledGraph

MICRO_STEP = "accumulate_grads"
APPLY_UPDATE = "apply_update"


def first_micro_batch(graph: str, paths: Sequence[str], flat: Sequence[torch.Tensor], steps: int,
                      training: bool) -> list[torch.Tensor]:
    """The first micro-batch of `flat` (what the program is traced and compiled for), after
    checking that accumulation applies: a training graph, and every batched argument divisible."""
    if not training:
        raise ConfigError(f"{graph}: set_gradient_accumulation_steps({steps}) is set but the graph has no "
                          f"optimizer; gradient accumulation applies to training graphs only. Leave it at 1 "
                          f"for this graph, or add_optimizer() in __init__.")
    check_micro_batches(graph, lambda: list(paths), flat, steps)
    return [t.narrow(0, 0, t.shape[0] // steps) if t.dim() else t for t in flat]


def check_micro_batches(graph: str, paths: Callable[[], list[str]], flat: Sequence[torch.Tensor], steps: int) -> None:
    """MicroBatchError unless every batched argument splits into `steps` equal micro-batches;
    `paths()` names the arguments. Checked at every call of a dynamic batch's program too: it
    took a later batch of 10 in 4 micro-batches of 2 and trained on 8 rows, silently."""
    for i, t in enumerate(flat):
        if t.dim() and t.shape[0] % steps:
            fits = [d for d in range(1, t.shape[0] + 1) if t.shape[0] % d == 0 and d > 1]
            raise MicroBatchError(
                f"{graph}: argument '{paths()[i]}' has {t.shape[0]} rows on dim 0, which gradient accumulation "
                f"cannot split into {steps} equal micro-batches (every argument with a dimension is split on "
                f"dim 0). Pass a batch that is a multiple of {steps} (drop or pad the last batch: "
                f"DataLoader(drop_last=True)), or set_gradient_accumulation_steps(n) with n dividing "
                f"{t.shape[0]} ({', '.join(map(str, fits[:6])) or 'none above 1'}).")


def micro_batches(flat: Sequence[torch.Tensor], steps: int) -> list[list[torch.Tensor]]:
    """`flat` split on dim 0 into `steps` views (0-d tensors are repeated)."""
    return [[t.narrow(0, k * (t.shape[0] // steps), t.shape[0] // steps) if t.dim() else t for t in flat]
            for k in range(steps)]


def append_accumulation(mod: tvm.IRModule, plan: TrainingPlan, grad_indices: list[int], loss_index: int,
                        steps: int, report: Callable[[str], None] | None = None, graph: str = "graph",
                        origins: Mapping[str, str] | None = None,
                        checkpoint_regions: Sequence[Collection[str]] = (), ranks: int = 1,
                        update_plan: TrainingPlan | None = None, input_grads: Sequence[int] = (),
                        pipelined: bool = False) -> tuple[tvm.IRModule, TrainStepLayout]:
    """Replace `main` with `accumulate_grads` and `apply_update` (the module docstring).

    Data parallel (data_parallel.py): the loss is also divided by the number of `ranks` (their
    gradients are summed between the two functions), and under ZeRO `apply_update` updates the
    parameters of `update_plan` only, this rank's share of `plan`'s. A pipeline stage
    (`pipelined`, pipeline_parallel.py): `accumulate_grads` also returns, last, the gradients of
    the main parameters at `input_grads` (the activations the stage received)."""
    main = mod["main"]
    num_outputs = len(main.ret_ty.fields)
    scaling = plan.loss_scaling
    mod = differentiate_main(mod, plan, [*grad_indices, *input_grads], loss_index, report, graph, origins,
                             loss_divisor=steps * ranks, checkpoint_regions=checkpoint_regions, scaling=scaling)
    adjoint_gv = mod.get_global_var("main_adjoint")

    bb = relax.BlockBuilder(mod)
    types = [main.params[i].ty for i in grad_indices]
    names = [main.params[i].name for i in grad_indices]
    accs = [relax.Var(f"{name}__acc", ty) for name, ty in zip(names, types)]
    if update_plan is not None:
        owned = update_positions(plan, update_plan)
        types, names = [types[i] for i in owned], [names[i] for i in owned]
    updates = declare_updates(bb, update_plan or plan, types)
    inputs = [relax.Var(v.name, v.ty) for v in main.params]
    scaler = loss_scale.scaler_vars() if scaling else ()
    with bb.function(MICRO_STEP, inputs + accs + list(scaler[:1])):
        with bb.dataflow():
            ret = bb.emit(relax.Call(adjoint_gv, inputs + list(scaler[:1])))
            outs = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 0), i)) for i in range(num_outputs)]
            sums = [bb.emit(relax.op.add(acc, relax.TupleGetItem(relax.TupleGetItem(ret, 1), j)))
                    for j, acc in enumerate(accs)]
            received = [bb.emit(relax.TupleGetItem(relax.TupleGetItem(ret, 1), len(accs) + j))
                        for j in range(len(input_grads))]
            result = bb.emit_output(relax.Tuple(outs + sums + received))
        bb.emit_func_output(result)

    params = [relax.Var(name, ty) for name, ty in zip(names, types)]
    grads = [relax.Var(f"{name}__grad", ty) for name, ty in zip(names, types)]
    scaler = loss_scale.scaler_vars() if scaling else ()
    with bb.function(APPLY_UPDATE, params + grads + updates.state_vars + updates.hyper_vars + list(scaler)):
        with bb.dataflow():
            found = None
            if scaling:  # the accumulated (and summed over ranks) gradients of the scaled loss
                grads = list(grads)
                found = unscale_per_optimizer(bb, update_plan or plan, grads, scaler[0])
            new_params, new_states = updates.emit(bb, params, grads, found)
            scaler_out = list(loss_scale.update_scale(bb, scaler[0], scaler[1], found["any"], scaler[2])) \
                if found is not None else []
            result = bb.emit_output(relax.Tuple(new_params + new_states + scaler_out))
        bb.emit_func_output(result)
    mod = finish_module(bb.get(), updates, [MICRO_STEP, APPLY_UPDATE])
    return mod, TrainStepLayout(tuple(grad_indices), tuple(updates.state_shapes), len((update_plan or plan).groups),
                                accumulation_steps=steps, ranks=ranks, pipelined=pipelined,
                                input_grads=tuple(input_grads), loss_scaling=scaling)


def update_positions(plan: TrainingPlan, update_plan: TrainingPlan) -> list[int]:
    """Where each parameter of `update_plan` (a ZeRO share) is among `plan`'s trained parameters."""
    index = {id(p): i for i, p in enumerate(p for g in plan.groups for p in g.params)}
    return [index[id(p)] for g in update_plan.groups for p in g.params]


class Accumulation:
    """Runs one call of a compiled entry as its micro-batches, then the update; in a data-parallel
    graph the gradients are summed over the ranks in between (data_parallel.py)."""

    __slots__ = ("steps", "apply_update", "positions")

    def __init__(self, vm: relax.VirtualMachine, steps: int, positions: list[int] | None = None):
        self.steps = steps
        self.apply_update = releasing(vm, APPLY_UPDATE)
        self.positions = positions  # ZeRO: this rank's parameters among all trained ones

    def run(self, compiled: CompiledGraph, flat_inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        trained = [p for g in compiled.plan.groups for p in g.params]
        grads = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in trained]
        outputs, losses = [], []
        scale = compiled.training.scale_input()
        for micro in micro_batches(flat_inputs, self.steps):
            user, loss, grads, _ = compiled.run_entry(micro, [*grads, *scale])
            outputs.append(user)
            losses.append(loss)
        parallel = compiled.data_parallel
        if parallel is not None:
            parallel.reduce_gradients(grads, compiled.traced.signature.options.zero_stage)
        if self.positions is not None:
            grads = [grads[i] for i in self.positions]
        self.update(compiled, grads)
        if parallel is not None:
            parallel.after_update(trained, zero=self.positions is not None)
        return [combine(parts) for parts in zip(*outputs)], torch.stack(losses).mean()

    def update(self, compiled: CompiledGraph, grads: Sequence[torch.Tensor]) -> None:
        """Run `apply_update` on the summed `grads` of the parameters the entry updates."""
        training = compiled.training
        params = [p for g in training.plan.groups for p in g.params]
        extra = training.inputs()
        passed, copied = runnable_all(params, thorough=False)
        passed_extra, _ = runnable_all(extra, thorough=False)
        results = self.apply_update(*passed, *grads, *passed_extra)
        training.write_back(results, {id(params[i]) for i in copied})


def combine(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """One output of the call from its micro-batch values (the module docstring)."""
    if parts[0].dim():
        return torch.cat(parts)
    stacked = torch.stack(parts)
    return stacked.mean() if stacked.is_floating_point() or stacked.is_complex() else stacked.sum()

"""Dynamic loss scaling inside the compiled train step (`Graph.set_grad_scaler`).

What `torch.amp.GradScaler` does around an eager step, as Relax ops of `train_step`:

    main(inputs..., loss_scale)  also returns  astype(loss, float32) * loss_scale   # differentiated
    found_inf[opt] = any(!isfinite(scaled grads of opt))    # per optimizer, as scaler.step(opt)
    update_0(hyper, found_inf[opt], float32(1 / float64(loss_scale)), p, g, state...)  # per group
        # unscales g as it reads it (a clipped group's grads are unscaled before the clip),
        # and where found_inf[opt] keeps every old value: a skipped step changes nothing
    scale, tracker = update(scale, tracker, any(found_inf), [growth, backoff, interval])

`update` is `torch._amp_update_scale_`: on an overflow the scale backs off and the tracker
resets; after `growth_interval` clean steps in a row the scale grows (if the grown scale is
finite) and the tracker resets. The scale, the tracker and the three factors are runtime
inputs: changing them never recompiles. The update's `skip` and `unscale` inputs
(train_step.update_function) let FuseModelUpdate keep it one in-place kernel per group.
"""

from __future__ import annotations

from tvm import relax

from .update_ops import SCALAR_DTYPE

SCALE_DTYPE, TRACKER_DTYPE = "float32", "int32"  # of GradScaler._scale and _growth_tracker
NUM_HYPERS = 3  # growth_factor, backoff_factor, growth_interval


def scaler_vars() -> tuple[relax.Var, relax.Var, relax.Var]:
    """The train step's extra inputs: scale, growth tracker, [growth, backoff, interval]."""
    return (relax.Var("loss_scale", relax.TensorType((), SCALE_DTYPE)),
            relax.Var("growth_tracker", relax.TensorType((), TRACKER_DTYPE)),
            relax.Var("scaler_hyper", relax.TensorType((NUM_HYPERS,), SCALAR_DTYPE)))


def with_scaled_loss(main: relax.Function, loss_index: int, divisor: int = 1) -> tuple[relax.Function, int]:
    """`main` with a `loss_scale` parameter (last) and `astype(loss, float32) / divisor *
    loss_scale` as an extra last output (eager's `scaler.scale(loss / n).backward()` under
    gradient accumulation); returns the new function and that output's index."""
    scale = relax.Var("loss_scale", relax.TensorType((), SCALE_DTYPE))
    loss = main.body.body.fields[loss_index]
    scaled = relax.Var("scaled_loss", relax.TensorType((), SCALE_DTYPE))  # returned: not a DataflowVar
    blocks = list(main.body.blocks)
    value = relax.op.astype(loss, SCALE_DTYPE)
    if divisor != 1:
        value = relax.op.divide(value, relax.const(divisor, SCALE_DTYPE))
    value = relax.op.multiply(value, scale)
    blocks[-1] = type(blocks[-1])([*blocks[-1].bindings, relax.VarBinding(scaled, value)])
    fields = [*main.body.body.fields, scaled]
    body = relax.SeqExpr(blocks, relax.Tuple(fields))
    new = relax.Function([*main.params, scale], body, relax.TupleType([f.ty for f in fields]), attrs=main.attrs)
    return new, len(fields) - 1


def reciprocal(bb: relax.BlockBuilder, scale: relax.Expr) -> relax.Expr:
    """1 / scale as float32 (computed in float64, as torch does): what unscales a gradient."""
    op = relax.op
    return bb.emit(op.astype(op.divide(relax.const(1.0, "float64"), op.astype(scale, "float64")), SCALE_DTYPE))


def unscaled(bb: relax.BlockBuilder, grad: relax.Expr, inv: relax.Expr) -> relax.Expr:
    """`grad` times the reciprocal of the scale, in the gradient's dtype."""
    return bb.emit(relax.op.multiply(grad, relax.op.astype(inv, grad.ty.dtype.dtype)))


def overflow(bb: relax.BlockBuilder, grads: list[relax.Expr]) -> relax.Expr:
    """A float32 0/1 flag: 1 when any scaled grad is inf or NaN."""
    op = relax.op
    # An int32 max: a float max is NaN-propagating (tvmgraph.PropagateNaN), 5x slower per element.
    flags = [op.astype(op.max(op.astype(op.logical_not(op.isfinite(g)), "int32")), "float32") for g in grads]
    found = flags[0]
    for flag in flags[1:]:
        found = op.maximum(found, flag)
    return bb.emit(found)


def keep_if_found(bb: relax.BlockBuilder, found: relax.Expr, old: relax.Expr, new: relax.Expr) -> relax.Expr:
    """`old` where the step overflowed, else `new`."""
    return bb.emit(relax.op.where(relax.op.greater(found, relax.const(0.0, "float32")), old, new))


def update_scale(bb: relax.BlockBuilder, scale: relax.Expr, tracker: relax.Expr, found: relax.Expr,
                 hyper: relax.Expr) -> tuple[relax.Expr, relax.Expr]:
    """torch._amp_update_scale_ (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp)."""
    op = relax.op

    def h(i: int) -> relax.Expr:
        return op.take(hyper, relax.const(i, "int64"), axis=0, mode="clip")

    overflow = bb.emit(op.greater(found, relax.const(0.0, "float32")))
    wide = op.astype(scale, SCALAR_DTYPE)
    backed_off = op.astype(op.multiply(wide, h(1)), SCALE_DTYPE)
    grown = bb.emit(op.astype(op.multiply(wide, h(0)), SCALE_DTYPE))
    successful = bb.emit(op.add(tracker, relax.const(1, TRACKER_DTYPE)))
    due = bb.emit(op.equal(op.astype(successful, SCALAR_DTYPE), h(2)))
    clean = op.where(op.logical_and(due, op.isfinite(grown)), grown, scale)
    new_scale = bb.emit(op.where(overflow, backed_off, clean))
    zero = relax.const(0, TRACKER_DTYPE)
    new_tracker = bb.emit(op.where(overflow, zero, op.where(due, zero, successful)))
    return new_scale, new_tracker

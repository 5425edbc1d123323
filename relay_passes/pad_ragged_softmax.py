"""PadRaggedSoftmax: a softmax over rows that no vector divides runs over rows padded with -inf.

A ViT's attention has 65 tokens (64 patches and a class token); ViT-B/16 197, CLIP's text 77.
The CPU schedules vectorize a row's max and sum only when a vector divides the row
(schedules/reduction.py: TVM's rfactor of a ragged split drops its bounds test), so those ran
one float at a time, two dependent chains of 65 operations per row. This pass replaces

    softmax(x, axis=-1)          (last extent E, E % lanes != 0, E > 2 * lanes; log_softmax too)

by one kernel (`call_tir` of topi's pad, softmax and strided_slice) that copies each row into
whole vectors padded with -inf, takes the softmax of those, and stores the first E. Exact:
exp(-inf - max) is 0, so the padded elements add nothing to a row's sum and change no max; a row
of -inf alone (a fully masked one) gives NaN either way. One kernel, because a Relax `pad` of
its own is a kernel FuseOps does not fuse into the softmax, and its copy cost more than the
vectorized sums saved (ViT: 0.21 ms per pad against 0.18 saved).

Position: after autodiff (the kernel has no gradient), before LegalizeOps, on CPU targets; the
lanes are the current target's (float32).
Limits: the last axis only, static extents; the softmax gradient's sum (training) keeps its
ragged rows.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, te, topi
from tvm.relax.expr_functor import mutator

from relay_passes import rewrite_on_cpu
from relay_passes.rebind import BoundRewriter

_SOFTMAX = frozenset({"relax.nn.softmax", "relax.nn.log_softmax"})


def padded_extent(extent: int, lanes: int) -> int | None:
    """The row length to pad a softmax's rows of `extent` to, or None to leave them: whole
    vectors, for rows of more than two vectors that no vector divides."""
    if extent <= 2 * lanes or extent % lanes == 0:
        return None
    return -(-extent // lanes) * lanes


@mutator
class _Padder(BoundRewriter):
    def __init__(self, mod: tvm.IRModule, lanes: int) -> None:
        super().__init__(mod)
        self.lanes = lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or call.op.name not in _SOFTMAX:
            return call
        x = call.args[0]
        shape = getattr(x.ty, "shape", None)
        if shape is None or not shape or not isinstance(shape[-1], tvm.tirx.IntImm):
            return call
        rank = len(shape)
        if int(call.attrs.axis) not in (-1, rank - 1):
            return call
        extent = int(shape[-1])
        padded = padded_extent(extent, self.lanes)
        if padded is None:
            return call
        name = call.op.name.split(".")[-1]
        self.counts[f"{name} rows of {extent} -> {padded}"] += 1
        return self.builder_.call_te(_padded_softmax, x, padded, name == "log_softmax",
                                     primfunc_name_hint=f"{name}_padded")


def padded_rows(x: te.Tensor, padded: int) -> te.Tensor:
    """`x` with its last axis padded to `padded` with -inf (`x` itself when it has that length)."""
    rank, extent = len(x.shape), int(x.shape[-1])
    if padded == extent:
        return x
    return topi.nn.pad(x, [0] * rank, [0] * (rank - 1) + [padded - extent],
                       pad_value=tvm.tirx.const(float("-inf"), x.dtype))


def _padded_softmax(x: te.Tensor, padded: int, log: bool) -> te.Tensor:
    """(log_)softmax over the last axis of `x`, computed on rows padded to `padded` with -inf."""
    rows = padded_rows(x, padded)
    out = topi.nn.log_softmax(rows, axis=-1) if log else topi.nn.softmax(rows, axis=-1)
    return topi.strided_slice(out, [0] * len(x.shape), list(x.shape), [1] * len(x.shape))  # (rows may be symbolic)


@tvm.transform.module_pass(opt_level=0, name="PadRaggedSoftmax")
class PadRaggedSoftmax:
    """Pad the rows of softmax and log_softmax that no vector divides with -inf (CPU only)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.report = report or (lambda msg: None)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_on_cpu(mod, "PadRaggedSoftmax", self.report, lambda cpu: _Padder(mod, cpu.lanes("float32")))

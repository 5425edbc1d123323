"""Dropout in a compiled graph: a mask from the counter-based generator (counter_rng.py).

Each train-mode dropout computes its mask inside the program from the seed input, so a mask is
fresh at every call (`torch.manual_seed` makes graph training reproducible). Forward and
backward are one TE kernel each (`call_tir_with_grad`): the backward recomputes the mask from
the seed instead of keeping it, so no mask tensor lives between the two passes.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx as tir

from .counter_rng import bits, fmix32_reference, linear_index, op_key, op_key_reference, u32

_BITS = 24  # uniform resolution: keep if hash >> 8 < keep_prob * 2**24


def keep_threshold(p: float) -> int:
    return int(round((1.0 - p) * (1 << _BITS)))


def _mask_value(seed: te.Tensor, shape: Sequence[tir.PrimExpr], p: float, salt: int, dtype: str):
    """A function of an element index: 1 / (1 - p) where the element is kept, else 0. `shape`
    may be symbolic (a dynamic batch: its int() failed to compile a train-mode dropout)."""
    key = op_key(seed, salt)
    threshold = u32(keep_threshold(p))
    scale = tir.const(1.0 / (1.0 - p), dtype)
    zero = tir.const(0.0, dtype)

    def value(*index: tir.Var) -> tir.PrimExpr:
        h = bits(key, linear_index(shape, index))
        return tir.Select((h >> u32(32 - _BITS)) < threshold, scale, zero)

    return value


def dropout_apply(x: te.Tensor, seed: te.Tensor, p: float, salt: int) -> te.Tensor:
    """Forward: `x * mask`; `seed` is int64[2]."""
    mask = _mask_value(seed, x.shape, p, salt, x.dtype)
    return te.compute(x.shape, lambda *i: x(*i) * mask(*i), name="dropout")


def dropout_grad(grad: te.Tensor, x: te.Tensor, seed: te.Tensor, p: float, salt: int) -> list[te.Tensor]:
    """Backward: `grad * mask` for x (the same mask, recomputed); zeros for the seed."""
    mask = _mask_value(seed, x.shape, p, salt, x.dtype)
    grad_x = te.compute(x.shape, lambda *i: grad(*i) * mask(*i), name="dropout_grad")
    grad_seed = te.compute(seed.shape, lambda *i: tir.const(0, seed.dtype), name="dropout_seed_grad")
    return [grad_x, grad_seed]


def dropout_keep(x: te.Tensor, seed: te.Tensor, p: float, salt: int) -> te.Tensor:
    """The boolean keep mask (aten's second output of native_dropout)."""
    mask = _mask_value(seed, x.shape, p, salt, x.dtype)
    return te.compute(x.shape, lambda *i: mask(*i) != tir.const(0, x.dtype), name="dropout_keep")


GRAD_NAME = "tvmgraph.dropout_grad"


def dropout_mask_reference(seed: tuple[int, int], numel: int, p: float, salt: int) -> list[bool]:
    """Which elements `dropout_mask` keeps, computed in Python (for tests)."""
    key = op_key_reference(seed, salt)
    threshold = keep_threshold(p)
    return [(fmix32_reference(i ^ key) >> (32 - _BITS)) < threshold for i in range(numel)]


def register() -> None:
    """Register `dropout_grad` under GRAD_NAME for `call_tir_with_grad` (idempotent)."""
    from tvm.relax.training.utils import register_te_gradient
    import tvm

    if tvm.get_global_func("tvm.relax.te_grad._register." + GRAD_NAME, allow_missing=True) is None:
        register_te_gradient(GRAD_NAME, dropout_grad)

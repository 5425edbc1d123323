"""A counter-based random number generator for compiled graphs: a hash of (seed, op salt, stream,
element index).

Every random op of a program (dropout, `torch.rand`, `randn_like`, `bernoulli`, ...) reads the
same int64[2] seed input, which the runtime draws from torch's default generator at each call
(`torch.manual_seed` makes a graph reproducible), and hashes it with its own salt (its place
in the program), so two ops never share numbers and no op repeats them between calls. An
element's numbers depend on its index alone: any schedule, and a recomputation (the dropout
backward pass), gives the same ones.

The hash is murmur3's 32-bit finalizer. Values are combined with XOR only: TVM's integer
simplifier does not respect uint32 wrap-around for additions with large constants.
"""

from __future__ import annotations

from collections.abc import Sequence

from tvm import te, tirx as tir

_GOLDEN = 0x9E3779B9
_STREAM = 0x632BE5AB  # another odd constant, for the streams of one op (Box-Muller's second uniform)


def u32(value: int) -> tir.PrimExpr:
    return tir.const(value & 0xFFFFFFFF, "uint32")


def fmix32(h: tir.PrimExpr) -> tir.PrimExpr:
    """murmur3 finalizer: a bijection on uint32 with full avalanche."""
    h = h ^ (h >> u32(16))
    h = h * u32(0x85EBCA6B)
    h = h ^ (h >> u32(13))
    h = h * u32(0xC2B2AE35)
    return h ^ (h >> u32(16))


def fmix32_reference(h: int) -> int:
    """The same function in Python, for tests."""
    mask = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def op_key(seed: te.Tensor, salt: int, stream: int = 0) -> tir.PrimExpr:
    """The uint32 key of one op's stream of numbers; stream 0 is dropout's mask."""
    key = fmix32(tir.Cast("uint32", seed[0]) ^ fmix32(tir.Cast("uint32", seed[1]) ^ u32(salt * _GOLDEN)))
    return key if stream == 0 else fmix32(key ^ u32(stream * _STREAM))


def op_key_reference(seed: tuple[int, int], salt: int, stream: int = 0) -> int:
    """`op_key` in Python, for tests."""
    mask = 0xFFFFFFFF
    key = fmix32_reference((seed[0] & mask) ^ fmix32_reference((seed[1] & mask) ^ ((salt * _GOLDEN) & mask)))
    return key if stream == 0 else fmix32_reference(key ^ ((stream * _STREAM) & mask))


def linear_index(shape: Sequence[tir.PrimExpr], index: Sequence[tir.Var]) -> tir.PrimExpr:
    """Row-major position of `index` in `shape` (shapes may be symbolic)."""
    if not index:
        return tir.const(0, "int64")
    linear = index[0]
    for extent, i in zip(shape[1:], index[1:]):
        linear = linear * extent + i
    return linear


def bits(key: tir.PrimExpr, linear: tir.PrimExpr) -> tir.PrimExpr:
    """32 random bits (uint32) for the element at `linear` under `key`."""
    return fmix32(tir.Cast("uint32", linear) ^ key)

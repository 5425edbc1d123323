"""What a compiled kernel assumes of a tensor argument's memory, and the copies that make any
tensor fit.

TVM hands every tensor argument to a kernel as a bare pointer with two promises:

- compact row-major strides. A kernel built with its argument checks (tirx
  `ArgBinder::BindDLTensor`: saved programs, `TVMGRAPH_KERNEL_CHECKS=1`) rejects other strides
  with "expected to be compact array" (a ValueError); the kernels a graph runs have no checks
  (codegen.build_executable) and would read such a tensor wrongly;
- a data pointer aligned to the buffer's `data_alignment`, 64 bytes by default
  (`kAllocAlignment`). Nothing checks it: the binder marks the pointer with
  `storage_alignment`, LLVM turns that into an alignment assumption, and the vector loads
  it picks (`vmovaps` and friends) fault on a pointer that breaks it: SIGSEGV.

torch allocates 64-byte aligned storage, but a view starting inside it (`y[i:i + 64]` of an
int64 tensor, `x[1:41]`) keeps torch's `is_contiguous()` and points anywhere. `runnable(t)`
returns `t` itself when it already fits (the common, zero-copy case) and a compact, aligned
copy otherwise: misaligned views, transposes, expanded (stride-0) and channels_last tensors,
and tensors whose negation or conjugation is a lazy bit (`_neg_view`, `.conj()`), which a raw
pointer would silently drop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The largest `data_alignment` of a kernel buffer (TVM's kAllocAlignment); tests check that no
# compiled kernel asks for more (tests/numeric/test_input_layouts.py).
ALIGNMENT = 64


def fits(t: torch.Tensor) -> bool:
    """True when a kernel can read `t` in place: compact, aligned, no lazy neg/conj bit, not empty.

    An empty tensor is copied (for free) because torch calls any strides of it contiguous and
    TVM's stride check does not.
    """
    return (t.is_contiguous() and not t.data_ptr() % ALIGNMENT
            and not (t.is_neg() or t.is_conj() or not t.numel()))


def _fits_state(t: torch.Tensor) -> bool:
    return t.is_contiguous() and not t.data_ptr() % ALIGNMENT and bool(t.numel())


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A compact copy of `t` in fresh (aligned) storage with lazy bits resolved.

    An empty tensor gets TVM's compact strides, the products of the later sizes (`(0, 0, 1)` for
    shape `(0, 0, 0)`): torch's own (`(1, 1, 1)`, it counts an empty size as 1) fail TVM's check.
    """
    if not t.numel():
        strides = [1]
        for size in reversed(t.shape[1:]):
            strides.insert(0, strides[0] * size)
        return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    # clone() always allocates (contiguous() returns a misaligned contiguous view as it is) and
    # materializes neg/conj bits.
    return t.clone(memory_format=torch.contiguous_format)


def runnable(t: torch.Tensor) -> torch.Tensor:
    """`t` when it fits, else a compact copy in fresh (aligned) storage with lazy bits resolved."""
    return t if fits(t) else _copy(t)


def runnable_all(tensors: Sequence[torch.Tensor], thorough: bool = True) -> tuple[list[torch.Tensor], list[int]]:
    """`runnable` of each tensor, and the positions that were copied (usually none).

    With `thorough=False` only strides and alignment are checked: for parameters and
    optimizer state, which only private torch APIs could give a neg/conj bit, the check stays
    at two cheap calls per tensor (a training step passes hundreds of them).
    """
    check = fits if thorough else _fits_state
    out = list(tensors)
    copied = []
    for i, t in enumerate(out):
        if not check(t):
            out[i] = _copy(t)
            copied.append(i)
    return out, copied

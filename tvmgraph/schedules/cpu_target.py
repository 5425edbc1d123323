"""What the CPU schedule rules need to know about an llvm target.

A rule asks three questions of the target: how many float lanes fit in one vector register,
how many vector registers there are (this bounds a matmul's register tile), and whether the
target is a CPU at all. Everything else (cache sizes, thread count) is left to the rules'
fixed, measured tile sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width


@dataclass(frozen=True)
class CPUTarget:
    """Vector facts of one llvm target, for one element type.

    >>> CPUTarget(vector_bits=512, num_vector_registers=32).lanes("float32")
    16
    """

    vector_bits: int
    num_vector_registers: int

    @staticmethod
    def from_target(target: Target) -> CPUTarget:
        """Read the vector width off `target`; 128-bit SSE when the target names no CPU."""
        bits = llvm_get_vector_width(target)
        if bits <= 0:
            bits = 128
        # AVX-512 doubles the register file as well as its width; AVX2 and SSE have 16.
        return CPUTarget(vector_bits=bits, num_vector_registers=32 if bits >= 512 else 16)

    def lanes(self, dtype: str) -> int:
        """How many `dtype` elements one vector register holds (at least 1)."""
        return max(self.vector_bits // tvm.DataType(dtype).bits, 1)


def is_cpu(target: Target | None) -> bool:
    """True for llvm targets: the only ones the CPU rules schedule."""
    return target is not None and target.kind.name == "llvm"

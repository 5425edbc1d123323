"""What the CPU schedule rules need to know about an llvm target.

A rule asks five questions of the target: how many float lanes fit in one vector register,
how many vector registers there are (this bounds a matmul's register tile), from how many rows
of A a matmul copies a B it could read in place and which register tiles run fastest (both
measured per core family), and whether the target is a CPU at all. Everything else (cache
sizes, thread count) is left to the rules' fixed, measured tile sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm.target import Target
from tvm.target.codegen import llvm_get_vector_width, target_has_features

from ..deploy_runtime import machine_of


# A matmul's B that is contiguous along J (x @ W, dY @ W) is read in place, K rows of a panel a
# whole row of B apart, unless this many rows of A reread each panel; then each panel is first
# copied contiguous (schedules/matmul.py). Where the copy pays depends on the core's caches:
# - Zen 5 (both cores), packed time over in place: 0.80 at 256 x 4096 x 4096 (the large MLP's
#   input gradient), 0.81 at 96 x 2048 x 2048, 0.92 at 256 x 1024 x 1024; but 1.15 at
#   64 x 1024 x 1024 and 1.19 at 64 x 4096 x 4096, where fewer tiles share the copy. Whole
#   training steps: large MLP 0.95, GPT 0.97, CNN inference 0.96, the rest within 1%.
# - Intel Sapphire Rapids (2 vCPUs; LLVM sees `rocketlake`): the MLP's input gradient
#   64 x 1024 x 1024 took 1316 us in place and 697 us packed (its training step 4.32 -> 3.64 ms);
#   a lone 16-row product ran faster in place, a 32-row one faster packed. Other x86 CPUs
#   (LLVM names other than znver*) get this threshold too: it is the one measured off Zen.
# - Zen 3 (AVX2, 16 registers: panels of 16-24 floats, one or two cache lines per row of B),
#   `relu(x @ W + b)`, in place / packed, 4 x 2 tile: 64 x 1024 x 1024 2.98 / 1.09 ms,
#   32 x 1024 x 1024 1.43 / 0.62, 16 x 1024 x 1024 0.63 / 0.39, 64 x 256 x 1024 0.34 / 0.26,
#   but 4 x 1024 x 1024 0.17 / 0.21 (one tile of rows: the copy serves nothing); small B ties
#   (16 x 256 x 256, 64 x 128 x 128). A row of B a power of two apart maps K rows of a panel
#   into a few cache sets, which a contiguous panel does not. Whole steps: the batch-64 MLP's
#   training 0.82x, its inference 0.94x, every other suite row within 4% either way.
PACK_REUSED_ROWS_ZEN = 96
PACK_REUSED_ROWS_ZEN_16_REGISTERS = 16
PACK_REUSED_ROWS = 32


@dataclass(frozen=True)
class CPUTarget:
    """Vector facts of one llvm target, for one element type.

    >>> CPUTarget(vector_bits=512, num_vector_registers=32).lanes("float32")
    16
    """

    vector_bits: int
    num_vector_registers: int
    pack_reused_rows: int = PACK_REUSED_ROWS
    # Which measured tables the rules use (matmul's register tiles): "zen4" for LLVM's znver4
    # (AVX-512 on 256-bit units), "zen" for the other znver* names, "intel" for every other x86
    # name (the tables measured off Zen, like the threshold).
    core: str = "intel"

    @staticmethod
    def from_target(target: Target) -> CPUTarget:
        """Read the vector width off `target` (128-bit SSE when the target names no CPU), and
        the packing threshold off its CPU name. Remembered per target description: asking
        LLVM for the CPU's features took 0.3 ms, and the rules ask hundreds of times a graph."""
        key = str(target)  # the whole description (kind, mcpu, mattr, mtriple...)
        known = _BY_DESCRIPTION.get(key)
        if known is None:
            known = _BY_DESCRIPTION[key] = CPUTarget._read(target)
        return known

    @staticmethod
    def _read(target: Target) -> CPUTarget:
        x86 = machine_of(target) in ("x86_64", "i386", "i686")
        bits = _x86_vector_bits(target) if x86 else llvm_get_vector_width(target)
        if bits <= 0:
            bits = 128
        core = _core_family(str(target.attrs.get("mcpu", "")))
        zen = core != "intel"
        # AVX-512 doubles the register file as well as its width; AVX2 and SSE have 16.
        registers = 32 if bits >= 512 else 16
        if not zen:
            pack_reused_rows = PACK_REUSED_ROWS
        elif registers == 16:
            pack_reused_rows = PACK_REUSED_ROWS_ZEN_16_REGISTERS
        else:
            pack_reused_rows = PACK_REUSED_ROWS_ZEN
        return CPUTarget(vector_bits=bits, num_vector_registers=registers,
                         pack_reused_rows=pack_reused_rows, core=core)

    def lanes(self, dtype: str) -> int:
        """How many `dtype` elements one vector register holds (at least 1)."""
        return max(self.vector_bits // tvm.DataType(dtype).bits, 1)


_BY_DESCRIPTION: dict[str, CPUTarget] = {}


def _core_family(mcpu: str) -> str:
    """The measured tables a CPU name uses (CPUTarget.core)."""
    if mcpu == "znver4":
        return "zen4"
    return "zen" if mcpu.startswith("znver") else "intel"


def _x86_vector_bits(target: Target) -> int:
    """The widest vector the target's CPU has. `llvm_get_vector_width` answers with the host's
    (512 on an AVX-512 host for `mcpu=haswell` too): a program exported for another x86 CPU was
    scheduled for this one's registers."""
    if target_has_features("avx512f", target):
        return 512
    if target_has_features("avx", target):
        return 256
    return 128


def is_cpu(target: Target | None) -> bool:
    """True for llvm targets: the only ones the CPU rules schedule."""
    return target is not None and target.kind.name == "llvm"

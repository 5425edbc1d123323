"""Every knob of tvmgraph, in one place.

`GraphConfig` holds the per-graph options listed in OneFlow's `nn.Graph` documentation
(seeds 000 and 004), one method each. An option whose feature is not built yet raises
`NotImplementedError` when switched on: nothing is silently ignored.

Process-wide settings (where caches live) are read once from the environment here and nowhere
else; `settings` is the single instance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _not_yet(option: str, issue: str) -> NotImplementedError:
    return NotImplementedError(
        f"GraphConfig.{option} is not implemented in tvmgraph yet ({issue}); "
        f"leave it off (the default) for now."
    )


@dataclass
class GraphConfig:
    """Optimization options of one `tvmgraph.nn.Graph`, reached as `graph.config`.

    >>> cfg = GraphConfig()
    >>> cfg.set_gradient_accumulation_steps(1)
    >>> cfg
    GraphConfig(training=False, )
    """

    training: bool = False
    amp: bool = False
    zero: bool = False
    fuse_model_update_ops: bool = True
    fuse_add_to_output: bool = True
    fuse_cast_scale: bool = True
    gradient_accumulation_steps: int = 1
    cudnn_conv_heuristic_search_algo: bool = False
    straighten_algorithm: bool = True
    compress_memory: bool = True
    recompute_attention: bool = True
    _defaults: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._defaults = self.options()

    # ---- the options, in the order of OneFlow's documentation ----

    def enable_amp(self, mode: bool = True) -> None:
        """Mixed precision: compute in float16/bfloat16 where safe, keep float32 master weights."""
        if mode:
            raise _not_yet("enable_amp", "AMP with a grad scaler is planned")
        self.amp = False

    def enable_zero(self, mode: bool = True) -> None:
        """ZeRO: shard optimizer state over the ranks of `torch.distributed`."""
        if mode:
            raise _not_yet("enable_zero", "data-parallel training and ZeRO are planned")
        self.zero = False

    def allow_fuse_model_update_ops(self, mode: bool = True) -> None:
        """One in-place kernel per param group for the optimizer update (default: on).

        relay_passes/fuse_model_update.py: every parameter and optimizer state is read and
        written once, in its own memory. Off: the update is plain Relax ops, fused by FuseOps
        into one kernel per result, each allocating a new tensor.
        """
        self.fuse_model_update_ops = bool(mode)

    def allow_fuse_add_to_output(self, mode: bool = True) -> None:
        """Fuse bias add, activation and residual add into the producing matmul/conv (default: on).

        relay_passes/fuse_epilogue.py: each matmul or conv2d becomes one kernel with the adds,
        activations (relu, relu6, gelu) and reshapes after it and the transposes of its
        operands, computed on the accumulators before the one store. Off: TVM's FuseOps alone
        groups the ops (it stops at reshapes and never takes a transposed operand in).
        """
        self.fuse_add_to_output = bool(mode)

    def allow_fuse_cast_scale(self, mode: bool = True) -> None:
        """Fuse a dtype cast with the scalar multiply that follows it (default: on).

        relay_passes/fuse_cast_scale.py: `astype(x) * scale` (loss scaling, mixed precision)
        is one kernel that reads `x` once and never stores the cast. Off: FuseOps alone
        decides, and may leave the two as separate kernels.
        """
        self.fuse_cast_scale = bool(mode)

    def set_gradient_accumulation_steps(self, value: int) -> None:
        """Accumulate gradients over `value` calls before one optimizer step."""
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"set_gradient_accumulation_steps: value must be an int >= 1, got {value!r}")
        if value > 1:
            raise _not_yet("set_gradient_accumulation_steps(>1)", "gradient accumulation is planned")
        self.gradient_accumulation_steps = value

    def enable_cudnn_conv_heuristic_search_algo(self, mode: bool = True) -> None:
        """OneFlow picks cuDNN conv algorithms heuristically; tvmgraph generates its own kernels."""
        if mode:
            raise _not_yet("enable_cudnn_conv_heuristic_search_algo",
                           "tvmgraph does not call cuDNN; its convolutions are TVM kernels")
        self.cudnn_conv_heuristic_search_algo = False

    def enable_straighten_algorithm(self, mode: bool = True) -> None:
        """Order ops to lower the peak of live memory (default: on).

        relay_passes/straighten.py: the kernels of each dataflow block run in a greedy order
        that first runs whatever frees at least as much memory as it allocates (e.g. a weight
        gradient's reduction right after the gradient it reads, not after the whole backward
        pass), else keeps the program's order. Off: the order autodiff and fusion produced.
        """
        self.straighten_algorithm = bool(mode)

    def enable_compress_memory(self, mode: bool = True) -> None:
        """Plan memory harder than TVM's StaticPlanBlockMemory (default: on).

        relay_passes/compress_memory.py: every intermediate tensor gets an offset in one arena
        per function, packed by lifetimes (biggest first), and an element-wise kernel writes
        its result over an input that dies there. Kept only where it plans fewer bytes than
        StaticPlanBlockMemory. Off: StaticPlanBlockMemory alone plans. CPU only.
        """
        self.compress_memory = bool(mode)

    def enable_recompute_attention(self, mode: bool = True) -> None:
        """Recompute attention probabilities in the backward pass instead of keeping them
        (default: on; training graphs).

        relay_passes/recompute_attention.py: each attention core (q k^T, softmax, the weighted
        sum of v) is marked for Relax's activation checkpointing, so the backward pass keeps
        q, k and v and recomputes the batch x heads x seq x seq probabilities, as a flash-
        attention kernel does. Off: autodiff keeps them from the forward pass.
        """
        self.recompute_attention = bool(mode)

    # ---- reading the options ----

    def options(self) -> dict[str, object]:
        """All option values by name (`training` excluded): part of the compiled-cache key."""
        return {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if name not in ("training", "_defaults")
        }

    def __repr__(self) -> str:
        changed = "".join(
            f"{k}={v}, " for k, v in self.options().items() if self._defaults.get(k) != v
        )
        return f"GraphConfig(training={self.training}, {changed})"


@dataclass(frozen=True)
class Settings:
    """Process-wide settings, read once from the environment."""

    cache_dir: Path = field(
        default_factory=lambda: Path(
            os.environ.get("TVMGRAPH_CACHE_DIR", Path.home() / ".cache" / "tvmgraph")
        )
    )
    # TVM VM memory allocator: "pooled" keeps freed blocks for reuse (fast); "naive" returns
    # them at once (the memory benchmark uses it so that RSS follows live tensors).
    vm_allocator: str = field(default_factory=lambda: os.environ.get("TVMGRAPH_VM_ALLOCATOR", "pooled"))
    # tvmgraph's default CPU schedules (tvmgraph/schedules); TVMGRAPH_CPU_SCHEDULES=0 leaves
    # kernels as TVM's plain loop nests (slow; for debugging a schedule).
    cpu_schedules: bool = field(default_factory=lambda: os.environ.get("TVMGRAPH_CPU_SCHEDULES", "1") != "0")
    # float32 exp/erf/tanh/sigmoid as vectorizable polynomials (~1e-7 relative error) on CPU.
    fast_math: bool = field(default_factory=lambda: os.environ.get("TVMGRAPH_FAST_MATH", "1") != "0")
    # LLVM's optimization level for CPU kernels (0-3). The kernels reach LLVM already tiled,
    # unrolled and vectorized by tvmgraph's schedules; see docs/pipeline.md for the measurements.
    llvm_opt_level: int = field(default_factory=lambda: int(os.environ.get("TVMGRAPH_LLVM_OPT_LEVEL", "1")))
    # The persistent compiled cache under cache_dir/compiled (TVMGRAPH_COMPILE_CACHE=0: off).
    compile_cache: bool = field(default_factory=lambda: os.environ.get("TVMGRAPH_COMPILE_CACHE", "1") != "0")
    # Check the module after every pass of the pipeline (relax.analysis.well_formed) and leave out
    # an optional pass that breaks it (tvmgraph/pipeline.py). TVMGRAPH_CHECK_PASSES=1: always (the
    # tests set it); otherwise at graph.debug(1) and when a compile fails (it is then rerun).
    check_passes: bool = field(default_factory=lambda: os.environ.get("TVMGRAPH_CHECK_PASSES", "0") == "1")


settings = Settings()

# TVM's CPU worker threads spin after each parallel kernel before they sleep. With the default
# spin count they keep both cores busy long after a graph call returns, and eager torch code
# that runs next (its OpenMP threads) slows down up to 40x (measured: a 70 us eager MLP took
# 2.5 ms right after a graph call). A short spin keeps consecutive kernels of one graph call on
# warm threads and lets them sleep between calls. Read by TVM when its thread pool starts, so
# it is set here, at import; a value the user exported wins.
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "1000")
# Without TVM_NUM_THREADS, TVM on x86 runs half as many threads as there are logical CPUs (it
# assumes hyper-threading) and pins the calling thread to one core: on the 2-core Zen 5 test
# machine every kernel ran on one thread (GEMV 48 us instead of 23 us), and the Python main
# thread, torch's included, stayed pinned to CPU 0 afterwards. torch's intra-op thread count is
# its own pick of cores (physical ones on hyper-threaded CPUs); kernels use as many threads.
def _torch_threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


os.environ.setdefault("TVM_NUM_THREADS", str(_torch_threads()))

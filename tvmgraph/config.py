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
    fuse_add_to_output: bool = False
    fuse_cast_scale: bool = False
    gradient_accumulation_steps: int = 1
    cudnn_conv_heuristic_search_algo: bool = False
    straighten_algorithm: bool = False
    compress_memory: bool = False
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
        """Fuse bias add, activation and residual add into the producing matmul/conv."""
        if mode:
            raise _not_yet("allow_fuse_add_to_output", "the fusion passes are planned")
        self.fuse_add_to_output = False

    def allow_fuse_cast_scale(self, mode: bool = True) -> None:
        """Fuse a dtype cast with the scalar multiply that follows it."""
        if mode:
            raise _not_yet("allow_fuse_cast_scale", "the fusion passes are planned")
        self.fuse_cast_scale = False

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
        """Order ops to lower the peak of live memory."""
        if mode:
            raise _not_yet("enable_straighten_algorithm", "the memory passes are planned")
        self.straighten_algorithm = False

    def enable_compress_memory(self, mode: bool = True) -> None:
        """Plan memory harder than TVM's StaticPlanBlockMemory (in-place ops, packing)."""
        if mode:
            raise _not_yet("enable_compress_memory", "the memory passes are planned")
        self.compress_memory = False

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
    # The persistent compiled cache under cache_dir/compiled (TVMGRAPH_COMPILE_CACHE=0: off).
    compile_cache: bool = field(default_factory=lambda: os.environ.get("TVMGRAPH_COMPILE_CACHE", "1") != "0")


settings = Settings()

# TVM's CPU worker threads spin after each parallel kernel before they sleep. With the default
# spin count they keep both cores busy long after a graph call returns, and eager torch code
# that runs next (its OpenMP threads) slows down up to 40x (measured: a 70 us eager MLP took
# 2.5 ms right after a graph call). A short spin keeps consecutive kernels of one graph call on
# warm threads and lets them sleep between calls. Read by TVM when its thread pool starts, so
# it is set here, at import; a value the user exported wins.
os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "1000")

"""Every knob of tvmgraph, in one place.

`GraphConfig` holds the per-graph options listed in OneFlow's `nn.Graph` documentation
(seeds 000 and 004), one method each, plus tvmgraph's own. Each setter takes only its documented
values and raises `ConfigError` (a `ValueError`) listing them otherwise; an option whose feature is
not built yet raises `UnsupportedOptionError` (a `NotImplementedError`) when switched on: nothing
is silently ignored.

`Settings` holds the process-wide settings, read once from the `TVMGRAPH_*` environment variables
here and nowhere else, each validated (a bad value is a `ConfigError` naming the variable).

`CompileOptions` is the one snapshot of everything that shapes compiled code: the graph's options
and the process-wide codegen settings. A graph takes it when it traces; the pipeline reads only
it, and the compiled-cache key hashes all of it, so no setting can change the code behind the
key's back.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .errors import ConfigError, UnsupportedOptionError

logger = logging.getLogger("tvmgraph")

# OneFlow's straighten-algorithm modes; tvmgraph implements "MemoryFirst" (the default) and
# "Disable". The others order ops for GPU overlap or speed, which a CPU VM does not gain from.
STRAIGHTEN_MODES = ("MemoryFirst", "Disable")
ONEFLOW_ONLY_STRAIGHTEN_MODES = ("SpeedFirst", "OverlapCpuGpu", "DelayShortGpu")
DEFAULT_RECOMPILE_LIMIT = 8


def _flag(option: str, mode: object) -> bool:
    # bool("Disable") is True: accept real booleans only.
    if not isinstance(mode, bool):
        raise ConfigError(f"GraphConfig.{option}(mode) takes True or False, got {mode!r}")
    return mode


def _not_yet(option: str, why: str) -> UnsupportedOptionError:
    return UnsupportedOptionError(
        f"GraphConfig.{option} is not implemented in tvmgraph yet ({why}); "
        f"leave it off (the default) for now."
    )


@dataclass(frozen=True)
class CompileOptions:
    """Everything that shapes a graph's compiled code, fixed when the graph traces.

    Graph options (GraphConfig) and process-wide codegen settings (Settings) together. Two
    compiles with equal options produce the same code; a field added here is automatically part
    of the call signature and of the compiled-cache key.
    """

    amp: bool = False
    amp_dtype: str | None = None  # "bfloat16" / "float16"; None: the device's default (amp.py)
    gradient_accumulation_steps: int = 1
    # Data parallel (training/data_parallel.py): the ranks gradients are averaged over (1: none),
    # and under ZeRO this rank (it compiles the update of its own parameters only).
    data_parallel: int = 1
    zero_rank: int | None = None
    zero_stage: int = 0  # 1 or 2 under ZeRO: 2 reduces each gradient to its owner only
    fuse_model_update_ops: bool = True
    fuse_add_to_output: bool = True
    fuse_cast_scale: bool = True
    straighten_algorithm: bool = True
    compress_memory: bool = True
    recompute_attention: bool = True
    activation_checkpointing: tuple[str, ...] = ()  # paths of the modules recomputed in backward
    cpu_schedules: bool = True
    fast_math: bool = True
    llvm_opt_level: int = 1
    kernel_checks: bool = False  # each CPU kernel checks its arguments (codegen.build_executable)
    tuning: bool = True
    tuning_name: str | None = None  # the tuning log's graph name; None: the Graph subclass's name
    dynamic_batch: bool = False
    frozen_weights: bool = False  # inference: weights packed once per version (relay_passes/weight_packing.py)
    # Pipeline parallelism (training/pipeline_parallel.py): (module path, stage, rank) of each
    # module given a stage; in the program of one stage, (its index, how many of its first
    # inputs are activations received from other stages).
    pipeline_stages: tuple[tuple[str, int, int], ...] = ()
    pipeline_stage: tuple[int, int] | None = None

    def changes_from(self, old: CompileOptions) -> list[str]:
        """`name old -> new` for each option that differs from `old`."""
        return [f"{f.name} {getattr(old, f.name)!r} -> {getattr(self, f.name)!r}"
                for f in fields(self) if getattr(old, f.name) != getattr(self, f.name)]


class GraphConfig:
    """Optimization options of one `tvmgraph.nn.Graph`, reached as `graph.config`.

    Options may be changed between calls: the next call compiles (or finds) the program for the
    new values, like any other guard (docs/footguns.md).

    >>> cfg = GraphConfig()
    >>> cfg.set_gradient_accumulation_steps(1)
    >>> cfg.enable_straighten_algorithm("Disable")
    >>> cfg
    GraphConfig(training=False, straighten_algorithm='Disable', )
    """

    _OPTIONS = ("amp", "amp_dtype", "zero", "zero_stage", "data_parallel", "fuse_model_update_ops", "fuse_add_to_output", "fuse_cast_scale",
                "gradient_accumulation_steps", "cudnn_conv_heuristic_search_algo", "straighten_algorithm",
                "compress_memory", "recompute_attention", "recompile_limit", "tuning", "tuning_name",
                "activation_checkpointing", "dynamic_batch", "frozen_weights", "pipeline_stages")

    def __init__(self) -> None:
        self.training = False
        self.amp = False
        self.amp_dtype = None
        self.zero = False
        self.zero_stage = 1  # 2: gradients reduced to their owner only (training/data_parallel.py)
        self.data_parallel = True
        self.fuse_model_update_ops = True
        self.fuse_add_to_output = True
        self.fuse_cast_scale = True
        self.gradient_accumulation_steps = 1
        self.cudnn_conv_heuristic_search_algo = False
        self.straighten_algorithm = "MemoryFirst"
        self.compress_memory = True
        self.recompute_attention = True
        self.recompile_limit = DEFAULT_RECOMPILE_LIMIT
        self.tuning = True
        self.tuning_name = None
        self.activation_checkpointing: tuple[str, ...] = ()  # set through graph.<module>.to(GraphModule)
        self.dynamic_batch = False
        self.frozen_weights = False
        self.pipeline_stages: tuple[tuple[str, int, int], ...] = ()  # set through GraphModule.set_stage
        self._defaults = self.options()

    def __setattr__(self, name: str, value: object) -> None:
        # Any change drops the cached snapshot; reading options stays one attribute load per call.
        object.__setattr__(self, name, value)
        if name in self._OPTIONS:
            object.__setattr__(self, "_snapshot", None)

    # ---- the options, in the order of OneFlow's documentation ----

    def enable_amp(self, mode: bool = True, dtype: object = None) -> None:
        """Mixed precision: build() runs under `torch.autocast`, so each op computes in the
        dtype autocast's policy gives it; parameters and optimizer state stay float32.

        `dtype`: torch.bfloat16 or torch.float16; None (default) is the device's autocast
        default, bfloat16 on CPU and float16 on CUDA (tvmgraph/amp.py). Pair float16 with
        `graph.set_grad_scaler(...)` for loss scaling.
        """
        from .amp import dtype_name

        name = dtype_name(dtype)  # checked even when turning AMP off: a typo is never silent
        self.amp = _flag("enable_amp", mode)
        self.amp_dtype = name if mode else None

    def enable_zero(self, mode: bool = True, stage: int = 1) -> None:
        """ZeRO: shard optimizer state over the ranks of `torch.distributed` (each rank updates
        and keeps the state of its share of the parameters); stage 2 also shards the gradients
        (each is summed on the rank that owns it only). docs/distributed.md."""
        if _flag("enable_zero", mode) and stage not in (1, 2):
            if stage == 3:
                raise _not_yet(f"enable_zero(stage={stage})", "stages 1 and 2 are: sharded optimizer state and "
                                                              "gradients, not parameters")
            raise ConfigError(f"GraphConfig.enable_zero(mode, stage) takes stage 1, 2 or 3, got {stage!r}")
        self.zero = mode
        self.zero_stage = stage if mode else 1

    def enable_data_parallel(self, mode: bool = True) -> None:
        """Average gradients over the ranks of `torch.distributed` (default: on; tvmgraph's own
        option). It acts only in an initialized process group of two or more ranks, on training
        graphs; off, each rank trains on its own (docs/distributed.md)."""
        self.data_parallel = _flag("enable_data_parallel", mode)

    def allow_fuse_model_update_ops(self, mode: bool = True) -> None:
        """One in-place kernel per param group for the optimizer update (default: on).

        relay_passes/fuse_model_update.py: every parameter and optimizer state is read and
        written once, in its own memory. Off: the update is plain Relax ops, fused by FuseOps
        into one kernel per result, each allocating a new tensor.
        """
        self.fuse_model_update_ops = _flag("allow_fuse_model_update_ops", mode)

    def allow_fuse_add_to_output(self, mode: bool = True) -> None:
        """Fuse bias add, activation and residual add into the producing matmul/conv (default: on).

        relay_passes/fuse_epilogue.py: each matmul or conv2d becomes one kernel with the adds,
        activations (relu, relu6, gelu) and reshapes after it and the transposes of its
        operands, computed on the accumulators before the one store. Off: TVM's FuseOps alone
        groups the ops (it stops at reshapes and never takes a transposed operand in).
        """
        self.fuse_add_to_output = _flag("allow_fuse_add_to_output", mode)

    def allow_fuse_cast_scale(self, mode: bool = True) -> None:
        """Fuse a dtype cast with the scalar multiply that follows it (default: on).

        relay_passes/fuse_cast_scale.py: `astype(x) * scale` (loss scaling, mixed precision)
        is one kernel that reads `x` once and never stores the cast. Off: FuseOps alone
        decides, and may leave the two as separate kernels.
        """
        self.fuse_cast_scale = _flag("allow_fuse_cast_scale", mode)

    def set_gradient_accumulation_steps(self, value: int) -> None:
        """Accumulate gradients over `value` micro-batches before one optimizer step: each call
        of a training graph splits its batch on dim 0 and runs the micro-batches one after another
        (tvmgraph/training/accumulation.py; docs/training.md, "Gradient accumulation")."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"GraphConfig.set_gradient_accumulation_steps(value) takes an int >= 1, "
                              f"got {value!r}")
        self.gradient_accumulation_steps = value

    def enable_cudnn_conv_heuristic_search_algo(self, mode: bool = True) -> None:
        """OneFlow picks cuDNN conv algorithms heuristically; tvmgraph generates its own kernels."""
        if _flag("enable_cudnn_conv_heuristic_search_algo", mode):
            raise _not_yet("enable_cudnn_conv_heuristic_search_algo",
                           "tvmgraph does not call cuDNN; its convolutions are TVM kernels")
        self.cudnn_conv_heuristic_search_algo = False

    def enable_straighten_algorithm(self, mode: str | bool = "MemoryFirst") -> None:
        """Order ops to lower the peak of live memory: `"MemoryFirst"` (default) or `"Disable"`.

        relay_passes/straighten.py: the kernels of each dataflow block run in a greedy order
        that first runs whatever frees at least as much memory as it allocates (e.g. a weight
        gradient's reduction right after the gradient it reads, not after the whole backward
        pass), else keeps the program's order. `"Disable"`: the order autodiff and fusion
        produced. `True`/`False` are read as `"MemoryFirst"`/`"Disable"`. OneFlow's GPU modes
        (`"SpeedFirst"`, `"OverlapCpuGpu"`, `"DelayShortGpu"`) are not implemented.
        """
        if isinstance(mode, bool):
            mode = "MemoryFirst" if mode else "Disable"
        if mode in ONEFLOW_ONLY_STRAIGHTEN_MODES:
            raise _not_yet(f"enable_straighten_algorithm({mode!r})",
                           f"only {' and '.join(map(repr, STRAIGHTEN_MODES))} are")
        if mode not in STRAIGHTEN_MODES:
            raise ConfigError(f"GraphConfig.enable_straighten_algorithm(mode) takes one of "
                              f"{', '.join(map(repr, STRAIGHTEN_MODES))} (or True/False), got {mode!r}")
        self.straighten_algorithm = mode

    def enable_compress_memory(self, mode: bool = True) -> None:
        """Plan memory harder than TVM's StaticPlanBlockMemory (default: on).

        relay_passes/compress_memory.py: every intermediate tensor gets an offset in one arena
        per function, packed by lifetimes (biggest first), and an element-wise kernel writes
        its result over an input that dies there. Kept only where it plans fewer bytes than
        StaticPlanBlockMemory. Off: StaticPlanBlockMemory alone plans. CPU only.
        """
        self.compress_memory = _flag("enable_compress_memory", mode)

    def enable_recompute_attention(self, mode: bool = True) -> None:
        """Recompute attention probabilities in the backward pass instead of keeping them
        (default: on; training graphs).

        relay_passes/recompute_attention.py: each attention core (q k^T, softmax, the weighted
        sum of v) is marked for Relax's activation checkpointing, so the backward pass keeps
        q, k and v and recomputes the batch x heads x seq x seq probabilities, as a flash-
        attention kernel does. Off: autodiff keeps them from the forward pass.
        """
        self.recompute_attention = _flag("enable_recompute_attention", mode)

    def set_recompile_limit(self, value: int) -> None:
        """How many programs (call signatures) one graph may compile (default 8).

        Each new input shape, dtype, train/eval mode, option value or model structure compiles
        another program; past the limit the call raises `RecompileLimitError`, which usually
        means a shape changes every call. (tvmgraph's own option, like torch.compile's.)
        """
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"GraphConfig.set_recompile_limit(value) takes an int >= 1, got {value!r}")
        self.recompile_limit = value

    def enable_tuning(self, mode: bool = True, name: str | None = None) -> None:
        """Compile with the graph's auto-tuning log (default: on; tvmgraph's own option).

        Kernels that `tvmgraph tune` measured faster than the default schedules get their
        tuned schedule, from `$TVMGRAPH_CACHE_DIR/tuning/<name>/<target>/` (docs/autotune.md).
        `name` picks the log: by default the Graph subclass's name. Off (or the environment
        variable TVMGRAPH_TUNING=off): every kernel gets the default schedule.
        """
        self.tuning = _flag("enable_tuning", mode)
        if name is not None:
            from autotune.log import check_log_name

            check_log_name(name)
        self.tuning_name = name

    def _checkpoint_module(self, path: str, mode: bool) -> None:
        """`graph.<path>.to(tvmgraph.nn.GraphModule).activation_checkpointing = mode`
        (tvmgraph/graph_module.py): per-module, but it shapes the program like any option."""
        paths = set(self.activation_checkpointing)
        if _flag("activation_checkpointing", mode):
            paths.add(path)
        else:
            paths.discard(path)
        self.activation_checkpointing = tuple(sorted(paths))

    def _set_stage(self, path: str, stage: int, rank: int) -> None:
        """`graph.<path>.to(tvmgraph.nn.GraphModule).set_stage(stage, placement)`
        (tvmgraph/graph_module.py): per-module, it shapes the program like any option."""
        stages = {p: (s, r) for p, s, r in self.pipeline_stages}
        stages[path] = (stage, rank)
        self.pipeline_stages = tuple(sorted((p, s, r) for p, (s, r) in stages.items()))

    def enable_dynamic_batch(self, mode: bool = True) -> None:
        """Compile one program for every batch size (default: off; tvmgraph's own option).

        Dim 0 of every tensor argument of `build()` with at least one dim is the batch: one
        symbolic size, shared by all of them, so that a call with any batch size from 1 up runs
        the same compiled program (docs/training.md, "Dynamic batch"). Off: each batch size is
        its own signature, compiled on first use.
        """
        self.dynamic_batch = _flag("enable_dynamic_batch", mode)

    def enable_frozen_weights(self, mode: bool = True) -> None:
        """Compute what an inference graph computes from its weights alone once, not on every
        call (default: off; tvmgraph's own option, like torch.compile's `freezing`).

        A product with few rows (nn.Linear at batch 64 or less) spends a large share of its time
        copying the weight into the panels its register tiles read; with this option the graph
        keeps the panels between calls (as much memory again as those weights), and the
        weights' casts under AMP and other work on them alone, and computes them again
        when a parameter or buffer is replaced or changes in place through itself
        (`optimizer.step()`, `load_state_dict`, `w.mul_(...)`: torch's version counter). A write
        that torch does not count, through `w.data`, a numpy view or `torch.optim`'s
        `fused=True` update, is not seen: call `graph.refresh_weights()` after it. Training
        graphs refuse it (their weights change every step).
        """
        self.frozen_weights = _flag("enable_frozen_weights", mode)

    # ---- reading the options ----

    def options(self) -> dict[str, object]:
        """All option values by name (`training` excluded)."""
        return {name: getattr(self, name) for name in self._OPTIONS}

    def snapshot(self, ranks: tuple[int, int] | None = None) -> CompileOptions:
        """The options that shape compiled code, with the process-wide codegen settings.
        `ranks`: (rank, world size) of a training graph in a process group of 2 or more ranks."""
        snap = self.__dict__.get("_snapshot")
        if snap is None or self.__dict__.get("_snapshot_ranks") != ranks:
            parallel = ranks is not None and self.data_parallel
            snap = CompileOptions(
                amp=self.amp, amp_dtype=self.amp_dtype, gradient_accumulation_steps=self.gradient_accumulation_steps,
                data_parallel=ranks[1] if parallel else 1,
                zero_rank=ranks[0] if parallel and self.zero else None,
                zero_stage=self.zero_stage if parallel and self.zero else 0,
                fuse_model_update_ops=self.fuse_model_update_ops, fuse_add_to_output=self.fuse_add_to_output,
                fuse_cast_scale=self.fuse_cast_scale,
                straighten_algorithm=self.straighten_algorithm != "Disable",
                compress_memory=self.compress_memory, recompute_attention=self.recompute_attention,
                cpu_schedules=settings.cpu_schedules, fast_math=settings.fast_math,
                llvm_opt_level=settings.llvm_opt_level, kernel_checks=settings.kernel_checks,
                tuning=self.tuning and settings.tuning,
                tuning_name=self.tuning_name, activation_checkpointing=self.activation_checkpointing,
                dynamic_batch=self.dynamic_batch, frozen_weights=self.frozen_weights,
                pipeline_stages=self.pipeline_stages,
            )
            object.__setattr__(self, "_snapshot", snap)
            object.__setattr__(self, "_snapshot_ranks", ranks)
        return snap

    def __repr__(self) -> str:
        changed = "".join(
            f"{k}={v!r}, " for k, v in self.options().items() if self._defaults.get(k) != v
        )
        return f"GraphConfig(training={self.training}, {changed})"


def compile_options(config: GraphConfig | CompileOptions | None) -> CompileOptions:
    """`config`'s snapshot; a CompileOptions is returned as it is (None: the defaults)."""
    if config is None:
        return GraphConfig().snapshot()
    return config if isinstance(config, CompileOptions) else config.snapshot()


# ---- process-wide settings, from the environment ----

def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise ConfigError(f"environment variable {name}={value!r}: set it to 1 (on) or 0 (off)")
    return value == "1"


def _env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        bounds = f"an integer from {low} to {high}" if high is not None else f"an integer >= {low}"
        raise ConfigError(f"environment variable {name}={value!r}: set it to {bounds}, or unset it "
                          f"(default {default})")
    return number


def _env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name) or default
    if value not in choices:
        raise ConfigError(f"environment variable {name}={value!r}: set it to one of "
                          f"{', '.join(choices)}, or unset it (default {default})")
    return value


def _env_path(name: str, default: Path) -> Path:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else default


# Every TVMGRAPH_* variable tvmgraph reads; any other one is most likely a typo and is reported.
KNOWN_VARIABLES = ("TVMGRAPH_CACHE_DIR", "TVMGRAPH_VM_ALLOCATOR", "TVMGRAPH_CPU_SCHEDULES", "TVMGRAPH_FAST_MATH",
                   "TVMGRAPH_LLVM_OPT_LEVEL", "TVMGRAPH_COMPILE_CACHE", "TVMGRAPH_CACHE_MAX_BYTES",
                   "TVMGRAPH_CHECK_PASSES", "TVMGRAPH_STRICT_SCHEDULES", "TVMGRAPH_TUNING", "TVMGRAPH_KERNEL_CHECKS", "TVMGRAPH_OPENMP_THREADS")


def _env_bytes(name: str, default: int) -> int:
    """A size in bytes from the environment variable `name`: a non-negative integer."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        size = int(value.strip())
    except ValueError:
        size = -1
    if size < 0:
        raise ConfigError(f"environment variable {name}={value!r} is not a size in bytes; set it to a "
                          f"non-negative integer (e.g. {name}={default}) or unset it for the default")
    return size


@dataclass(frozen=True)
class Settings:
    """Process-wide settings, read once from the environment (each validated)."""

    cache_dir: Path = field(default_factory=lambda: _env_path(
        "TVMGRAPH_CACHE_DIR", Path.home() / ".cache" / "tvmgraph"))
    # TVM VM memory allocator: "pooled" keeps freed blocks for reuse (fast); "naive" returns
    # them at once (the memory benchmark uses it so that RSS follows live tensors).
    vm_allocator: str = field(default_factory=lambda: _env_choice(
        "TVMGRAPH_VM_ALLOCATOR", "pooled", ("pooled", "naive")))
    # tvmgraph's default CPU schedules (tvmgraph/schedules); TVMGRAPH_CPU_SCHEDULES=0 leaves
    # kernels as TVM's plain loop nests (slow; for debugging a schedule).
    cpu_schedules: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_CPU_SCHEDULES", True))
    # float32 exp/erf/tanh/sigmoid as vectorizable polynomials (~1e-7 relative error) on CPU.
    fast_math: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_FAST_MATH", True))
    # LLVM's optimization level for CPU kernels (0-3). The kernels reach LLVM already tiled,
    # unrolled and vectorized by tvmgraph's schedules; see docs/pipeline.md for the measurements.
    llvm_opt_level: int = field(default_factory=lambda: _env_int("TVMGRAPH_LLVM_OPT_LEVEL", 1, 0, 3))
    # CPU kernels that check their arguments on every call (codegen.build_executable): off for
    # the programs a graph runs, which get checked tensors only; saved deployments keep them.
    kernel_checks: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_KERNEL_CHECKS", False))
    # CPU kernels run on torch's OpenMP threads (tvmgraph/openmp_launch.py); 0: on TVM's own pool.
    openmp_threads: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_OPENMP_THREADS", True))
    # The persistent compiled cache under cache_dir/compiled (TVMGRAPH_COMPILE_CACHE=0: off).
    compile_cache: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_COMPILE_CACHE", True))
    # Size limit of the compiled cache in bytes (default 2 GiB); least recently used entries go first.
    cache_max_bytes: int = field(default_factory=lambda: _env_bytes("TVMGRAPH_CACHE_MAX_BYTES", 2 << 30))
    # Check the module after every pass of the pipeline (relax.analysis.well_formed) and leave out
    # an optional pass that breaks it (tvmgraph/pipeline.py). TVMGRAPH_CHECK_PASSES=1: always (the
    # tests set it); otherwise at graph.debug(1) and when a compile fails (it is then rerun).
    check_passes: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_CHECK_PASSES", False))
    # A CPU schedule rule that fails with an error of its own Python (not TVM's refusal of a
    # primitive) raises instead of leaving the kernel to the next rule (tvmgraph/schedules/
    # apply.py). TVMGRAPH_STRICT_SCHEDULES=1: the tests set it.
    strict_schedules: bool = field(default_factory=lambda: _env_flag("TVMGRAPH_STRICT_SCHEDULES", False))
    # Compiles apply the graph's tuning log (autotune/); TVMGRAPH_TUNING=0 compiles every graph
    # with the default schedules (on/off or 1/0).
    tuning: bool = field(default_factory=lambda: _env_choice("TVMGRAPH_TUNING", "on", ("on", "off", "1", "0"))
                         in ("on", "1"))

    def __post_init__(self) -> None:
        # TVMGRAPH_TEST_* belong to tvmgraph's own test suite.
        unknown = sorted(k for k in os.environ if k.startswith("TVMGRAPH_") and k not in KNOWN_VARIABLES
                         and not k.startswith("TVMGRAPH_TEST_"))
        if unknown:
            logger.warning("unknown environment variable(s) %s ignored; tvmgraph reads %s",
                           ", ".join(unknown), ", ".join(KNOWN_VARIABLES))

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


settings = Settings()

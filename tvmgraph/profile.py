"""`graph.profile(*args)`: where one call's time goes, kernel by kernel, against the machine's limits.

Each call of the compiled program is timed through the Relax VM's instrument hook (before and
after every call the VM makes), so the times are those of the program as it runs, kernels in their
real order with their real inputs. Each kernel's FLOPs come from its TIR before
scheduling (`estimate_tir_flops`; a dynamic batch's kernels bound to the shapes they ran with),
its bytes from its arguments (read plus written); against the machine's
measured limits (tvmgraph/hardware.py) a kernel is compute-bound when its FLOPs per byte are above
the ridge point (FMA peak / bandwidth) and is given as a share of the FMA peak, else as a share of
the memory bandwidth.

A training graph's profile runs real steps: the graph's state (parameters, buffers, optimizer and
scheduler state, step counter) and torch's RNG are put back afterwards, so profiling changes nothing.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import tvm
from tvm import relax

from relay_passes.weight_packing import PREPACKED_SUFFIX

from .config import settings
from .hardware import Limits
from .target import tvm_device
from .training.accumulation import APPLY_UPDATE

if TYPE_CHECKING:
    from .graph import Graph
    from .stages import CompiledGraph

RUNTIME = "(VM runtime: allocation, shape checks, tuple handling)"


@dataclass(frozen=True)
class KernelTime:
    """One kernel's share of a graph call (all its calls within one graph call)."""

    name: str
    calls: int
    seconds: float   # median over the profiled graph calls
    flops: float     # 0 where the TIR has no arithmetic to count (copies, layout changes)
    bytes: int       # arguments read plus written

    def limit_share(self, limits: Limits | None) -> tuple[float, str] | None:
        """(share of the machine's limit, "FMA" or "BW"), or None without limits or time."""
        if limits is None or self.seconds <= 0 or self.name == RUNTIME:
            return None
        if self.flops and self.bytes and self.flops / self.bytes >= limits.ridge:
            return self.flops / self.seconds / 1e9 / limits.fma_gflops, "FMA"
        if self.bytes:
            return self.bytes / self.seconds / 1e9 / limits.bandwidth_gbs, "BW"
        return None


@dataclass(frozen=True)
class Profile:
    """The kernels of one graph call, slowest first; `print(profile)` shows the table."""

    graph: str
    kernels: list[KernelTime]
    call_seconds: float          # median time of a whole uninstrumented call
    limits: Limits | None

    @property
    def kernel_seconds(self) -> float:
        return sum(k.seconds for k in self.kernels)

    def table(self, top: int | None = 25) -> str:
        total = self.kernel_seconds or 1.0
        rows = [f"{self.graph}: one call {self.call_seconds * 1e3:.3f} ms uninstrumented; instrumented, "
                f"the VM's calls below add up to {self.kernel_seconds * 1e3:.3f} ms"]
        if self.limits is not None:
            rows.append(f"limits of {self.limits.cpu} ({self.limits.threads} threads): FMA peak "
                        f"{self.limits.fma_gflops:.0f} GFLOP/s, bandwidth {self.limits.bandwidth_gbs:.1f} GB/s")
        rows.append(f"{'kernel':<56} {'calls':>5} {'us':>9} {'share':>6} {'GFLOP/s':>8} {'GB/s':>7} {'of limit':>10}")
        shown = self.kernels if top is None else self.kernels[:top]
        for k in shown:
            gflops = f"{k.flops / k.seconds / 1e9:8.1f}" if k.flops and k.seconds else f"{'-':>8}"
            gbs = f"{k.bytes / k.seconds / 1e9:7.1f}" if k.bytes and k.seconds else f"{'-':>7}"
            share = k.limit_share(self.limits)
            limit = f"{share[0] * 100:5.1f}% {share[1]:>3}" if share else f"{'-':>10}"
            rows.append(f"{_fit(k.name, 56):<56} {k.calls:>5} {k.seconds * 1e6:9.1f} {k.seconds / total * 100:5.1f}% "
                        f"{gflops} {gbs} {limit}")
        if len(shown) < len(self.kernels):
            rest = self.kernels[len(shown):]
            rows.append(f"... {len(rest)} more kernels, {sum(k.seconds for k in rest) * 1e6:.1f} us")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _fit(name: str, width: int) -> str:
    """`name`, its middle cut out when too long: kernel names differ at both ends."""
    if len(name) <= width:
        return name
    half = (width - 3) // 2
    return f"{name[:half]}...{name[-(width - 3 - half):]}"


class _Recorder:
    """The VM instrument: adds up the time of every call, by the symbol the VM calls. On a GPU
    (`sync`: the device's synchronize) it waits for the device before and after each call, which
    otherwise only queues a kernel: the time is then the kernel's, not its launch's."""

    def __init__(self, sync: Any = None) -> None:
        self.sync = sync
        self.runs: list[dict[str, list[float]]] = []
        self.bytes: dict[str, int] = {}
        self.args: dict[str, list[Any]] = {}  # each kernel's arguments' shapes (ints for scalars)
        self._started = 0.0

    def new_run(self) -> None:
        self.runs.append(defaultdict(list))

    def __call__(self, func: Any, symbol: str, before: bool, ret: Any, *args: Any) -> int:
        if before:
            if not self.bytes.get(symbol):  # counted once: the same call has the same arguments
                self.bytes[symbol] = sum(_nbytes(a) for a in args)
                self.args[symbol] = [_shape_of(a) for a in args]
            if self.sync is not None:
                self.sync()
            self._started = time.perf_counter()
        else:
            if self.sync is not None:
                self.sync()
            self.runs[-1][symbol].append(time.perf_counter() - self._started)
        return 0  # VMInstrumentReturnKind.NO_OP: run the call as usual


def _nbytes(value: Any) -> int:
    if isinstance(value, tvm.runtime.Tensor):
        count = 1
        for d in value.shape:
            count *= int(d)
        return count * tvm.runtime.DataType(value.dtype).bits // 8
    return 0


def _shape_of(value: Any) -> tuple[tuple[int, ...], str] | int | None:
    if isinstance(value, tvm.runtime.Tensor):
        return tuple(int(d) for d in value.shape), str(value.dtype)
    return int(value) if isinstance(value, int) else None


def _flops(compiled: CompiledGraph, args: dict[str, list[Any]]) -> dict[str, float]:
    """Each kernel's FLOPs, counted on its TIR before scheduling (a schedule's padding and
    index arithmetic are not the kernel's work): the pipeline runs again up to its tuning stage.
    A kernel over a dynamic batch is counted at the shapes it was called with (`args`): the
    estimator counts a symbolic loop once, which showed a dynamic graph's kernels at 0.1 GFLOP/s."""
    from tvm.s_tir.analysis import estimate_tir_flops

    from .pipeline import get_pipeline

    options = compiled.traced.signature.options
    pipeline = get_pipeline(compiled.target, options, graph=compiled.traced.graph_name, checks=False)
    mod = pipeline.until("tvmgraph.ApplyTuningLog")(compiled.lowered.mod)
    flops = {}
    for gv, func in mod.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            try:
                if _symbolic(func):
                    func = _at_call_shapes(func, args.get(gv.name_hint))
                flops[gv.name_hint] = float(estimate_tir_flops(tvm.IRModule({"main": func}))) if func else 0.0
            except Exception:  # noqa: BLE001  (a kernel the estimator cannot walk counts no FLOPs)
                flops[gv.name_hint] = 0.0
    return flops


def _symbolic(func: tvm.tirx.PrimFunc) -> bool:
    """Whether a parameter is a buffer with a symbolic dim, or a scalar (a dynamic batch)."""
    for param in func.params:
        ty = param.ty
        if not isinstance(ty, tvm.tirx.BufferType):
            return True
        if not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape):
            return True
    return False


def _at_call_shapes(func: tvm.tirx.PrimFunc, call_args: list[Any] | None) -> tvm.tirx.PrimFunc | None:
    """`func` with its parameters bound to the shapes (and scalars) of one call; None (no FLOPs
    shown, rather than a wrong count) without them."""
    if call_args is None or len(call_args) != len(func.params):
        return None
    binding = {}
    for param, arg in zip(func.params, call_args):
        if isinstance(arg, int):
            binding[param] = tvm.tirx.IntImm("int64", arg)
        elif isinstance(arg, tuple):
            shape, dtype = arg
            binding[param] = tvm.tirx.decl_buffer([tvm.tirx.IntImm("int64", d) for d in shape], dtype)
    return func.specialize(binding)


def profile_graph(graph: Graph, args: tuple, repeat: int = 5, limits: Limits | None | bool = True) -> Profile:
    """Profile `graph(*args)` (see the module docstring); `limits=False` skips the machine's limits."""
    if repeat < 1:
        raise ValueError(f"{graph.name}: profile(repeat={repeat!r}) needs repeat >= 1")
    saved = copy.deepcopy(graph.state_dict()) if graph.training else None
    rng = torch.get_rng_state()
    try:
        graph(*args)  # compiles, or finds the entry these arguments run
        compiled = graph.compiled
        calls = []
        for _ in range(repeat):
            start = time.perf_counter()
            graph(*args)
            if compiled.device.type == "cuda":
                torch.cuda.synchronize(compiled.device)
            calls.append(time.perf_counter() - start)
        device = tvm_device(compiled.device)
        recorder = _Recorder(sync=device.sync if compiled.device.type != "cpu" else None)
        vm = relax.VirtualMachine(compiled.lib, device, memory_cfg=settings.vm_allocator)
        vm.set_instrument(recorder)
        plain = compiled._entry
        compiled._entry = vm[compiled.entry_name]
        accumulation = compiled._accumulation  # gradient accumulation's update runs on its own
        plain_update = accumulation.apply_update if accumulation is not None else None
        if accumulation is not None:
            accumulation.apply_update = vm[APPLY_UPDATE]
        try:
            for _ in range(repeat):
                recorder.new_run()
                graph(*args)
        finally:
            compiled._entry = plain
            if accumulation is not None:
                accumulation.apply_update = plain_update
    finally:
        if saved is not None:
            graph.load_state_dict(saved)
        torch.set_rng_state(rng)
    flops = _flops(compiled, recorder.args)
    kernels, runtime_s, runtime_calls = [], [], 0
    for symbol in recorder.runs[0]:
        per_run = [sum(run.get(symbol, [])) for run in recorder.runs]
        count = len(recorder.runs[0][symbol])
        # A kernel whose weight is packed once (enable_frozen_weights) does its unpacked work.
        unpacked = symbol.removesuffix(PREPACKED_SUFFIX)
        if unpacked in flops:
            kernels.append(KernelTime(symbol, count, statistics.median(per_run), flops[unpacked] * count,
                                      recorder.bytes.get(symbol, 0) * count))
        else:
            runtime_s.append(per_run)
            runtime_calls += count
    if runtime_s:
        per_run = [sum(col) for col in zip(*runtime_s)]
        kernels.append(KernelTime(RUNTIME, runtime_calls, statistics.median(per_run), 0.0, 0))
    kernels.sort(key=lambda k: -k.seconds)
    if limits is True:
        limits = _machine_limits(compiled)
    return Profile(graph.name, kernels, statistics.median(calls), limits or None)


def _machine_limits(compiled: CompiledGraph) -> Limits | None:
    from .debug import logger
    from .hardware import limits

    if compiled.device.type != "cpu":
        return None  # the GPU's limits are not measured here
    try:
        return limits()
    except Exception as e:  # noqa: BLE001  (no C compiler or OpenMP: the table goes without shares)
        logger.warning("could not measure this machine's limits (%s: %s); the profile shows no share of them",
                       type(e).__name__, e)
        return None

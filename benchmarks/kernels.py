"""Kernel benchmark: torch eager vs TVM's default build vs TVM with ApplyCPUSchedules.

    python -m benchmarks.kernels [--cases mlp,train,cnn,transformer,transformer_train,mlp_large] [--only NAME,...]
                                 [--rounds 7] [--seconds 0.05] [--no-default]

One line per kernel of the reference workloads (MLP 784-1024-1024-10, MobileNetV2-style CNN
at 3x32x32 batch 64, 2-layer d=256 transformer at batch 8 x seq 128, and their training-step
kernels; `mlp_large`, not run by default: 256 x 4096 x 4096 products), as the frontend and
autodiff produce them. Each kernel is a small Relax function,
lowered with tvmgraph's default pipeline with and without `ApplyCPUSchedules`. Timings are
the minimum and median over `rounds` rounds that rotate through the three engines (other jobs
on the machine shift all three alike); GFLOP/s counts one multiply-add as 2 FLOP and is left
out for memory-bound kernels. Ratios above 1.00 mean the scheduled kernel is faster.

"of limit" is each engine's best time as a share of this machine's limit (tvmgraph/hardware.py,
measured once and cached; `python -m benchmarks.peak` measures again): a kernel whose FLOPs per
byte of its arguments and result reach the ridge point (FMA peak / bandwidth) is given as a
share of the fp32 FMA peak (FMA), any other as a share of the copy bandwidth (BW), the rule
`graph.profile` uses. The copy streams 256 MiB through memory: a kernel whose data stays in
cache can pass 100% of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

from tvmgraph.hardware import Limits, limits
from tvmgraph.codegen import build_executable
from tvmgraph.openmp_launch import load_library
from tvmgraph.target import target_for
from tvmgraph.profile import KernelTime
from tvmgraph.schedules import ApplyCPUSchedules

# The target a graph compiles for on this machine (its LLVM opt-level included).
TARGET = target_for(torch.device("cpu"))
Builder = Callable[..., relax.Expr]


@dataclass(frozen=True)
class Kernel:
    """One benchmark: input shapes, the Relax body, the torch reference, and its FLOPs."""

    name: str
    group: str
    shapes: tuple[tuple[int, ...], ...]
    relax_body: Builder
    torch_fn: Callable[..., torch.Tensor]
    flops: float = 0.0


def _mm(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def _linear(x, w, b):
    return relax.op.nn.relu(relax.op.add(relax.op.matmul(x, relax.op.permute_dims(w)), b))


def _matmul_bias_relu(x, w_t, b):
    return relax.op.nn.relu(relax.op.add(relax.op.matmul(x, w_t), b))


def _conv(stride: int, groups: int, padding: int):
    return lambda x, w: relax.op.nn.conv2d(x, w, strides=stride, padding=padding, groups=groups)


def _conv_flops(n, cin, cout, k, hw_out, groups):
    return 2.0 * n * cout * hw_out * hw_out * (cin // groups) * k * k


def _sgd(p, g, buf, lr, mom):
    new_buf = relax.op.add(relax.op.multiply(mom, buf), g)
    return relax.op.subtract(p, relax.op.multiply(lr, new_buf))


def _sgd_torch(p, g, buf, lr, mom):
    return p - lr * (mom * buf + g)


KERNELS = [
    # ---- MLP 784-1024-1024-10, inference -----------------------------------------------------
    Kernel("linear+relu 64x784->1024", "mlp", ((64, 784), (1024, 784), (1024,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(64, 1024, 784)),
    Kernel("linear+relu 64x1024->1024", "mlp", ((64, 1024), (1024, 1024), (1024,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(64, 1024, 1024)),
    Kernel("linear 64x1024->10", "mlp", ((64, 1024), (10, 1024), (10,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(64, 10, 1024)),
    Kernel("linear+relu 1x1024->1024", "mlp", ((1, 1024), (1024, 1024), (1024,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(1, 1024, 1024)),
    # The same products with W already transposed (what the matmul kernel alone does).
    Kernel("matmul+bias+relu 64x784x1024", "mlp", ((64, 784), (784, 1024), (1024,)),
           _matmul_bias_relu, lambda x, w, b: F.relu(x @ w + b), _mm(64, 1024, 784)),
    Kernel("matmul+bias+relu 64x1024x1024", "mlp", ((64, 1024), (1024, 1024), (1024,)),
           _matmul_bias_relu, lambda x, w, b: F.relu(x @ w + b), _mm(64, 1024, 1024)),
    # The suite's MLP as nn.Linear holds it: W[out, in], read across its rows (x @ W.T), the
    # layout the graph's inference kernels run (the rows above store W transposed).
    Kernel("linear+relu 64x784->1024", "mlp", ((64, 784), (1024, 784), (1024,)),
           _linear, lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(64, 1024, 784)),
    Kernel("linear+relu 64x1024->1024", "mlp", ((64, 1024), (1024, 1024), (1024,)),
           _linear, lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(64, 1024, 1024)),
    Kernel("matmul+bias+relu 1x1024x1024", "mlp", ((1, 1024), (1024, 1024), (1024,)),
           _matmul_bias_relu, lambda x, w, b: F.relu(x @ w + b), _mm(1, 1024, 1024)),
    # ---- large MLP (3 x 4096, batch 256): B panels of K x 64 floats outgrow the L2 cache ------
    Kernel("linear+relu 256x4096->4096", "mlp_large", ((256, 4096), (4096, 4096), (4096,)),
           _linear, lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(256, 4096, 4096)),
    Kernel("dX = dY W 256x4096 (K=4096)", "mlp_large", ((256, 4096), (4096, 4096)),
           lambda dy, w: relax.op.matmul(dy, w), lambda dy, w: dy @ w, _mm(256, 4096, 4096)),
    # At batch 1 both read 64 MiB of W once: bound by memory bandwidth.
    Kernel("linear+relu 1x4096->4096", "mlp_large", ((1, 4096), (4096, 4096), (4096,)),
           _linear, lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(1, 4096, 4096)),
    Kernel("dX = dY W 1x4096 (K=4096)", "mlp_large", ((1, 4096), (4096, 4096)),
           lambda dy, w: relax.op.matmul(dy, w), lambda dy, w: dy @ w, _mm(1, 4096, 4096)),
    # ---- MLP training step -------------------------------------------------------------------
    Kernel("dW = dY^T X 1024x784 (K=64)", "train", ((64, 1024), (64, 784)),
           lambda dy, x: relax.op.matmul(relax.op.permute_dims(dy), x),
           lambda dy, x: dy.T @ x, _mm(1024, 784, 64)),
    Kernel("dX = dY W 64x784 (K=1024)", "train", ((64, 1024), (1024, 784)),
           lambda dy, w: relax.op.matmul(dy, w), lambda dy, w: dy @ w, _mm(64, 784, 1024)),
    Kernel("db = sum(dY, 0) 64x1024", "train", ((64, 1024),),
           lambda dy: relax.op.sum(dy, axis=[0]), lambda dy: dy.sum(0)),
    Kernel("SGD momentum 1024x784", "train",
           ((1024, 784), (1024, 784), (1024, 784), (), ()), _sgd, _sgd_torch),
    # ---- CNN (MobileNetV2-style, batch 64) ---------------------------------------------------
    Kernel("conv 3x3 s1 3->32 @32", "cnn", ((64, 3, 32, 32), (32, 3, 3, 3)), _conv(1, 1, 1),
           lambda x, w: F.conv2d(x, w, padding=1), _conv_flops(64, 3, 32, 3, 32, 1)),
    Kernel("conv 1x1 16->96 @32", "cnn", ((64, 16, 32, 32), (96, 16, 1, 1)), _conv(1, 1, 0),
           lambda x, w: F.conv2d(x, w), _conv_flops(64, 16, 96, 1, 32, 1)),
    Kernel("conv 1x1 144->24 @16", "cnn", ((64, 144, 16, 16), (24, 144, 1, 1)), _conv(1, 1, 0),
           lambda x, w: F.conv2d(x, w), _conv_flops(64, 144, 24, 1, 16, 1)),
    Kernel("dwconv 3x3 s1 144 @16", "cnn", ((64, 144, 16, 16), (144, 1, 3, 3)),
           _conv(1, 144, 1), lambda x, w: F.conv2d(x, w, padding=1, groups=144),
           _conv_flops(64, 144, 144, 3, 16, 144)),
    Kernel("dwconv 3x3 s2 96 @32->16", "cnn", ((64, 96, 32, 32), (96, 1, 3, 3)),
           _conv(2, 96, 1), lambda x, w: F.conv2d(x, w, stride=2, padding=1, groups=96),
           _conv_flops(64, 96, 96, 3, 16, 96)),
    Kernel("dwconv 3x3 s1 384 @4", "cnn", ((64, 384, 4, 4), (384, 1, 3, 3)),
           _conv(1, 384, 1), lambda x, w: F.conv2d(x, w, padding=1, groups=384),
           _conv_flops(64, 384, 384, 3, 4, 384)),
    Kernel("batchnorm stats mean/var 64x96x32x32", "cnn", ((64, 96, 32, 32),),
           lambda x: relax.op.variance(x, axis=[0, 2, 3]), lambda x: x.var((0, 2, 3), unbiased=False)),
    Kernel("relu6 64x96x32x32", "cnn", ((64, 96, 32, 32),),
           lambda x: relax.op.clip(x, 0.0, 6.0), lambda x: x.clamp(0, 6)),
    # ---- transformer (d_model 256, 4 heads, seq 128, batch 8) --------------------------------
    Kernel("linear 1024x256->256", "transformer", ((1024, 256), (256, 256), (256,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(1024, 256, 256)),
    Kernel("linear 1024x256->1024", "transformer", ((1024, 256), (1024, 256), (1024,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(1024, 1024, 256)),
    Kernel("linear 1024x1024->256", "transformer", ((1024, 1024), (256, 1024), (256,)), _linear,
           lambda x, w, b: F.relu(F.linear(x, w, b)), _mm(1024, 256, 1024)),
    Kernel("bmm QK^T 32x128x128 (K=64)", "transformer", ((32, 128, 64), (32, 128, 64)),
           lambda q, k: relax.op.matmul(q, relax.op.permute_dims(k, [0, 2, 1])),
           lambda q, k: q @ k.transpose(1, 2), _mm(32 * 128, 128, 64)),
    Kernel("bmm PV 32x128x64 (K=128)", "transformer", ((32, 128, 128), (32, 128, 64)),
           relax.op.matmul, lambda p, v: p @ v, _mm(32 * 128, 64, 128)),
    Kernel("softmax 32x128x128", "transformer", ((32, 128, 128),),
           lambda x: relax.op.nn.softmax(x, axis=-1), lambda x: torch.softmax(x, -1)),
    Kernel("layer_norm 1024x256", "transformer", ((1024, 256), (256,), (256,)),
           lambda x, g, b: relax.op.nn.layer_norm(x, g, b, axes=[-1]),
           lambda x, g, b: F.layer_norm(x, (256,), g, b)),
    Kernel("gelu 1024x1024", "transformer", ((1024, 1024),), relax.op.nn.gelu, F.gelu),
    Kernel("transpose 1024x1024 (weight)", "transformer", ((1024, 1024),),
           relax.op.permute_dims, lambda w: w.T.contiguous()),
    # ---- transformer training step: the feed-forward's gradients over 1024 tokens -------------
    Kernel("dW1 = dH^T X 1024x256 (K=1024)", "transformer_train", ((1024, 1024), (1024, 256)),
           lambda dh, x: relax.op.matmul(relax.op.permute_dims(dh), x),
           lambda dh, x: dh.T @ x, _mm(1024, 256, 1024)),
    Kernel("dX1 = dH W1 1024x256 (K=1024)", "transformer_train", ((1024, 1024), (1024, 256)),
           lambda dh, w: relax.op.matmul(dh, w), lambda dh, w: dh @ w, _mm(1024, 256, 1024)),
    Kernel("dW2 = dY^T H 256x1024 (K=1024)", "transformer_train", ((1024, 256), (1024, 1024)),
           lambda dy, h: relax.op.matmul(relax.op.permute_dims(dy), h),
           lambda dy, h: dy.T @ h, _mm(256, 1024, 1024)),
    Kernel("dH = dY W2 1024x1024 (K=256)", "transformer_train", ((1024, 256), (256, 1024)),
           lambda dy, w: relax.op.matmul(dy, w), lambda dy, w: dy @ w, _mm(1024, 1024, 256)),
    Kernel("dWqkv = dQKV^T X 768x256 (K=1024)", "transformer_train", ((1024, 768), (1024, 256)),
           lambda d, x: relax.op.matmul(relax.op.permute_dims(d), x),
           lambda d, x: d.T @ x, _mm(768, 256, 1024)),
]


def _module(kernel: Kernel) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    params = [relax.Var(f"a{i}", relax.TensorType(shape, "float32"))
              for i, shape in enumerate(kernel.shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(kernel.relax_body(*params))
        bb.emit_func_output(out)
    return bb.get()


def _build(mod: tvm.IRModule, schedule: bool) -> relax.VirtualMachine:
    """tvmgraph's default llvm pipeline, with or without the CPU schedules."""
    T = relax.transform
    # FuseTransposeMatmul: a graph's x @ w.T reads w in place (FuseEpilogue), with no transpose
    # kernel of its own.
    passes = [T.FuseTransposeMatmul(), T.LegalizeOps(), T.AnnotateTIROpPattern(), T.FoldConstant(), T.FuseOps(),
              T.FuseTIR(), *([ApplyCPUSchedules()] if schedule else []),
              T.RewriteDataflowReshape(), T.ToNonDataflow(), T.RemovePurityChecking(),
              T.CallTIRRewrite(), T.StaticPlanBlockMemory(), T.LowerAllocTensor(),
              T.KillAfterLastUse(), T.LowerRuntimeBuiltin(), T.ComputePrimValue(),
              T.VMShapeLower(), T.AttachGlobalSymbol()]
    with TARGET:
        mod = tvm.transform.Sequential(passes)(mod)
    # "pooled": the allocator tvmgraph runs with (config.settings.vm_allocator); the default
    # one would page-fault every output in afresh.
    # Scheduled: built as a graph's program is (tvmgraph's codegen at the graph's LLVM
    # opt-level, more for the kernels that ask for it, no argument checks); stock: tvm.compile.
    if schedule:
        executable = build_executable(mod, TARGET, kernel_checks=False)
    else:
        executable = tvm.compile(mod, target=TARGET, relax_pipeline=None)
    # Exported and loaded as a graph's program is, so that its kernels run on torch's OpenMP
    # threads (tvmgraph/openmp_launch.py) as they do in a graph.
    path = Path(_LIBRARIES.name) / f"kernel{len(os.listdir(_LIBRARIES.name))}.so"
    executable.export_library(str(path))
    return relax.VirtualMachine(load_library(path), tvm.cpu(), memory_cfg="pooled")


_LIBRARIES = tempfile.TemporaryDirectory(prefix="tvmgraph-kernels-")


def timer(fn: Callable[[], object], seconds: float) -> Callable[[], float]:
    """A sampler returning seconds per call, each sample looping for about `seconds`."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    reps = max(1, int(seconds / once))

    def sample() -> float:
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    return sample


def moved_bytes(kernel: Kernel) -> int:
    """The bytes the kernel must move at least: its arguments read and its result written once."""
    with torch.no_grad():
        result = kernel.torch_fn(*(torch.zeros(s) for s in kernel.shapes))
    return 4 * (sum(int(np.prod(s)) for s in kernel.shapes) + result.numel())


def limit_share(kernel: Kernel, seconds: float, nbytes: int, machine: Limits) -> str:
    """One engine's time as a share of the machine's limit, e.g. "68% FMA" or "41% BW"."""
    share = KernelTime(kernel.name, 1, seconds, kernel.flops, nbytes).limit_share(machine)
    return f"{share[0] * 100:.0f}% {share[1]}" if share else "-"


def run(kernel: Kernel, rounds: int, seconds: float, with_default: bool) -> dict[str, list[float]]:
    """Interleaved timings (seconds per call) of torch, TVM default and TVM scheduled."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype("float32") for s in kernel.shapes]
    tensors = [torch.from_numpy(a) for a in arrays]
    tvm_args = [tvm.runtime.tensor(a) for a in arrays]
    samplers: dict[str, Callable[[], float]] = {}
    with torch.no_grad():
        samplers["torch"] = timer(lambda: kernel.torch_fn(*tensors), seconds)
    engines = (["default"] if with_default else []) + ["scheduled"]
    for engine in engines:
        vm = _build(_module(kernel), schedule=engine == "scheduled")
        result = vm["main"](*tvm_args)
        expected = kernel.torch_fn(*tensors).numpy()
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-3, atol=1e-3)
        samplers[engine] = timer(lambda vm=vm: vm["main"](*tvm_args), seconds)
    times: dict[str, list[float]] = {name: [] for name in samplers}
    for _ in range(rounds):
        for name, sample in samplers.items():
            times[name].append(sample())
    return times


def main() -> None:
    """Parse options, run the selected kernels, print one table line per kernel."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlp,train,cnn,transformer")
    parser.add_argument("--only", default="", help="comma-separated substrings of kernel names")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.05, help="time per sample")
    parser.add_argument("--no-default", action="store_true", help="skip TVM's default build")
    args = parser.parse_args()
    groups = args.cases.split(",")
    only = [s for s in args.only.split(",") if s]
    machine = limits()
    print(f"target {TARGET.attrs['mcpu']}, torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads; min / median of {args.rounds} interleaved rounds")
    print(f"limits of {machine.cpu} ({machine.threads} threads): fp32 FMA peak "
          f"{machine.fma_gflops:.1f} GFLOP/s, copy {machine.bandwidth_gbs:.1f} GB/s")
    print(f"{'kernel':38s} {'torch ms':>17s} {'TVM default ms':>17s} {'scheduled ms':>17s} "
          f"{'GFLOP/s t/d/s':>17s} {'of limit: torch':>15s} {'scheduled':>10s} "
          f"{'vs torch':>8s} {'vs default':>10s}")
    for kernel in KERNELS:
        if kernel.group not in groups or (only and not any(o in kernel.name for o in only)):
            continue
        times = run(kernel, args.rounds, args.seconds, not args.no_default)
        best = {k: min(v) for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in times.items()}

        def cell(name: str) -> str:
            return f"{best[name]*1e3:7.3f} /{med[name]*1e3:8.3f}" if name in best else "-"

        rate = "/".join(f"{kernel.flops / best[k] / 1e9:.0f}" if kernel.flops else "-"
                        for k in ("torch", "default", "scheduled") if k in best)
        vs_default = f"{best['default'] / best['scheduled']:9.1f}x" if "default" in best else "-"
        nbytes = moved_bytes(kernel)
        print(f"{kernel.name:38s} {cell('torch'):>17s} {cell('default'):>17s} "
              f"{cell('scheduled'):>17s} {rate:>17s} "
              f"{limit_share(kernel, best['torch'], nbytes, machine):>15s} "
              f"{limit_share(kernel, best['scheduled'], nbytes, machine):>10s} "
              f"{best['torch'] / best['scheduled']:7.2f}x {vs_default:>10s}", flush=True)


if __name__ == "__main__":
    main()

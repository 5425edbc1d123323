"""LongReduction and ShortReduction (tvmgraph/schedules/gpu_long_reduction.py): CUDA kernels of
convolution weight and input gradients and of batch statistics, compile-only (their numbers
against eager on a GPU: tests/gpu/test_cuda.py)."""

from __future__ import annotations

import re
import shutil

import pytest
import tvm
from tvm import te, topi
from tvm.s_tir import dlight as dl

from tvmgraph.errors import PassError
from tvmgraph.pipeline import run_pass
from tvmgraph.schedules.apply_gpu import ApplyGPUSchedules
from tvmgraph.schedules.gpu_long_reduction import MAX_THREADS, LongReduction, ShortReduction

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _pointwise_weight_grad(n=64, cin=16, cout=96, hw=32):
    """dW of a 1x1 convolution: every output sums over the batch's n * hw * hw pixels."""
    x = te.placeholder((n, cin, hw, hw), name="x")
    dy = te.placeholder((n, cout, hw, hw), name="dy")
    b, h, w = te.reduce_axis((0, n)), te.reduce_axis((0, hw)), te.reduce_axis((0, hw))
    dw = te.compute((cout, cin), lambda o, i: te.sum(x[b, i, h, w] * dy[b, o, h, w], axis=[b, h, w]), name="dw")
    return te.create_prim_func([x, dy, dw])


def _depthwise_weight_grad(n=16, c=32, hw=32):
    """dW of a 3x3 depthwise convolution with padding 1: the padded input is a block to inline."""
    x = te.placeholder((n, c, hw, hw), name="x")
    dy = te.placeholder((n, c, hw, hw), name="dy")
    padded = topi.nn.pad(x, (0, 0, 1, 1), (0, 0, 1, 1))
    b, h, w = te.reduce_axis((0, n)), te.reduce_axis((0, hw)), te.reduce_axis((0, hw))
    dw = te.compute((c, 3, 3), lambda ch, i, j: te.sum(padded[b, ch, h + i, w + j] * dy[b, ch, h, w],
                                                       axis=[b, h, w]), name="dw")
    return te.create_prim_func([x, dy, dw])


def _batch_norm(n=64, c=16, hw=32):
    """Training batch norm: two sums per channel (mean, variance), then the normalization; the
    statistics are outputs too (for the running averages), as in TOPI's batch_norm, which
    dlight's GeneralReduction declines."""
    x = te.placeholder((n, c, hw, hw), name="x")
    count = float(n * hw * hw)
    axes = lambda: [te.reduce_axis((0, n)), te.reduce_axis((0, hw)), te.reduce_axis((0, hw))]  # noqa: E731
    b, h, w = axes()
    mean = te.compute((c,), lambda ch: te.sum(x[b, ch, h, w] / count, axis=[b, h, w]), name="mean")
    b2, h2, w2 = axes()
    var = te.compute((c,), lambda ch: te.sum((x[b2, ch, h2, w2] - mean[ch]) * (x[b2, ch, h2, w2] - mean[ch])
                                             / count, axis=[b2, h2, w2]), name="var")
    y = te.compute(x.shape, lambda i, ch, j, k: (x[i, ch, j, k] - mean[ch]) * te.rsqrt(var[ch] + 1e-5), name="y")
    return te.create_prim_func([x, y, mean, var])


def _depthwise_input_grad_relu6(n=8, c=32, hw=16):
    """A depthwise 3x3 input gradient (9 taps per pixel) and the ReLU6 gradient that consumes it."""
    dy = te.placeholder((n, c, hw, hw), name="dy")
    weight = te.placeholder((c, 3, 3), name="weight")
    x = te.placeholder((n, c, hw, hw), name="x")
    padded = topi.nn.pad(dy, (0, 0, 1, 1), (0, 0, 1, 1))
    i, j = te.reduce_axis((0, 3)), te.reduce_axis((0, 3))
    dx = te.compute((n, c, hw, hw), lambda b, ch, h, w: te.sum(padded[b, ch, h + i, w + j] * weight[ch, 2 - i, 2 - j],
                                                                axis=[i, j]), name="dx")
    gated = te.compute(dx.shape, lambda *idx: te.if_then_else(te.all(x(*idx) > 0, x(*idx) < 6), dx(*idx), 0.0),
                       name="gated")
    return te.create_prim_func([dy, weight, x, gated])


def _matmul(m, n, k):
    a, b = te.placeholder((m, k), name="a"), te.placeholder((k, n), name="b")
    r = te.reduce_axis((0, k))
    return te.create_prim_func([a, b, te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r))])


def _channel_sum(n=64, c=96, hw=32):
    """A bias gradient: one long sum of one tensor, dlight Reduction's."""
    dy = te.placeholder((n, c, hw, hw), name="dy")
    b, h, w = te.reduce_axis((0, n)), te.reduce_axis((0, hw)), te.reduce_axis((0, hw))
    return te.create_prim_func([dy, te.compute((c,), lambda ch: te.sum(dy[b, ch, h, w], axis=[b, h, w]))])


def _layer_norm(rows=512, features=512):
    """Two sums along each row (mean, variance), then the row normalized: GeneralReduction's."""
    x = te.placeholder((rows, features), name="x")
    k, k2 = te.reduce_axis((0, features)), te.reduce_axis((0, features))
    mean = te.compute((rows,), lambda r: te.sum(x[r, k] / features, axis=k), name="mean")
    var = te.compute((rows,), lambda r: te.sum((x[r, k2] - mean[r]) * (x[r, k2] - mean[r]) / features, axis=k2),
                     name="var")
    y = te.compute(x.shape, lambda r, f: (x[r, f] - mean[r]) * te.rsqrt(var[r] + 1e-5), name="y")
    return te.create_prim_func([x, y])


def _bindings(func) -> list[tuple[str, int]]:
    """Every thread-bound loop, (tag, extent), in order."""
    return [(tag, int(extent)) for extent, tag in
            re.findall(r'T\.thread_binding\((?:T\.int64\()?(\d+)\)?, thread="([a-zA-Z.]+)"', func.script())]


def _kernels(func) -> list[dict[str, int]]:
    """The launch of each kernel: {thread tag: extent}, in order."""
    kernels: list[dict[str, int]] = []
    for tag, extent in _bindings(func):
        if tag == "blockIdx.x":
            kernels.append({})
        kernels[-1][tag] = int(extent)
    return kernels


def _blocks(func) -> list[str]:
    return [b for b in re.findall(r'T\.sblock\("(\w+)"', func.script()) if b != "root"]


@pytest.mark.parametrize("make, outputs", [(_pointwise_weight_grad, 96 * 16), (_depthwise_weight_grad, 32 * 9)],
                         ids=["pointwise", "depthwise"])
def test_weight_gradient_one_block_per_output_threads_across_the_sum(make, outputs) -> None:
    sch = LongReduction().apply(make(), CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    assert _kernels(scheduled) == [{"blockIdx.x": outputs, "threadIdx.x": MAX_THREADS}]
    # The pad is inlined: one block is left, and its thread loop runs along the sum.
    assert _blocks(scheduled) == ["dw"]
    assert re.search(r"T\.axis\.reduce\([^\n]*threadIdx|T\.axis\.reduce\([^\n]*fused_1", scheduled.script())


def test_batch_norm_statistics_a_block_per_channel_then_a_thread_per_pixel() -> None:
    sch = LongReduction().apply(_batch_norm(), CUDA, False)
    assert sch is not None
    # 16 channels (few): 1024 threads per sum of 64 * 32 * 32 terms.
    assert _kernels(sch.mod["main"]) == [{"blockIdx.x": 16, "threadIdx.x": 1024},
                                         {"blockIdx.x": 16, "threadIdx.x": 1024},
                                         {"blockIdx.x": 64 * 16 * 32 * 32 // 256, "threadIdx.x": 256}]


def test_depthwise_input_gradient_a_thread_per_pixel_with_its_consumer() -> None:
    sch = ShortReduction().apply(_depthwise_input_grad_relu6(), CUDA, False)
    assert sch is not None
    scheduled = sch.mod["main"]
    assert _kernels(scheduled) == [{"blockIdx.x": 8 * 32 * 16 * 16 // 256, "threadIdx.x": 256}]
    assert _blocks(scheduled) == ["dx_init", "dx_update", "gated"]
    assert 'scope="local"' in scheduled.script()  # the 9-tap sum stays in a register
    assert LongReduction().apply(_depthwise_input_grad_relu6(), CUDA, False) is None


@pytest.mark.parametrize("func", [_matmul(512, 512, 512), _matmul(64, 64, 256), _channel_sum(), _layer_norm()],
                         ids=["many-outputs", "medium-sum", "one-tensor-sum", "layer-norm"])
def test_leaves_matmuls_and_plain_sums_to_dlight(func) -> None:
    assert LongReduction().apply(func, CUDA, False) is None
    assert ShortReduction().apply(func, CUDA, False) is None


def test_rule_order_sends_each_kind_to_its_rule() -> None:
    """In ApplyGPUSchedules' order the weight gradient is not dlight Matmul's, the bias gradient
    stays dlight Reduction's, the matmul dlight Matmul's."""
    assert dl.gpu.Matmul().apply(_pointwise_weight_grad(), CUDA, False) is not None  # it would take it
    mod = ApplyGPUSchedules()(tvm.IRModule({name: f.with_attr("global_symbol", name).with_attr("target", CUDA)
                                            for name, f in [("dw", _pointwise_weight_grad()),
                                                            ("bias", _channel_sum()),
                                                            ("mm", _matmul(512, 512, 512))]}))
    assert _kernels(mod["dw"]) == [{"blockIdx.x": 96 * 16, "threadIdx.x": MAX_THREADS}]
    expected = {name: tvm.IRModule({"main": f.with_attr("target", CUDA)}) for name, f in
                [("bias", _channel_sum()), ("mm", _matmul(512, 512, 512))]}
    assert _bindings(mod["bias"]) == _bindings(dl.gpu.Reduction().apply(expected["bias"]["main"], CUDA, False).mod["main"])
    assert _bindings(mod["mm"]) == _bindings(dl.gpu.Matmul().apply(expected["mm"]["main"], CUDA, False).mod["main"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_compiles_to_warp_shuffle_sums_and_register_taps() -> None:
    funcs = {"dw": _depthwise_weight_grad(), "bn": _batch_norm(), "dx": _depthwise_input_grad_relu6()}
    mod = ApplyGPUSchedules()(tvm.IRModule({name: f.with_attr("global_symbol", name).with_attr("target", CUDA)
                                            for name, f in funcs.items()}))
    source = tvm.compile(mod, target=CUDA).mod.imports[0].inspect_source()
    assert "__launch_bounds__(1024)" in source and "__shfl_down_sync" in source
    assert "dx_local_ptr[1]" in source or re.search(r"float \w*local\w*\[1\]", source)


def _host_loop() -> tvm.tirx.PrimFunc:
    """A kernel as a bare loop nest without blocks (as te.extern writes one): no rule can bind it."""
    from tvm.script import tirx as T

    @T.prim_func
    def host_loop(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
        for i in range(64):
            b[i] = a[i] + T.float32(1)

    return host_loop


def test_a_kernel_no_rule_binds_to_threads_is_an_error_not_host_code() -> None:
    """Unbound, it would be compiled for the host and run there on device pointers (a segfault
    in the first call); the compile stops instead, naming the kernel."""
    mod = tvm.IRModule({"host_loop": _host_loop()})
    with CUDA, pytest.raises(RuntimeError, match="host_loop writes memory outside any GPU thread binding"):
        ApplyGPUSchedules()(mod)
    # In a graph's pipeline the PassError that wraps it keeps that reason, not the docs link.
    with CUDA, pytest.raises(PassError, match="raised RuntimeError: kernel host_loop writes memory"):
        run_pass(ApplyGPUSchedules(), mod, "G", check=True)


def test_the_host_kernel_check_sees_thread_bindings() -> None:
    from tvmgraph.schedules.apply_gpu import runs_on_host

    assert runs_on_host(_host_loop())
    with CUDA:
        bound = ApplyGPUSchedules()(tvm.IRModule({"f": _pointwise_weight_grad()}))["f"]
    assert not runs_on_host(bound)

"""FuseModelUpdate: a param group's update function becomes one in-place update kernel."""

from __future__ import annotations

import shutil

import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from relay_passes.fuse_model_update import FuseModelUpdate, build_update_kernel
from tvmgraph.training.optimizers import RULES
from tvmgraph.training.train_step import update_function

CPU = tvm.target.Target({"kind": "llvm"})


def sgd_flags(**overrides: bool) -> dict[str, bool]:
    return {"nesterov": False, "maximize": False, "momentum": True, "weight_decay": False,
            "dampening": False, **overrides}


def module_with_update(rule: str, flags: dict[str, bool], shapes: list[tuple[int, ...]],
                       skippable: bool = False) -> tvm.IRModule:
    """`main(args...)` calls the group's update function, as train_step does."""
    types = [relax.TensorType(s, "float32") for s in shapes]
    update = update_function(RULES[rule], flags, types, "update_0", skippable).without_attr("global_symbol")
    bb = relax.BlockBuilder()
    gv = bb.add_func(update, "update_0")
    params = [relax.Var(p.name, p.ty) for p in update.params]
    with bb.function("main", params):
        out = bb.emit(relax.Call(gv, params))
        bb.emit_func_output(out)
    return bb.get()


def test_update_call_becomes_one_call_tir_inplace() -> None:
    """Before: main calls update_0 (Relax ops). After: one in-place kernel call over the same
    arguments, overwriting momentum_buffer0 (arg 3) and p0 (arg 1); update_0 is gone."""
    before = module_with_update("sgd", sgd_flags(), [(4, 8)])
    with CPU:
        after = FuseModelUpdate()(before)

    @I.ir_module
    class Expected:
        @T.prim_func(private=True)
        def update_0_kernel(hyper: T.Buffer((5,), "float64"), p0: T.Buffer((4, 8), "float32"),
                            g0: T.Buffer((4, 8), "float32"), momentum_buffer0: T.Buffer((4, 8), "float32")):
            T.evaluate(0)  # stub: only the Relax side is compared here

        @R.function
        def main(hyper: R.Tensor((5,), "float64"), p0: R.Tensor((4, 8), "float32"),
                 g0: R.Tensor((4, 8), "float32"), momentum_buffer0: R.Tensor((4, 8), "float32")):
            cls = Expected
            gv = R.call_tir_inplace(cls.update_0_kernel, (hyper, p0, g0, momentum_buffer0), [3, 1],
                                    out_ty=[R.Tensor((4, 8), "float32"), R.Tensor((4, 8), "float32")])
            return gv

    assert sorted(gv.name_hint for gv in after.get_global_vars()) == ["main", "update_0_kernel"]
    tvm.ir.assert_structural_equal(after["main"], Expected["main"], map_free_vars=True)
    kernel = after["update_0_kernel"]
    assert [p.name for p in kernel.params] == ["hyper", "p0", "g0", "momentum_buffer0"]  # no output buffers
    assert bool(kernel.attrs["tir.is_scheduled"])


def torch_sgd_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """One torch.optim.SGD step from state `buf` (a parameter that has stepped before)."""
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.SGD([param], **options)
    opt.state[param]["momentum_buffer"] = buf.clone()
    param.grad = g.clone()
    opt.step()
    return param.detach(), opt.state[param]["momentum_buffer"]


@pytest.mark.parametrize("options", [
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.5, maximize=True),
], ids=["momentum", "nesterov_wd", "maximize"])
@pytest.mark.parametrize("shape", [(1024, 784), (8, 3, 3, 3), (10,), (37,)], ids=["big", "conv3x3", "bias", "odd"])
def test_kernel_matches_torch_sgd_and_writes_in_place(options: dict, shape: tuple[int, ...]) -> None:
    rule = RULES["sgd"]
    group = {"nesterov": False, "maximize": False, "dampening": 0, "weight_decay": 0, **options}
    flags = rule.flags(group)
    kernel, inplace = build_update_kernel(rule, flags, [relax.TensorType(shape, "float32")], CPU)
    run = tvm.compile(tvm.IRModule({"k": kernel.with_attr("global_symbol", "k")}), target=CPU)["k"]
    p, g, buf = torch.randn(shape), torch.randn(shape), torch.randn(shape)
    expected_p, expected_buf = torch_sgd_step(p, g, buf, **options)
    hyper = torch.tensor(rule.hyper_vector(group, [False]), dtype=torch.float64)
    run(hyper, p, g, buf)  # p and buf are updated in their own memory
    torch.testing.assert_close(buf, expected_buf, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(p, expected_p, atol=1e-6, rtol=1e-5)
    assert inplace == [3, 1]


def test_several_parameters_in_one_kernel_and_the_report() -> None:
    shapes = [(16, 8), (16,), (4, 16)]
    messages: list[str] = []
    with CPU:
        after = FuseModelUpdate(report=messages.append)(module_with_update("sgd", sgd_flags(), shapes))
    kernels = [gv for gv, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1
    assert messages == ["FuseModelUpdate: 1 in-place update kernel(s): update_0 (3 parameters)"]


def test_big_parameters_get_kernels_of_their_own() -> None:
    """A parameter of OWN_KERNEL_MIN elements or more is updated by its own kernel (which can
    run as soon as its gradient exists); the small ones share one."""
    shapes = [(16, 8), (512, 256), (16,), (1024, 128)]
    messages: list[str] = []
    with CPU:
        after = FuseModelUpdate(report=messages.append)(module_with_update("sgd", sgd_flags(), shapes))
    kernels = {gv.name_hint: f for gv, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    assert sorted(kernels) == ["update_0_kernel0", "update_0_kernel1", "update_0_kernel2"]
    sizes = sorted(len(f.params) for f in kernels.values())
    assert sizes == [1 + 3, 1 + 3, 1 + 2 * 3]  # hyper, then (p, g, momentum) per parameter
    assert messages == ["FuseModelUpdate: 3 in-place update kernel(s): update_0 (4 parameters in 3 kernels)"]
    calls = after["main"].script().count("R.call_tir_inplace(")
    assert calls == 3


def torch_adam_step(p, g, state, **options):
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], **options) if options.pop("adamw", False) else torch.optim.Adam([param], **options)
    opt.state[param].update({k: v.clone() for k, v in state.items()})
    param.grad = g.clone()
    opt.step()
    return param.detach(), opt.state[param]


@pytest.mark.parametrize("options", [dict(lr=1e-2), dict(lr=1e-2, amsgrad=True, weight_decay=1e-2),
                                     dict(lr=1e-2, weight_decay=0.1, adamw=True)], ids=["adam", "amsgrad_l2", "adamw"])
def test_adam_kernel_and_relax_step_match_torch(options: dict) -> None:
    """Adam's tensors are updated in place by the kernel; its scalar `step` by Relax ops."""
    adamw = options.get("adamw", False)
    rule = RULES["adamw" if adamw else "adam"]
    torch_options = {k: v for k, v in options.items() if k != "adamw"}
    group = {"amsgrad": False, "maximize": False, "weight_decay": 0, "betas": (0.9, 0.999), "eps": 1e-8,
             "decoupled_weight_decay": adamw, **torch_options}
    flags = rule.flags(group)
    shape = (7, 16)
    before = module_with_update(rule.name, flags, [shape])
    with CPU:
        after = FuseModelUpdate()(before)
    run = relax.VirtualMachine(tvm.compile(after, target=CPU), tvm.cpu())["main"]
    p, g = torch.randn(shape), torch.randn(shape)
    state = {"step": torch.tensor(3.0), "exp_avg": torch.randn(shape) * 0.1, "exp_avg_sq": torch.rand(shape) * 0.1}
    if flags["amsgrad"]:
        state["max_exp_avg_sq"] = state["exp_avg_sq"] + 0.05
    expected_p, expected_state = torch_adam_step(p, g, state, adamw=adamw, **torch_options)
    hyper = torch.tensor(rule.hyper_vector(group, [False]), dtype=torch.float64)
    args = [p.clone(), g] + [state[k].clone() for k in rule.state_keys(flags)]
    results = run(hyper, *args)
    keys = [*rule.state_keys(flags), "param"]
    got = dict(zip(keys, results))
    torch.testing.assert_close(got["param"], expected_p, atol=1e-6, rtol=1e-5)
    for key in rule.state_keys(flags):
        torch.testing.assert_close(got[key], expected_state[key], atol=1e-6, rtol=1e-5)
    assert got["param"].data_ptr() == args[0].data_ptr()  # in place
    assert got["step"].data_ptr() != args[2].data_ptr()  # the scalar is a new tensor


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "relax"])
def test_a_skipped_step_keeps_every_value(fused: bool) -> None:
    """Loss scaling: the update takes `skip` and `unscale` after `hyper`. skip = 1 (an overflow)
    leaves the parameter and every state, Adam's scalar step included, as they were, in the
    fused kernel and in the Relax ops alike; skip = 0 is torch's step on the unscaled gradient."""
    rule, shape = RULES["adam"], (40, 16)
    group = {"amsgrad": False, "maximize": False, "weight_decay": 0, "betas": (0.9, 0.999), "eps": 1e-8,
             "decoupled_weight_decay": False, "lr": 1e-2}
    flags = rule.flags(group)
    with CPU:
        mod = FuseModelUpdate(enabled=fused)(module_with_update("adam", flags, [shape], skippable=True))
    if fused:
        kernel = next(f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
        assert [p.name for p in kernel.params][:3] == ["hyper", "skip", "unscale"]
    run = relax.VirtualMachine(tvm.compile(mod, target=CPU), tvm.cpu())["main"]
    hyper = torch.tensor(rule.hyper_vector(group, [False]), dtype=torch.float64)
    p, g = torch.randn(shape), torch.randn(shape)
    state = {"step": torch.tensor(3.0), "exp_avg": torch.randn(shape) * 0.1, "exp_avg_sq": torch.rand(shape) * 0.1}
    keys = [*rule.state_keys(flags), "param"]
    for skip in (1.0, 0.0):  # the gradient comes scaled by 1024 and is unscaled in the update
        args = [p.clone(), g * 1024] + [state[k].clone() for k in rule.state_keys(flags)]
        got = dict(zip(keys, [torch.from_numpy(r.numpy())
                              for r in run(hyper, torch.tensor(skip), torch.tensor(1 / 1024), *args)]))
        expected_p, expected_state = (p, state) if skip else torch_adam_step(p, g, state, lr=1e-2)
        torch.testing.assert_close(got["param"], expected_p, atol=1e-6, rtol=1e-5)
        for key in rule.state_keys(flags):
            torch.testing.assert_close(got[key], expected_state[key], atol=1e-6, rtol=1e-5)


def test_disabled_pass_changes_nothing() -> None:
    before = module_with_update("sgd", sgd_flags(), [(4, 4)])
    tvm.ir.assert_structural_equal(FuseModelUpdate(enabled=False)(before), before)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_kernel_compiles_for_cuda() -> None:
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    kernel, _ = build_update_kernel(RULES["sgd"], sgd_flags(nesterov=True), [relax.TensorType((1000, 3), "float32")], cuda)
    lib = tvm.compile(tvm.IRModule({"k": kernel.with_attr("global_symbol", "k")}), target=cuda)
    source = lib.mod.imports[0].inspect_source() if lib.mod.imports else lib.imports[0].inspect_source()
    assert "__global__" in source and "threadIdx.x" in source

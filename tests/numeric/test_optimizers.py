"""Every torch.optim optimizer tvmgraph lowers trains like eager, step for step: parameters and
every optimizer state tensor, with the in-place update kernels (FuseModelUpdate) and without.

Each layer of one MLP has its own optimizer, with one param group for its weight and one for
its bias, each with other options, so that one compile covers many option combinations.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import tvm
from torch import nn
from tvm import relax

from relay_passes.fuse_model_update import build_update_kernel
from tests.conftest import TrainGraph
from tests.numeric.test_training import eager_step
from tvmgraph.errors import OptimizerError
from tvmgraph.training.optimizers import RULES

# Relative to each tensor's largest element: far below any real training difference, above the
# float32 rounding of TVM's matmuls (which compute the gradients) against MKL's, which the
# optimizers carry over the steps (and which cancellation magnifies in elements near zero).
RTOL = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg) -> None:
    atol = RTOL * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol, msg=msg)
STEPS = 10

# (optimizer class, weight group options, bias group options, shared options)
ADAPTIVE = [
    (torch.optim.RMSprop, dict(momentum=0.9, centered=True, weight_decay=1e-2), dict(maximize=True), dict(lr=1e-3)),
    (torch.optim.Adagrad, dict(lr_decay=0.05, initial_accumulator_value=0.1, weight_decay=1e-2),
     dict(maximize=True), dict(lr=1e-2)),
    (torch.optim.Adamax, dict(weight_decay=1e-2), dict(maximize=True, betas=(0.8, 0.99)), dict(lr=1e-2)),
    (torch.optim.NAdam, dict(decoupled_weight_decay=True, weight_decay=1e-2),
     dict(weight_decay=1e-2, momentum_decay=0.01), dict(lr=1e-2)),
    (torch.optim.RMSprop, dict(centered=True), dict(momentum=0.5, alpha=0.9), dict(lr=1e-3)),
]
OTHERS = [
    # beta2=0.9: the rectification starts at step 6, so both of RAdam's branches run.
    (torch.optim.RAdam, dict(betas=(0.9, 0.9)), dict(decoupled_weight_decay=True, weight_decay=0.1), dict(lr=1e-2)),
    (torch.optim.Adadelta, dict(weight_decay=1e-2), dict(maximize=True, rho=0.8), dict(lr=0.5)),
    (torch.optim.Rprop, dict(), dict(etas=(0.4, 1.3), step_sizes=(1e-4, 0.02), maximize=True), dict(lr=1e-2)),
    # t0 small: ASGD starts averaging (mu < 1) within the run.
    (torch.optim.ASGD, dict(t0=3, lambd=1e-2), dict(weight_decay=1e-2, t0=1), dict(lr=1e-2)),
    (torch.optim.AdamW, dict(amsgrad=True), dict(maximize=True, amsgrad=True, weight_decay=0.0), dict(lr=1e-2)),
]
# A weight's second moment is factored into row and column means, a bias's is whole.
ADAFACTOR = [
    (torch.optim.Adafactor, dict(weight_decay=1e-2), dict(maximize=True, beta2_decay=-0.5), dict(lr=1e-2)),
    (torch.optim.Adafactor, dict(eps=(1e-30, 1e-3), d=2.0), dict(), dict(lr=5e-2)),
]


def per_layer_optimizers(model: nn.Sequential, configs) -> list[torch.optim.Optimizer]:
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert len(linears) == len(configs)
    return [cls([{"params": [layer.weight], **weight}, {"params": [layer.bias], **bias}], **shared)
            for layer, (cls, weight, bias, shared) in zip(linears, configs)]


def deep_mlp(layers: int) -> nn.Sequential:
    modules: list[nn.Module] = [nn.Linear(16, 24), nn.Tanh()]
    for _ in range(layers - 2):
        modules += [nn.Linear(24, 24), nn.Tanh()]
    return nn.Sequential(*modules, nn.Linear(24, 4))


def assert_same_optimizer(optimizers, ref_optimizers, step: int) -> None:
    for opt, ref in zip(optimizers, ref_optimizers):
        name = type(opt).__name__
        for group, ref_group in zip(opt.param_groups, ref.param_groups):
            for p, q in zip(group["params"], ref_group["params"]):
                where = f"step {step} {name} {tuple(p.shape)}"
                assert_close(p.detach(), q.detach(), msg=lambda m, w=where: f"{w} param: {m}")
                state, ref_state = opt.state[p], ref.state[q]
                assert set(state) == set(ref_state), where
                for key, value in ref_state.items():
                    assert state[key].dtype == value.dtype and state[key].shape == value.shape, f"{where} {key}"
                    assert_close(state[key], value, msg=lambda m, w=where, k=key: f"{w} {k}: {m}")


def train_side_by_side(configs, fuse: bool) -> TrainGraph:
    model = deep_mlp(len(configs))
    reference = copy.deepcopy(model)
    optimizers, ref_optimizers = per_layer_optimizers(model, configs), per_layer_optimizers(reference, configs)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, *optimizers)
    graph.config.allow_fuse_model_update_ops(fuse)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
    storage = [p.data_ptr() for opt in optimizers for group in opt.param_groups for p in group["params"]]
    for step in range(STEPS):
        if step == STEPS // 2:  # as an lr scheduler would: read at the next call, no recompile
            for opt in optimizers + ref_optimizers:
                for group in opt.param_groups:
                    group["lr"] *= 0.5
        x, y = batches[step % len(batches)]
        loss = graph(x, y)
        ref_loss = eager_step(reference, loss_fn, ref_optimizers, x, y)
        assert_close(loss, ref_loss, msg=lambda m: f"step {step} loss: {m}")
        assert_same_optimizer(optimizers, ref_optimizers, step)
        # Every parameter keeps its storage, as in eager (a view of it stays live), also where the
        # update returns new tensors (Adadelta with weight decay, Adafactor, fuse=False).
        assert [p.data_ptr() for opt in optimizers for group in opt.param_groups for p in group["params"]] == storage
    assert graph.num_compiled == 1
    return graph


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "relax"])
def test_adaptive_optimizers_match_eager(fuse: bool) -> None:
    """RMSprop (centered, momentum), Adagrad (lr_decay, initial_accumulator_value), Adamax, NAdam
    (decoupled weight decay, momentum_decay: the mu_product state)."""
    train_side_by_side(ADAPTIVE, fuse)


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "relax"])
def test_other_optimizers_match_eager(fuse: bool) -> None:
    """RAdam (both sides of the rectification), Adadelta, Rprop, ASGD (averaging), AdamW amsgrad."""
    train_side_by_side(OTHERS, fuse)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "relax"])
def test_adafactor_matches_eager(fuse: bool) -> None:
    """Adafactor (weight decay, maximize, beta2_decay, given eps1, d): factored row and column
    moments for weights, a whole one for biases; the state torch keeps and nothing more."""
    train_side_by_side(ADAFACTOR, fuse)


def test_adafactor_factors_the_last_two_dims_of_a_convolution_weight() -> None:
    """A 4-D weight: row_var [O, I, kh, 1], col_var [O, I, 1, kw], as torch keeps them."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 2, (2, 3)))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adafactor(model.parameters(), lr=2e-2)
    ref_optimizer = torch.optim.Adafactor(reference.parameters(), lr=2e-2)
    graph = TrainGraph(model, nn.MSELoss(), optimizer)
    for step in range(4):
        x, y = torch.randn(2, 3, 9, 9), torch.randn(2, 2, 6, 5)
        graph(x, y)
        eager_step(reference, nn.MSELoss(), [ref_optimizer], x, y)
        assert_same_optimizer([optimizer], [ref_optimizer], step)
    assert optimizer.state[model[0].weight]["row_var"].shape == (4, 3, 3, 1)


def test_unsupported_optimizer_lists_every_supported_one() -> None:
    model = nn.Linear(4, 2)
    for optimizer in (torch.optim.LBFGS(model.parameters()), torch.optim.SparseAdam(model.parameters())):
        with pytest.raises(OptimizerError, match="cannot be lowered into a graph") as error:
            TrainGraph(model, nn.MSELoss(), optimizer)
        for rule in RULES.values():
            assert f"torch.optim.{rule.optimizer_class.__name__}" in str(error.value)


def test_differentiable_optimizer_is_refused() -> None:
    model = nn.Linear(4, 2)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.NAdam(model.parameters(), differentiable=True))
    with pytest.raises(OptimizerError, match=r"NAdam\(differentiable=True\) is not supported in graph mode"):
        graph(torch.randn(3, 4), torch.randn(3, 2))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
], ids=["adam", "adamw", "adagrad", "sgd"])
def test_fused_optimizers_train_as_eager(make) -> None:
    """fused=True picks torch's kernel, with the same arithmetic; it was refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), make(model.parameters()))
    eager_optimizer = make(reference.parameters())
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(3):
        graph(x, y)
        eager_step(reference, nn.MSELoss(), [eager_optimizer], x, y)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_close(got.detach(), want.detach(), msg=lambda m: m)


def _rule_and_flags(config):
    """The rule and flags of `config`'s bias group (Adadelta's without weight decay)."""
    cls, _, bias, shared = config
    group = cls([torch.zeros(2, requires_grad=True)], **shared, **bias).param_groups[0]
    rule = next(r for r in RULES.values() if r.optimizer_class is cls)
    return rule, rule.flags(group)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
@pytest.mark.parametrize("config", ADAPTIVE + OTHERS, ids=lambda c: c[0].__name__)
def test_update_kernels_compile_for_cuda(config) -> None:
    """The in-place kernels, float64 scalar arithmetic included, compile for a GPU."""
    rule, flags = _rule_and_flags(config)
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    kernel, _ = build_update_kernel(rule, flags, [relax.TensorType((1000, 3), "float32")], cuda)
    lib = tvm.compile(tvm.IRModule({"k": kernel.with_attr("global_symbol", "k")}), target=cuda)
    source = lib.mod.imports[0].inspect_source() if lib.mod.imports else lib.imports[0].inspect_source()
    assert "__global__" in source


def test_update_kernel_refuses_to_read_overwritten_state() -> None:
    """Adadelta with weight decay: the new acc_delta reads the old parameter, stored before it.
    The TE backend says so (and FuseModelUpdate never asks it: that update is not in_place)."""
    rule = RULES["adadelta"]
    flags = rule.flags(torch.optim.Adadelta([torch.zeros(2)], weight_decay=0.1).param_groups[0])
    assert not rule.in_place(flags)
    with pytest.raises(AssertionError, match="reads the old 'param' after storing the new one"):
        build_update_kernel(rule, flags, [relax.TensorType((4, 8), "float32")], tvm.target.Target("llvm"))


def test_state_dict_round_trips_into_eager() -> None:
    """Graph-trained optimizer state (scalar state included: NAdam's mu_product, ASGD's eta and
    mu) loads into eager optimizers, which go on exactly as if they had trained all along."""
    configs = [OTHERS[3], ADAPTIVE[3]]  # ASGD, NAdam
    model = deep_mlp(len(configs))
    reference = copy.deepcopy(model)
    optimizers, ref_optimizers = per_layer_optimizers(model, configs), per_layer_optimizers(reference, configs)
    loss_fn = nn.MSELoss()
    graph = TrainGraph(model, loss_fn, *optimizers)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(5)]

    for x, y in batches[:3]:
        graph(x, y)
        eager_step(reference, loss_fn, ref_optimizers, x, y)
    resumed = per_layer_optimizers(model, configs)
    for opt, trained in zip(resumed, optimizers):
        opt.load_state_dict(copy.deepcopy(trained.state_dict()))
    for x, y in batches[3:]:
        eager_step(model, loss_fn, resumed, x, y)
        eager_step(reference, loss_fn, ref_optimizers, x, y)
    assert_same_optimizer(resumed, ref_optimizers, step=len(batches))

"""Training misuse gets a clear error naming the graph and the fix."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import tvmgraph
from tvmgraph import errors


class Train(tvmgraph.nn.Graph):
    def __init__(self, model=None, optimizer=None, loss="scalar"):
        super().__init__()
        self.model = model if model is not None else nn.Linear(3, 2)
        if optimizer is not False:
            self.add_optimizer(optimizer or torch.optim.SGD(self.model.parameters(), lr=0.1))
        self.loss = loss

    def build(self, x):
        out = self.model(x)
        if self.loss in ("scalar", "twice"):
            loss = out.sum()
        elif self.loss == "vector":
            loss = out.sum(dim=1)
        elif self.loss == "none":
            return out
        loss.backward()
        if self.loss == "twice":
            loss.backward()
        return loss


def test_backward_on_a_non_scalar_loss() -> None:
    graph = Train(loss="vector")
    with pytest.raises(errors.BackwardError, match=rf"{graph.name}: backward\(\) was called on a float32\[4\] tensor; "
                                                   r"only a scalar floating-point loss"):
        graph(torch.ones(4, 3))


def test_an_argument_requiring_grad_in_a_training_call_is_warned_of_once() -> None:
    """Eager's backward() fills x.grad (an FGSM attack reads it; an upstream eager model gets its
    gradients); the graph's computes its parameters' gradients only and x.grad stays None. That
    was silent; a UserWarning names the argument and the fix, once per graph. The step itself is
    eager's."""
    graph = Train()
    reference = copy.deepcopy(graph.model)
    x = torch.ones(4, 3, requires_grad=True)
    with pytest.warns(UserWarning, match=rf"{graph.name}: argument 'x' requires grad.*`x\.detach\(\)`"):
        graph(x)
    assert x.grad is None
    reference(x.detach()).sum().backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    torch.testing.assert_close(graph.model.weight.detach(), reference.weight.detach())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph(x)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_training_call_under_no_grad_is_a_backward_error_every_time(context) -> None:
    """Eager's loss.backward() fails under no_grad. Before: a first call so raised an
    OptimizerError about build(), and a compiled graph's call trained, silently."""
    graph = Train()
    with context(), pytest.raises(errors.BackwardError, match=rf"{graph.name}: the graph trains .* torch.no_grad"):
        graph(torch.ones(4, 3))
    graph(torch.ones(4, 3))
    before = graph.model.weight.detach().clone()
    with context(), pytest.raises(errors.BackwardError):
        graph(torch.ones(4, 3))
    assert torch.equal(graph.model.weight, before) and graph.step == 1


def test_backward_twice() -> None:
    graph = Train(loss="twice")
    with pytest.raises(errors.BackwardError, match=r"backward\(\) was called twice"):
        graph(torch.ones(4, 3))


def test_backward_without_optimizer() -> None:
    graph = Train(optimizer=False)
    with pytest.raises(errors.BackwardError, match=r"called loss.backward\(\) but the graph has no optimizer"):
        graph(torch.ones(4, 3))


def test_optimizer_without_backward() -> None:
    graph = Train(loss="none")
    with pytest.raises(errors.BackwardError, match=r"has an optimizer but build\(\) never called loss.backward\(\)"):
        graph(torch.ones(4, 3))


def test_unsupported_optimizer_lists_the_supported_ones() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(errors.OptimizerError, match=r"torch.optim.lbfgs.LBFGS cannot be lowered into a graph; "
                                                    r"supported optimizers: torch.optim.SGD, torch.optim.Adam, "
                                                    r"torch.optim.AdamW, torch.optim.RMSprop, .*torch.optim.ASGD, torch.optim.Adafactor\."):
        Train(model, torch.optim.LBFGS(model.parameters()))


def test_add_optimizer_argument_checks() -> None:
    graph = Train(optimizer=False)
    with pytest.raises(errors.OptimizerError, match="takes a torch.optim.Optimizer, got list"):
        graph.add_optimizer([1])
    opt = torch.optim.SGD(graph.model.parameters(), lr=0.1)
    other = torch.optim.SGD(graph.model.parameters(), lr=0.1)
    with pytest.raises(errors.OptimizerError, match="lr_sch must be a scheduler of the optimizer passed with it"):
        graph.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.StepLR(other, 1))


def test_optimizer_parameter_outside_the_graph() -> None:
    stray = nn.Linear(3, 3)
    model = nn.Linear(3, 2)
    graph = Train(model, torch.optim.SGD(list(model.parameters()) + list(stray.parameters()), lr=0.1))
    with pytest.raises(errors.OptimizerError, match=r"parameter #2 \(3, 3\) belongs to no module of the graph"):
        graph(torch.ones(4, 3))


def test_parameter_in_two_optimizers() -> None:
    model = nn.Linear(3, 2)
    graph = Train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    graph.add_optimizer(torch.optim.Adam([model.weight]))
    with pytest.raises(errors.OptimizerError, match=r"parameter 'model.weight' is also updated by"):
        graph(torch.ones(4, 3))


def test_differentiable_adam_is_refused() -> None:
    model = nn.Linear(3, 2)
    graph = Train(model, torch.optim.Adam(model.parameters(), differentiable=True))
    with pytest.raises(errors.OptimizerError, match=r"Adam\(differentiable=True\) is not supported in graph mode"):
        graph(torch.ones(4, 3))


def test_bad_clip_settings() -> None:
    model = nn.Linear(3, 2)
    graph = Train(model, torch.optim.SGD([{"params": model.parameters(), "clip_grad_norm_type": 2.0}], lr=0.1))
    with pytest.raises(errors.OptimizerError, match="clip_grad_norm_type is set but clip_grad_max_norm is not"):
        graph(torch.ones(4, 3))


@pytest.mark.parametrize("where", ["pre", "post", "global", "after_the_first_call"])
def test_optimizer_step_hooks_are_refused_not_skipped(where: str) -> None:
    """The step inside the program runs no hook: a post-hook clamping the weights (WGAN) trained
    silently without it (0.26 off eager after 3 steps). Checked at every call."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = Train(model, optimizer)
    clamp = lambda opt, args, kwargs: [p.data.clamp_(-0.05, 0.05) for p in model.parameters()]  # noqa: E731
    if where == "after_the_first_call":
        graph(torch.ones(4, 3))
    register = {"pre": optimizer.register_step_pre_hook, "post": optimizer.register_step_post_hook,
                "global": register_optimizer_step_post_hook}.get(where,
                                                                                      optimizer.register_step_post_hook)
    handle = register(clamp)
    try:
        with pytest.raises(errors.UnsupportedOptionError, match=rf"{graph.name}: SGD has an optimizer step hook .* "
                                                                  r"runs no hook\. Remove it"):
            graph(torch.ones(4, 3))
    finally:
        handle.remove()
    graph(torch.ones(4, 3))  # without the hook it runs


def test_a_malformed_hyperparameter_set_between_calls_names_the_group() -> None:
    """It was an ExecutionError ("the compiled program failed while running: ValueError: not
    enough values to unpack"), though the program never ran."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    graph = Train(model, optimizer)
    graph(torch.ones(4, 3))
    optimizer.param_groups[0]["betas"] = (0.9,)
    with pytest.raises(errors.OptimizerError, match=rf"{graph.name}: Adam param group 0: its hyperparameters could "
                                                      r"not be read .*ValueError: not enough values to unpack"):
        graph(torch.ones(4, 3))


def test_clip_max_norm_none_clips_nothing_and_a_string_is_refused() -> None:
    model = nn.Linear(3, 2)
    reference = copy.deepcopy(model)
    graph = Train(model, torch.optim.SGD([{"params": model.parameters(), "clip_grad_max_norm": None}], lr=0.1))
    graph(torch.ones(4, 3))
    reference(torch.ones(4, 3)).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q - 0.1 * q.grad)
    other = nn.Linear(3, 2)
    bad = Train(other, torch.optim.SGD([{"params": other.parameters(), "clip_grad_max_norm": "1.0x"}], lr=0.1))
    with pytest.raises(errors.OptimizerError, match=r"clip_grad_max_norm and clip_grad_norm_type must be numbers"):
        bad(torch.ones(4, 3))


class ClipInBuild(tvmgraph.nn.Graph):
    def __init__(self, clip):
        super().__init__()
        self.model = nn.Linear(3, 2)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=1.0))
        self.clip = clip

    def build(self, x):
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.clip(self.model.parameters())
        return loss


@pytest.mark.parametrize("clip", [
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.01),
    lambda ps: __import__("torch.nn.utils.clip_grad", fromlist=["x"]).clip_grad_norm_(ps, 0.01, 1.0),
    lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.01),
], ids=["clip_grad_norm_", "imported-from-the-module", "clip_grad_value_"])
def test_gradient_clipping_in_build_is_refused_not_skipped(clip) -> None:
    """No gradient exists while build() is traced, and torch's clipping skips parameters
    without one: the step was eager's unclipped one (5.4 away). The error names the graph's own
    clipping; the functions work again after the trace."""
    graph = ClipInBuild(clip)
    with pytest.raises(errors.BackwardError, match=r"clip_grad_norm_ .* 'clip_grad_max_norm'"):
        graph(torch.randn(4, 3))
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01) > 0.01


def test_set_grad_scaler_takes_a_grad_scaler_or_none() -> None:
    graph = Train()
    graph.set_grad_scaler(None)  # loss scaling off
    with pytest.raises(errors.OptimizerError, match=r"set_grad_scaler\(grad_scaler\) takes a torch.amp.GradScaler "
                                                    r"\(or tvmgraph.amp.GradScaler\) or None, got float"):
        graph.set_grad_scaler(2.0**16)


def test_load_state_dict_of_another_graph() -> None:
    graph = Train()
    state = graph.state_dict()
    state["optimizers"].append({})
    with pytest.raises(errors.StateDictError, match="state_dict does not fit this graph"):
        graph.load_state_dict(state)
    with pytest.raises(errors.StateDictError, match=r"takes what .*state_dict\(\) returned"):
        graph.load_state_dict({"weight": torch.ones(1)})


def test_training_property_and_config() -> None:
    assert Train().training is True
    assert repr(Train().config) == "GraphConfig(training=True, )"
    assert Train(optimizer=False).training is False


def test_missing_gradient_is_an_unsupported_op_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Relax op without a registered gradient: UnsupportedOpError naming it, not a raw TVM error.
    (No op a torch model reaches lacks one today: cumprod is made to look like one.)"""
    from tvmgraph.training import gradient_check

    real = gradient_check.has_gradient
    monkeypatch.setattr(gradient_check, "has_gradient", lambda op: op != "relax.cumprod" and real(op))

    class CumProd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return torch.cumprod(self.w * x, dim=1).sum()

    class Graph(tvmgraph.nn.Graph):
        def __init__(self) -> None:
            super().__init__()
            self.m = CumProd()
            self.add_optimizer(torch.optim.SGD(self.m.parameters(), lr=0.1))

        def build(self, x):
            loss = self.m(x)
            loss.backward()
            return loss

    with pytest.raises(errors.UnsupportedOpError, match=r"needs the gradient of relax.cumprod"):
        Graph()(torch.randn(4, 3))


class GradientReversal(torch.autograd.Function):
    """Domain adaptation's layer: identity forward, negated gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class ThroughFunction(tvmgraph.nn.Graph):
    def __init__(self, amp: bool = False, reentrant: bool = False, metric_only: bool = False):
        super().__init__()
        self.model = nn.Linear(3, 2)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        self.config.enable_amp(amp)
        self.reentrant, self.metric_only = reentrant, metric_only

    def build(self, x):
        out = self.model(x)
        if self.reentrant:
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(torch.tanh, out, use_reentrant=True)
        reversed_out = GradientReversal.apply(out)
        loss = (out if self.metric_only else reversed_out).float().pow(2).mean()
        loss.backward()
        return loss, reversed_out.sum()


@pytest.mark.parametrize("amp", [False, True], ids=["float32", "amp"])
def test_a_loss_through_a_custom_autograd_function_is_refused(amp: bool) -> None:
    """The graph's autodiff differentiates forward() and never runs the user's backward(): a
    gradient reversal layer trained the wrong way round (silently). Refused, naming the class;
    torch.utils.checkpoint's reentrant form (a Function too: it trained nothing) names its fix."""
    graph = ThroughFunction(amp=amp)
    with pytest.raises(errors.BackwardError, match=r"torch.autograd.Function .*GradientReversal: the graph computes "
                                                   r"gradients with its own autodiff.*gradient reversal as"):
        graph(torch.ones(4, 3))
    with pytest.raises(errors.BackwardError, match=r"use_reentrant=True.*Pass use_reentrant=False"):
        ThroughFunction(reentrant=True)(torch.ones(4, 3))


def test_a_custom_autograd_function_off_the_loss_path_is_fine() -> None:
    """A Function whose result only feeds a returned metric: the loss's gradient is the graph's."""
    graph = ThroughFunction(metric_only=True)
    x = torch.randn(4, 3)
    expected = graph.model(x).sum()
    loss, metric = graph(x)
    torch.testing.assert_close(metric, expected.detach())


class EditsGradients(tvmgraph.nn.Graph):
    def __init__(self, edit: str):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        self.edit = edit

    def build(self, x):
        hidden = self.model[0](x)
        if self.edit == "hook":
            hidden.register_hook(lambda grad: grad * 10)
        if self.edit == "retain_grad":
            hidden.retain_grad()
        if self.edit == "requires_grad":  # GAN-style: freeze for one term, unfreeze for the other
            self.model[2].requires_grad_(False)
            frozen_term = self.model[2](torch.tanh(hidden)).mean()
            self.model[2].requires_grad_(True)
        loss = self.model[2](torch.tanh(hidden)).pow(2).mean()
        if self.edit == "requires_grad":
            loss = loss + frozen_term
        loss.backward()
        if self.edit == "zero_grad":
            self.model.zero_grad()
        return loss


@pytest.mark.parametrize("edit, message", [
    ("zero_grad", r"calls zero_grad\(\) after loss.backward\(\).*remove the zero_grad\(\) call"),
    ("requires_grad", r"changes requires_grad of a parameter.*Set requires_grad outside build\(\)"),
    ("hook", r"registers a gradient hook on a tensor.*Write what the hook does"),
    ("retain_grad", r"calls retain_grad\(\)"),
])
def test_gradient_edits_in_build_are_refused(edit: str, message: str) -> None:
    """Each trained silently otherwise than eager (the hook and zero_grad were dropped, the
    frozen term was differentiated); a training graph refuses them, naming the fix."""
    with pytest.raises(errors.BackwardError, match=message):
        EditsGradients(edit)(torch.randn(4, 3))


def test_gradient_edits_in_an_inference_graph_change_nothing() -> None:
    """Without a backward pass eager is unaffected by them too: an inference graph runs."""
    model = nn.Linear(3, 2)

    class Infer(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            out = self.model(x)
            out.retain_grad()
            self.model.zero_grad()
            return out

    x = torch.randn(4, 3)
    torch.testing.assert_close(Infer()(x), model(x).detach())


def test_torch_autograd_backward_is_loss_backward() -> None:
    """`torch.autograd.backward(loss)` is eager's `loss.backward()`: the graph took it for no
    backward call at all ("never called loss.backward()")."""
    model = nn.Linear(3, 1)
    reference = nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())

    class Step(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x):
            loss = self.model(x).pow(2).mean()
            torch.autograd.backward(loss)
            return loss

    x = torch.randn(4, 3)
    Step()(x)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.autograd.backward(reference(x).pow(2).mean())
    optimizer.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach())


def test_torch_autograd_grad_in_build_is_refused() -> None:
    """A gradient penalty's `torch.autograd.grad` failed with a TraceError about fake tensors
    and `tensor.data`, which the code never used."""

    class Penalty(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(3, 1)
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

        def build(self, x):
            x = x.clone().requires_grad_(True)
            out = self.model(x)
            (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = out.mean() + (grad.norm(2, dim=1) - 1).pow(2).mean()
            loss.backward()
            return loss

    with pytest.raises(errors.BackwardError, match=r"torch.autograd.grad was called in build\(\)"):
        Penalty()(torch.randn(4, 3))

"""Guards: a compiled program runs only while what it was compiled from still holds.

Every change a user makes between calls (a replaced, added or removed module or parameter, a
frozen layer, a config option, a process-wide codegen setting) either recompiles, with one INFO
line naming the guard that failed, or raises a TvmGraphError; never the stale program.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import types

import numpy as np
import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph import artifact, errors
from tvmgraph.config import CompileOptions, GraphConfig, Settings
from tvmgraph.target import target_for
from tests.conftest import Fn, ModuleGraph, TrainGraph, assert_close


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_replaced_submodule_recompiles_and_runs_the_new_weights(caplog: pytest.LogCaptureFixture) -> None:
    """`model[2] = nn.Linear(...)` after the first call: the next call uses the new layer."""
    model = mlp()
    graph = ModuleGraph(model)
    x = torch.randn(5, 4)
    graph(x)
    model[2] = nn.Linear(8, 6)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(x)
    assert_close(out, model(x))
    assert graph.num_compiled == 2
    assert "guard failed: model structure changed: module 'model.2' was replaced (Linear -> Linear)" in caplog.text


def test_alternating_signatures_each_run_their_own_program() -> None:
    """A call is tried against the last entry first: shapes and modes that alternate between
    calls (train/eval, two batch sizes) still run the program of their own signature."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    graph = ModuleGraph(model)
    small, large = torch.randn(2, 4), torch.randn(5, 4)
    for _ in range(2):
        model.eval()
        assert_close(graph(small), model(small))
        assert_close(graph(large), model(large))
        model.train()
        out = graph(large)  # dropout on: zeros where eval mode would have none
        assert out.shape == (5, 3) and not torch.allclose(out, model.eval()(large))
        model.train()
    assert graph.num_compiled == 3


def test_unrelated_module_creation_does_not_recompile() -> None:
    """Registrations anywhere in the process make the guard look again, but an unchanged model
    keeps its program."""
    graph = ModuleGraph(mlp())
    x = torch.randn(2, 4)
    for _ in range(3):
        nn.Linear(3, 3)  # registers parameters: the process-wide epoch moves
        graph(x)
    assert graph.num_compiled == 1


def test_removed_submodule_recompiles() -> None:
    """`del model[1]` (torch has no hook for removal): the program without it runs."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    graph = ModuleGraph(model)
    x = torch.randn(3, 4)
    graph(x)
    del model[1]
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 2


def test_replaced_parameter_of_same_shape_is_read_live() -> None:
    """A new Parameter object of the same shape is read at the next call (no stale weights)."""
    model = nn.Linear(3, 2)
    graph = ModuleGraph(model)
    x = torch.randn(4, 3)
    graph(x)
    model.weight = nn.Parameter(torch.randn(2, 3))
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 1


def test_replaced_parameter_in_training_is_refused_by_name() -> None:
    """A training graph whose layer gets a new Parameter object that its optimizer does not hold:
    the next call recompiles and refuses the orphaned optimizer parameter with an OptimizerError,
    never updating the old object behind the model's back."""
    model = nn.Linear(3, 2)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    graph(x, y)
    model.weight = nn.Parameter(torch.randn(2, 3))
    with pytest.raises(errors.OptimizerError, match=r"parameter #0 \(2, 3\) belongs to no module of the graph"):
        graph(x, y)


def test_replaced_parameter_of_new_shape_recompiles() -> None:
    """Both tensors of a layer replaced consistently with a new width: recompiled, eager's result."""
    model = nn.Linear(3, 2)
    graph = ModuleGraph(model)
    x = torch.randn(4, 3)
    graph(x)
    model.weight = nn.Parameter(torch.randn(5, 3))
    model.bias = nn.Parameter(torch.randn(5))
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 2


def test_added_buffer_used_by_a_module_recompiles() -> None:
    """A module whose forward reads an optional buffer: registering it later is seen."""

    class Shift(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("shift", None)

        def forward(self, x):
            return x if self.shift is None else x + self.shift

    model = Shift()
    graph = ModuleGraph(model)
    x = torch.randn(2, 3)
    assert_close(graph(x), x)
    model.register_buffer("shift", torch.full((3,), 2.0))
    assert_close(graph(x), x + 2)


def test_frozen_layer_is_not_updated_after_requires_grad_flip() -> None:
    """`requires_grad_(False)` between steps freezes the layer, as in eager."""
    torch.manual_seed(0)
    eager_model = mlp()
    graph_model = mlp()
    graph_model.load_state_dict(eager_model.state_dict())
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    graph = TrainGraph(graph_model, nn.MSELoss(), torch.optim.SGD(graph_model.parameters(), lr=0.1, momentum=0.9))
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    for step in range(4):
        if step == 2:
            eager_model[0].requires_grad_(False)
            graph_model[0].requires_grad_(False)
            frozen = graph_model[0].weight.detach().clone()
        eager_opt.zero_grad()
        nn.MSELoss()(eager_model(x), y).backward()
        eager_opt.step()
        graph(x, y)
    torch.testing.assert_close(graph_model[0].weight, frozen, rtol=0, atol=0)
    for got, want in zip(graph_model.parameters(), eager_model.parameters()):
        assert_close(got.detach(), want.detach())


class Scaled(nn.Module):
    """Plain Python attributes read by forward(): program constants."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = 1.0
        self.use_relu = True

    def forward(self, x):
        y = self.fc(x) * self.scale
        return torch.relu(y) if self.use_relu else y


def test_changed_python_attribute_recompiles(caplog: pytest.LogCaptureFixture) -> None:
    """`module.scale = 3.0` after a call: the program baked 1.0 in and ran on with it (stale)."""
    model = Scaled()
    graph = ModuleGraph(model)
    x = torch.randn(5, 4)
    graph(x)
    model.scale = 3.0
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        assert_close(graph(x), model(x))
    assert "guard failed: attribute self.model.scale was 1.0, now 3.0" in caplog.text
    model.use_relu = False
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 3
    model.scale, model.use_relu = 1.0, True  # values seen before: their program, no compile
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 3


class Mode(enum.Enum):
    SCALE = 2.0
    SHIFT = 3.0


class ReadsObjects(nn.Module):
    """Attributes that are not plain values: an Enum member, a function, a list, a numpy scalar,
    a config object (as Hugging Face models read `self.config.x`)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.mode, self.activation, self.weights = Mode.SCALE, torch.relu, [1.0, 2.0]
        self.bias, self.config = np.float32(0.5), types.SimpleNamespace(gain=1.0)

    def forward(self, x):
        y = self.activation(self.fc(x)) * self.mode.value * self.weights[1] + float(self.bias)
        return y * self.config.gain


@pytest.mark.parametrize("name, new", [
    ("mode", Mode.SHIFT), ("activation", torch.tanh), ("weights", [1.0, -1.0]), ("bias", np.float32(-2.0)),
    ("config", types.SimpleNamespace(gain=3.0)),
], ids=["enum", "function", "list", "numpy-scalar", "config-object"])
def test_a_reassigned_attribute_of_any_kind_recompiles(name: str, new: object) -> None:
    """Only plain values (numbers, strings, tuples) were guarded: reassigning any of these kept
    the first call's program (2.1-3.0 off, silently). An equal object in place compiles nothing."""
    model = ReadsObjects()
    graph, x = ModuleGraph(model), torch.randn(5, 4)
    graph(x)
    setattr(model, name, copy.deepcopy(getattr(model, name)) if name != "activation" else torch.relu)
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 1
    setattr(model, name, new)
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 2


def test_graph_attribute_read_by_build_recompiles() -> None:
    class Weighted(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.alpha = 0.5

        def build(self, x):
            return self.fc(x) * self.alpha

    graph, x = Weighted(), torch.randn(2, 4)
    first = graph(x)
    graph.alpha = 2  # an int: another constant than 2.0 would be, the same numbers here
    assert_close(graph(x), first * 4)
    assert graph.num_compiled == 2


def test_attribute_changed_mid_training_matches_eager() -> None:
    torch.manual_seed(0)
    model, reference = Scaled(), Scaled()
    reference.load_state_dict(model.state_dict())
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    eager_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    for step in range(4):
        if step == 2:
            model.scale = reference.scale = 2.5
        loss = graph(x, y)
        eager_opt.zero_grad()
        eager_loss = nn.MSELoss()(reference(x), y)
        eager_loss.backward()
        eager_opt.step()
        assert_close(loss, eager_loss.detach())
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_close(got.detach(), want.detach())


def test_forward_hooks_added_or_removed_recompile(caplog: pytest.LogCaptureFixture) -> None:
    """A forward hook, a pre-hook or a global hook registered after the first call changes
    eager's numbers; the graph ran on with its program (0.24-0.93 off). Removing one goes back
    to the program compiled without it."""
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(5, 4)
    graph = ModuleGraph(model)
    graph(x)
    hook = model[0].register_forward_hook(lambda mod, args, out: out * 2)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        assert_close(graph(x), model(x))
    assert "the hooks of module 'model.0' changed" in caplog.text
    pre = model[2].register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
    assert_close(graph(x), model(x))
    hook.remove()
    pre.remove()
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 3
    every = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out - 1 if isinstance(mod, nn.ReLU) else None)
    try:
        assert_close(graph(x), model(x))
    finally:
        every.remove()
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 4


def test_global_hooks_see_the_user_s_modules_only() -> None:
    """Eager calls a global hook on the model's modules; while tracing it was also called on
    tvmgraph's root module and torch.export's wrappers, and a statistics hook reading
    `output.detach()` failed on their tuples (found by a sweep)."""
    model, x = mlp(), torch.randn(5, 4)
    seen: list[str] = []

    def statistics(module, args, output):
        seen.append(type(module).__name__)
        output.detach().abs().mean()

    def before(module, args):
        seen.append(type(module).__name__)
        return (args[0] * 1.5,) if isinstance(module, nn.Linear) else None

    handles = [torch.nn.modules.module.register_module_forward_hook(statistics),
               torch.nn.modules.module.register_module_forward_pre_hook(before)]
    try:
        expected = model(x)
        eager_seen = set(seen)
        seen.clear()
        assert_close(ModuleGraph(model)(x), expected)
    finally:
        for handle in handles:
            handle.remove()
    assert set(seen) <= eager_seen | {"Sequential"}, seen


@pytest.mark.parametrize("hook", ["module_full_backward", "module_backward_pre", "parameter", "global"])
def test_a_backward_hook_is_refused_by_a_training_graph(hook: str) -> None:
    """The graph's autodiff runs no backward hook: it trained as if there were none (3.3 off
    eager with a module hook zeroing its input gradient and a parameter hook scaling one). A
    hook at the first call or added later is an UnsupportedOptionError; removed, training goes on."""
    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(5, 4), torch.randn(5, 3)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph(x, y)

    def add():
        if hook == "module_full_backward":
            return model[0].register_full_backward_hook(lambda mod, gi, go: None)
        if hook == "module_backward_pre":
            return model[2].register_full_backward_pre_hook(lambda mod, go: (go[0] * 3,))
        if hook == "parameter":
            return model[2].weight.register_hook(lambda g: g * 10)
        return torch.nn.modules.module.register_module_full_backward_hook(lambda mod, gi, go: None)

    handle = add()
    try:
        with pytest.raises(errors.UnsupportedOptionError, match="has a backward hook; a training graph computes its "
                                                                "gradients with its own autodiff, which runs no hook"):
            graph(x, y)
    finally:
        handle.remove()
    graph(x, y)
    fresh = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    handle = add()
    try:
        with pytest.raises(errors.UnsupportedOptionError, match="has a backward hook"):
            fresh(x, y)
    finally:
        handle.remove()


def test_forward_replaced_on_the_instance_recompiles() -> None:
    model, x = mlp(), torch.randn(5, 4)
    graph = ModuleGraph(model)
    graph(x)
    model[1].forward = torch.tanh
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 2


def test_the_default_dtype_is_guarded() -> None:
    """build()'s `torch.ones(2)` and Python floats take torch's default dtype: after
    set_default_dtype(float64) the float32 program ran on (found by a sweep: inf where eager
    gives 4e40)."""
    graph = ModuleGraph(Fn(lambda x: x.sum() * torch.ones(2) * 1e30))
    x = torch.full((4,), 1e10)
    assert graph(x).dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = graph(x)
        assert out.dtype == torch.float64 and torch.equal(out, x.sum() * torch.ones(2) * 1e30)
    finally:
        torch.set_default_dtype(previous)
    assert graph.num_compiled == 2
    assert graph(x).dtype == torch.float32 and graph.num_compiled == 2


def test_a_call_inside_autocast_is_refused_unless_the_graph_has_that_amp() -> None:
    """The first call's autocast region stayed baked into the program (a later call outside it
    still ran bfloat16), and a region around a later call was ignored (found by a sweep)."""
    model, x = mlp(), torch.randn(5, 4)
    graph = ModuleGraph(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(errors.ConfigError, match=rf"{graph.name}: called inside torch.autocast\('cpu', "
                                                       r"dtype=torch.bfloat16\).*graph.config.enable_amp\(True"):
            graph(x)
        with torch.autocast("cpu", enabled=False):
            assert_close(graph(x), model(x))
    amp = ModuleGraph(model)
    amp.config.enable_amp(True, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        assert_close(amp(x).float(), expected.float(), atol=2e-2, rtol=2e-2)
        with torch.autocast("cpu", dtype=torch.float16), pytest.raises(errors.ConfigError, match="float16"):
            amp(x)


class ClassDefaults(nn.Module):
    scale = 1.0  # a class default, shadowed on the instance below

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def act(self, t):
        return torch.relu(t)

    def forward(self, x):
        return self.act(self.fc(x)) * self.scale


@pytest.mark.parametrize("name, value", [("scale", 3.0), ("act", torch.tanh)])
def test_a_class_value_shadowed_on_the_instance_recompiles(name: str, value: object) -> None:
    """`m.scale = 3.0` over a class default, or a helper method replaced on the instance: the
    program of the class's value ran on (found by a sweep: 1.77 off eager)."""
    model, x = ClassDefaults(), torch.randn(5, 4)
    graph = ModuleGraph(model)
    graph(x)
    setattr(model, name, value)
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 2


class Masked(nn.Module):
    """A plain tensor attribute (not a buffer) read by forward()."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.mask = torch.ones(4)

    def forward(self, x):
        return self.fc(x) * self.mask


def test_a_plain_tensor_attribute_is_read_live_and_guarded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`module.mask` changed in place, or replaced by another tensor, is what the next call
    reads: a program from the compiled cache used the copy stored with it (1.77 off), and a
    replacement was not seen at all. A tensor of another shape recompiles."""
    monkeypatch.setenv("TVMGRAPH_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    for run in ("compiled", "from the cache"):
        model = Masked()
        graph = ModuleGraph(model)
        assert_close(graph(x), model(x))
        model.mask.mul_(3.0)
        assert_close(graph(x), model(x))
        model.mask = torch.full((4,), 5.0)
        assert_close(graph(x), model(x))
        assert graph.num_compiled == 1, run
    model.mask = torch.arange(3.0).reshape(3, 1)  # broadcasts to (3, 4) rows
    assert_close(graph(x[:1].expand(3, 4)), model(x[:1].expand(3, 4)))
    assert graph.num_compiled == 2


def test_a_parameter_set_to_none_recompiles() -> None:
    """`layer.bias = None` (torch calls no registration hook for it) ended in an
    ExecutionError ('NoneType' object has no attribute 'is_contiguous'). A training graph
    whose optimizer still holds the dropped parameter says so, as for a replaced one."""
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(5, 4)
    graph = ModuleGraph(model)
    graph(x)
    model[0].bias = None
    assert_close(graph(x), model(x))
    assert graph.num_compiled == 2
    train = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    train(x, torch.randn(5, 3))
    model[2].bias = None
    with pytest.raises(errors.OptimizerError, match="belongs to no module of the graph"):
        train(x, torch.randn(5, 3))


def test_config_change_after_first_call_recompiles(caplog: pytest.LogCaptureFixture) -> None:
    """A changed option takes effect at the next call, and repr shows what runs."""
    model = mlp()
    graph = ModuleGraph(model)
    x = torch.randn(5, 4)
    graph(x)
    graph.config.allow_fuse_add_to_output(False)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(x)
    assert_close(out, model(x))
    assert graph.num_compiled == 2
    assert "compile options changed: fuse_add_to_output True -> False" in caplog.text
    assert graph.compiled.traced.signature.options.fuse_add_to_output is False
    assert "fuse_add_to_output=False" in repr(graph)


def test_recompile_limit_ends_in_a_clear_error() -> None:
    """Past the limit a call raises RecompileLimitError saying what changed and how to fix it."""
    graph = ModuleGraph(nn.Linear(3, 2))
    graph.config.set_recompile_limit(2)
    graph(torch.randn(1, 3))
    graph(torch.randn(2, 3))
    with pytest.raises(errors.RecompileLimitError,
                       match=r"recompile limit of 2.*argument 'args\[0\]' was float32\[2, 3\] on cpu, now float32\[3, 3\]"
                             r".*set_recompile_limit"):
        graph(torch.randn(3, 3))
    graph(torch.randn(2, 3))  # entries already compiled keep working
    assert isinstance(errors.RecompileLimitError("x"), RuntimeError)


@pytest.mark.parametrize("mode, on", [("MemoryFirst", True), ("Disable", False), (True, True), (False, False)])
def test_straighten_algorithm_takes_oneflow_modes(mode: object, on: bool) -> None:
    """`enable_straighten_algorithm("Disable")` turns it off (it used to turn it on)."""
    config = GraphConfig()
    config.enable_straighten_algorithm(mode)
    assert config.snapshot().straighten_algorithm is on


def test_bad_option_values_list_the_valid_ones() -> None:
    """Every setter takes only its documented values."""
    config = GraphConfig()
    with pytest.raises(errors.ConfigError, match=r"takes one of 'MemoryFirst', 'Disable' \(or True/False\), got 'memory'"):
        config.enable_straighten_algorithm("memory")
    with pytest.raises(errors.UnsupportedOptionError, match=r"enable_straighten_algorithm\('SpeedFirst'\) is not implemented"):
        config.enable_straighten_algorithm("SpeedFirst")
    for setter in ("allow_fuse_add_to_output", "allow_fuse_model_update_ops", "allow_fuse_cast_scale",
                   "enable_compress_memory", "enable_recompute_attention", "enable_amp", "enable_zero"):
        with pytest.raises(errors.ConfigError, match=rf"GraphConfig.{setter}\(mode\) takes True or False, got 'Disable'"):
            getattr(config, setter)("Disable")
    with pytest.raises(errors.ConfigError, match="set_recompile_limit"):
        config.set_recompile_limit(0)
    assert config.options() == GraphConfig().options()  # nothing changed by the refusals
    assert isinstance(errors.ConfigError("x"), ValueError)


@pytest.mark.parametrize("variable, value, expected", [
    ("TVMGRAPH_LLVM_OPT_LEVEL", "abc", "set it to an integer from 0 to 3"),
    ("TVMGRAPH_LLVM_OPT_LEVEL", "7", "set it to an integer from 0 to 3"),
    ("TVMGRAPH_FAST_MATH", "off", "set it to 1 \\(on\\) or 0 \\(off\\)"),
    ("TVMGRAPH_CPU_SCHEDULES", "yes", "set it to 1 \\(on\\) or 0 \\(off\\)"),
    ("TVMGRAPH_COMPILE_CACHE", "2", "set it to 1 \\(on\\) or 0 \\(off\\)"),
    ("TVMGRAPH_VM_ALLOCATOR", "fast", "set it to one of pooled, naive"),
])
def test_environment_variables_are_validated(monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
                                             expected: str) -> None:
    """A bad TVMGRAPH_* value is a ConfigError naming the variable, never a bare int() error."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(errors.ConfigError, match=rf"environment variable {variable}={value!r}: {expected}"):
        Settings()


def test_unknown_tvmgraph_variable_is_reported(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A misspelt variable (TVMGRAPH_FASTMATH) would otherwise be silently ignored."""
    monkeypatch.setenv("TVMGRAPH_FASTMATH", "0")
    with caplog.at_level(logging.WARNING, logger="tvmgraph"):
        Settings()
    assert "unknown environment variable(s) TVMGRAPH_FASTMATH ignored" in caplog.text


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(CompileOptions)])
def test_every_compile_option_is_part_of_the_cache_key(field: str) -> None:
    """TVMGRAPH_FAST_MATH=0 with a warm cache loaded the old kernels: every option is now hashed."""
    graph = ModuleGraph(nn.Linear(3, 2))
    traced = graph.trace(torch.randn(2, 3))
    base = CompileOptions()
    value = getattr(base, field)
    if field in ("tuning_name", "amp_dtype"):
        new = "other-name"
    elif isinstance(value, bool):
        new = not value
    elif isinstance(value, tuple):  # activation_checkpointing: module paths
        new = (*value, "model")
    elif value is None:  # zero_rank
        new = 1
    else:
        new = value + 1
    changed = dataclasses.replace(base, **{field: new})
    target = target_for(torch.device("cpu"))
    assert (artifact.graph_key("G", traced, None, base, target, "default")
            != artifact.graph_key("G", traced, None, changed, target, "default"))


def test_snapshot_reads_the_process_settings() -> None:
    """The snapshot carries the codegen settings the pipeline uses (not a second read of the env)."""
    from tvmgraph.config import settings

    snap = GraphConfig().snapshot()
    assert (snap.fast_math, snap.cpu_schedules, snap.llvm_opt_level) == (
        settings.fast_math, settings.cpu_schedules, settings.llvm_opt_level)


def test_a_build_returning_none_runs_as_eager() -> None:
    """Seed 003: build()'s outputs may be None (its SubclassGraph's `def build(self): pass`); a
    build() that only updates buffers returns None and updates them as eager does. It was a
    GraphOutputError ("a graph must return at least one tensor")."""

    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(()))

        def forward(self, x):
            self.total += x.sum()

    class Counts(tvmgraph.nn.Graph):
        def __init__(self, counter: nn.Module) -> None:
            super().__init__()
            self.counter = counter

        def build(self, x):
            self.counter(x)

    class Empty(tvmgraph.nn.Graph):
        def build(self):
            pass

    counter, reference = Counter(), Counter()
    graph = Counts(counter)
    for _ in range(3):
        x = torch.randn(4)
        assert graph(x) is None and reference(x) is None
    torch.testing.assert_close(counter.total, reference.total)
    assert Empty()() is None


def test_graph_without_tensor_arguments_returns_torch_tensors() -> None:
    """build() that only creates tensors: the outputs are torch tensors like eager's (they were
    TVM runtime tensors)."""

    class Constant(tvmgraph.nn.Graph):
        def build(self):
            return torch.zeros(3), torch.eye(2)

    zeros, eye = Constant()()
    assert_close(zeros, torch.zeros(3))
    assert_close(eye, torch.eye(2))

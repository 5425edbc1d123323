"""The user-facing surface of tvmgraph.nn.Graph, as the OneFlow seeds describe it."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import tvmgraph
from tvmgraph import errors
from tvmgraph.target import target_for
from tests.conftest import ModuleGraph


class LinearGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module | None = None):
        super().__init__()
        self.linear = model if model is not None else nn.Linear(3, 8, bias=False)

    def build(self, x):
        return self.linear(x)


class ScaledLinearGraph(LinearGraph):
    def build(self, x):
        return self.linear(x) * 2.0


def test_name_is_class_name_and_instance_counter() -> None:
    """`name` is `ClassName_N`, N counting instances of that class from 0."""
    class FreshGraph(LinearGraph):
        pass

    assert [FreshGraph().name for _ in range(3)] == ["FreshGraph_0", "FreshGraph_1", "FreshGraph_2"]


def test_module_is_registered_and_shared_with_eager() -> None:
    model = nn.Linear(3, 8)
    graph = LinearGraph(model)
    # graph.linear is a proxy that forwards to the module, as in OneFlow (tvmgraph/graph_module.py)
    assert graph.linear.to(nn.Module) is model and graph.linear == model and isinstance(graph.linear, nn.Linear)
    assert [p for p, _ in graph.named_modules()] == ["linear"]
    other = nn.Linear(3, 8)
    graph.linear = other
    assert graph.linear.to(nn.Module) is other
    del graph.linear
    with pytest.raises(AttributeError):
        _ = graph.linear


def test_plain_attributes_stay_plain() -> None:
    graph = LinearGraph()
    graph.scale = 2.0
    assert graph.scale == 2.0 and [p for p, _ in graph.named_modules()] == ["linear"]


def test_training_is_false_without_optimizer() -> None:
    graph = LinearGraph()
    assert graph.training is False
    assert repr(graph.config) == "GraphConfig(training=False, )"


@pytest.mark.parametrize(
    "option",
    ["enable_cudnn_conv_heuristic_search_algo"],
)
def test_unbuilt_config_options_refuse_to_turn_on(option: str) -> None:
    """Every option the seeds list exists; one not built yet says so instead of being ignored."""
    config = LinearGraph().config
    getattr(config, option)(False)  # turning it off is always fine
    with pytest.raises(NotImplementedError, match=rf"GraphConfig\.{option} is not implemented"):
        getattr(config, option)(True)


def test_gradient_accumulation_steps_validation() -> None:
    config = LinearGraph().config
    config.set_gradient_accumulation_steps(1)
    with pytest.raises(ValueError, match="int >= 1"):
        config.set_gradient_accumulation_steps(0)
    config.set_gradient_accumulation_steps(4)  # built: tests/numeric/test_grad_accumulation.py
    assert config.gradient_accumulation_steps == 4


REPR_BEFORE = """\
(GRAPH:{name}:LinearGraph): (
  (CONFIG:config:GraphConfig(training=False, ))
  (MODULE:linear:Linear(in_features=3, out_features=8, bias=False)): (
    (PARAMETER:linear.weight:tensor(..., size=(8, 3), dtype=torch.float32, requires_grad=True)): ()
  )
)"""

REPR_AFTER = """\
(GRAPH:{name}:LinearGraph): (
  (CONFIG:config:GraphConfig(training=False, ))
  (INPUT:_{name}-input_0:tensor(..., size=(4, 3), dtype=torch.float32))
  (MODULE:linear:Linear(in_features=3, out_features=8, bias=False)): (
    (INPUT:_linear-input_0:tensor(..., size=(4, 3), dtype=torch.float32))
    (PARAMETER:linear.weight:tensor(..., size=(8, 3), dtype=torch.float32, requires_grad=True)): ()
    (OUTPUT:_linear-output_0:tensor(..., size=(4, 8), dtype=torch.float32))
  )
  (OUTPUT:_{name}-output_0:tensor(..., size=(4, 8), dtype=torch.float32))
)"""


def test_repr_before_and_after_first_call() -> None:
    """Seed 001: structure before the call; INPUT/OUTPUT entries with sizes after it."""
    graph = LinearGraph()
    assert repr(graph) == REPR_BEFORE.format(name=graph.name)
    graph(torch.randn(4, 3))
    assert repr(graph) == REPR_AFTER.format(name=graph.name)


def test_repr_shows_buffers_and_nested_inputs() -> None:
    class Pair(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(2).eval()

        def build(self, xs):
            return self.bn(xs[0] + xs[1])

    graph = Pair()
    graph([torch.randn(5, 2), torch.randn(5, 2)])
    text = repr(graph)
    assert "(BUFFER:bn.running_mean:tensor(..., size=(2,), dtype=torch.float32)): ()" in text
    assert "(BUFFER:bn.num_batches_tracked:tensor(..., size=(), dtype=torch.int64)): ()" in text
    assert f"(INPUT:_{graph.name}-input_0.0:tensor(..., size=(5, 2), dtype=torch.float32))" in text
    assert f"(INPUT:_{graph.name}-input_0.1:tensor(..., size=(5, 2), dtype=torch.float32))" in text


def test_debug_levels(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """v_level 0: stages; 1: modules; 2: ops; 3: source lines. Off: nothing below WARNING."""
    monkeypatch.setattr(tvmgraph.artifact, "compiled_cache", lambda: None)  # always lower and compile

    def messages(level: int | None) -> str:
        graph = ScaledLinearGraph()
        if level is not None:
            graph.debug(level)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tvmgraph"):
            graph(torch.randn(4, 3))
        return caplog.text

    off, v0, v1, v2, v3 = (messages(level) for level in (None, 0, 1, 2, 3))
    assert off == ""
    assert re.search(r"\(GRAPH:ScaledLinearGraph_\d+:ScaledLinearGraph\) start tracing build\(\)", v0)
    assert "end compiling for cpu" in v0 and "(MODULE:linear)" not in v0
    assert "(MODULE:linear) inputs (float32[4, 3]) -> outputs (float32[4, 8])" in v1
    assert "(OP:" not in v1 and "relax.matmul" in v2
    assert "aten.mm" not in v2
    assert re.search(r"\(OP:mm\) aten.mm.default from 'linear' \(Linear\) at File .*linear.py\", line \d+, in forward", v3)
    assert re.search(r"\(OP:mul\) aten.mul.Tensor from build\(\) itself at File .*test_graph_api.py\", line \d+, in build", v3)


def test_debug_mode_false_and_other_ranks_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    for kwargs in (dict(mode=False), dict(ranks=1), dict(ranks=[2, 3])):
        graph = LinearGraph()
        graph.debug(1, **kwargs)
        with caplog.at_level(logging.INFO, logger="tvmgraph"):
            graph(torch.randn(2, 3))
        assert caplog.text == "", kwargs
    with pytest.raises(ValueError, match="v_level must be an int in 0..3"):
        LinearGraph().debug(4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ranks="0"), r"ranks must be an int, a list of ints .* got '0'"),
    (dict(ranks=1.5), r"ranks must be an int, a list of ints .* got 1.5"),
    (dict(ranks=[0, "1"]), r"ranks must be .* got \[0, '1'\]"),
    (dict(mode="off"), r"mode must be True \(on\) or False \(off\), got 'off'"),
    (dict(v_level=True), r"v_level must be an int in 0..3, got True"),
])
def test_debug_refuses_values_it_does_not_take(kwargs: dict, message: str) -> None:
    """`ranks="0"` was read as the list ["0"] (debug output silently off on rank 0), 1.5 was a
    bare TypeError, `mode="off"` was taken for True."""
    with pytest.raises(errors.ConfigError, match=message):
        LinearGraph().debug(**{"v_level": 1, **kwargs})


def test_stages_can_be_run_one_by_one() -> None:
    """trace -> lower -> compile(target) -> bind(device, modules), each printable; graph.lowered
    is the last entry's Relax."""
    graph = LinearGraph()
    x = torch.randn(4, 3)
    traced = graph.trace(x)
    assert isinstance(traced, tvmgraph.TracedGraph) and "aten.linear" in traced.as_text()
    lowered = traced.lower()
    assert isinstance(lowered, tvmgraph.LoweredGraph)
    assert "def main(x: R.Tensor((4, 3)" in lowered.as_text() and "R.matmul" in lowered.as_text()
    program = lowered.compile(target_for(x.device), graph.config)
    assert isinstance(program, tvmgraph.CompiledProgram) and program.entry == "main"
    assert "main" in repr(program) and program.key is None  # built here, not stored
    compiled = program.bind(x.device, {"linear": graph.linear}, traced, None)
    assert isinstance(compiled, tvmgraph.CompiledGraph) and compiled.program is program
    (out,), loss = compiled.run([x])
    assert loss is None
    torch.testing.assert_close(out, graph.linear(x).detach())
    assert graph.lowered is None  # trace() alone does not populate the call cache
    graph(x)
    assert "R.matmul" in graph.lowered.as_text()


def test_graph_works_under_no_grad_and_outputs_do_not_require_grad() -> None:
    graph = ModuleGraph(nn.Linear(3, 2))
    with torch.no_grad():
        a = graph(torch.randn(1, 3))
    b = graph(torch.randn(1, 3))
    assert not a.requires_grad and not b.requires_grad

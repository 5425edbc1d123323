"""The pipeline checks every pass's result (tvmgraph/pipeline.py): one of tvmgraph's own passes
that breaks the module is left out of that graph's compile with one warning naming the pass,
the graph and the option that turns it off, and the graph still computes eager's numbers; a
TVM pass that fails raises PassError naming the pass and the graph.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import tvm
from torch import nn
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

import relay_passes.fuse_epilogue
import tvmgraph.pipeline
import tvmgraph.stages
from tests.conftest import ModuleGraph, assert_close
from tvmgraph.errors import PassError, TvmGraphError
from tvmgraph.pipeline import default_pipeline, register_pipeline
from tvmgraph.target import target_for


def _drop_a_binding(mod: tvm.IRModule) -> tvm.IRModule:
    """`main` without its first binding: its users now read an undefined variable."""
    main = mod["main"]
    block = main.body.blocks[0]
    bindings = list(block.bindings)[1:]
    body = relax.SeqExpr([relax.DataflowBlock(bindings), *main.body.blocks[1:]], main.body.body)
    mod = mod.clone()
    mod["main"] = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    return mod


@I.ir_module
class Small:
    @R.function
    def main(x: R.Tensor((2, 3), "float32"), w: R.Tensor((3, 3), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.relu(y)
            R.output(z)
        return z


@tvm.transform.module_pass(opt_level=0, name="FuseEpilogue")
class BrokenFuseEpilogue:
    """Stands in for tvmgraph's FuseEpilogue and drops a binding."""

    def __init__(self, enabled: bool = True, report=None) -> None:
        pass

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _drop_a_binding(mod)


@tvm.transform.module_pass(opt_level=0, name="ToyTVMPass")
def toy_tvm_pass(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Stands in for a TVM pass that fails."""
    raise RuntimeError("toy failure")


register_pipeline("test_broken_tvm_pass")(
    lambda target, config, report, tuning: [toy_tvm_pass, *default_pipeline(target, config, report, tuning)])


def _mlp() -> nn.Module:
    """(Each test calls it with its own batch size: a compiled-cache hit would compile nothing.)"""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


@pytest.mark.parametrize("checks", [True, False], ids=["checked", "fallback"])
def test_a_broken_pass_is_left_out_with_one_warning(
        checks: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A FuseEpilogue that drops a binding is left out: one warning from the "tvmgraph" logger
    names the pass, the graph and allow_fuse_add_to_output, and the output equals eager's.
    Checked: every pass is checked (the tests' setting). Fallback: checks off, so the compile
    fails and is run again with checks."""
    monkeypatch.setattr(relay_passes.fuse_epilogue, "FuseEpilogue", BrokenFuseEpilogue)
    monkeypatch.setattr(tvmgraph.stages, "settings",
                        dataclasses.replace(tvmgraph.stages.settings, check_passes=checks))
    model, x = _mlp(), torch.randn(3 if checks else 5, 8)
    graph = ModuleGraph(model)
    with caplog.at_level(logging.INFO, logger="tvmgraph"):
        out = graph(x)
    with torch.no_grad():
        assert_close(out, model(x))
    warnings = [r for r in caplog.records if r.name == "tvmgraph" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert message.startswith(f"{graph.name}: pass FuseEpilogue left an ill-formed module (")
    assert "graph.config.allow_fuse_add_to_output(False)" in message


def test_a_failing_tvm_pass_raises_pass_error() -> None:
    """A pass that is not tvmgraph's cannot be left out: PassError (a RuntimeError) names the
    graph, the pass and its reason."""
    model, x = _mlp(), torch.randn(6, 8)
    graph = ModuleGraph(model)
    lowered = graph.trace(x).lower()
    with pytest.raises(PassError) as info:
        lowered.build(target_for(x.device), graph.config, pipeline="test_broken_tvm_pass")
    assert isinstance(info.value, TvmGraphError) and isinstance(info.value, RuntimeError)
    assert str(info.value).startswith(f"{graph.name}: pass ToyTVMPass raised RuntimeError: toy failure. ")


def test_every_pass_of_the_default_pipeline_keeps_the_module_well_formed(
        caplog: pytest.LogCaptureFixture) -> None:
    """With checks on, a graph whose passes all work compiles with no warning (no pass of the
    default pipeline is ever left out for a false alarm)."""
    model, x = _mlp(), torch.randn(7, 8)
    with caplog.at_level(logging.WARNING, logger="tvmgraph"):
        out = ModuleGraph(model)(x)
    assert not caplog.records
    with torch.no_grad():
        assert_close(out, model(x))


OPTIONS = {
    "FuseEpilogue": "allow_fuse_add_to_output",
    "FuseModelUpdate": "allow_fuse_model_update_ops",
    "FuseCastScale": "allow_fuse_cast_scale",
    "StraightenBindings": "enable_straighten_algorithm",
    "CompressMemory": "enable_compress_memory",
    "RecomputeAttention": "enable_recompute_attention",
}


@pytest.mark.parametrize("name", list(OPTIONS), ids=list(OPTIONS))
def test_each_own_pass_is_left_out_naming_its_option(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """run_pass with a broken pass of that name returns the module as it was, with one warning
    naming the graph, the pass and the GraphConfig option that turns it off."""
    before = Small

    @tvm.transform.module_pass(opt_level=0, name=name)
    def broken(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return _drop_a_binding(mod)

    with caplog.at_level(logging.WARNING, logger="tvmgraph"):
        after = tvmgraph.pipeline.run_pass(broken, before, "SomeGraph_0", check=True)
    assert after.same_as(before)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"SomeGraph_0: pass {name} left an ill-formed module"]
    assert f"graph.config.{OPTIONS[name]}(False)" in caplog.records[0].getMessage()

"""The single-process parts of pipeline stages (`GraphModule.set_stage`): the option, cutting
build() into stages (tvmgraph/training/pipeline_split.py), the errors raised before any rank
is needed. tests/distributed/ trains two stages on two ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tvmgraph
from tests.conftest import TrainGraph
from tests.models import SmallCNN, mlp
from tvmgraph.errors import ConfigError, DistributedError, PipelineError, UnsupportedOptionError
from tvmgraph.spec import flatten
from tvmgraph.trace import trace_build
from tvmgraph.training.pipeline_split import split_stages


def graph_of(model: nn.Module) -> TrainGraph:
    return TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.1))


def test_set_stage_is_read_back_and_changes_the_options() -> None:
    graph = graph_of(mlp((12, 16, 5)))
    first = graph.model[0].to(tvmgraph.nn.GraphModule)
    first.set_stage(0)
    graph.model[2].to(tvmgraph.nn.GraphModule).set_stage(1, [1])
    assert (first.stage_id, first.stage_placement) == (0, 0)
    last = graph.model[2].to(tvmgraph.nn.GraphModule)
    assert (last.stage_id, last.stage_placement) == (1, 1)
    assert graph.config.pipeline_stages == (("model.0", 0, 0), ("model.2", 1, 1))
    assert "stage_id=1, stage_placement=1" in repr(last)

    class Placement:  # OneFlow's flow.placement carries its ranks
        ranks = [1]

    last.set_stage(1, Placement())
    assert last.stage_placement == 1
    with pytest.raises(ConfigError, match=r"set_stage\(1, placement\) takes the rank that runs the stage.*\[0, 1\]"):
        last.set_stage(1, [0, 1])
    with pytest.raises(ConfigError, match=r"takes a stage number >= 0, got -1"):
        last.set_stage(-1)


def trace(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    def build(x, y):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        return out, loss

    leaves, tree = flatten((x, y), "args")
    return trace_build("G", build, {"model": model}, tree, leaves, ["x", "y"]).exported


def ops(stage) -> list[str]:
    return [n.target.__name__ for n in stage.module.graph.nodes if n.op == "call_function"]


def test_split_puts_each_op_on_its_module_stage_and_the_loss_on_the_last() -> None:
    """Before: one program. After: stage 0 = the first Linear and the unstaged ReLU after it
    (the stage of its input), sending the ReLU's result; stage 1 = the last Linear and the
    loss, reading the labels itself and returning build()'s outputs and the loss."""
    model = mlp((12, 16, 5))
    exported = trace(model, torch.randn(4, 12), torch.randint(0, 5, (4,)))
    split = split_stages(exported, {"model.0": 0, "model.2": 1}, "G")
    first, last = split.stages
    assert ops(first) == ["linear.default", "relu.default"]
    assert ops(last) == ["linear.default", "cross_entropy_loss.default"]
    (name,) = first.sent
    assert last.received == [name] and first.received == []
    assert split.boundaries[name].shape == (4, 16) and split.boundaries[name].consumers == (1,)
    assert first.arguments == [0] and last.arguments == [1]  # x on stage 0, the labels on stage 1
    # the stages read the model's own parameters, not copies
    assert {id(p) for p in first.module.parameters()} == {id(model[0].weight), id(model[0].bias)}
    assert {id(p) for p in last.module.parameters()} == {id(model[2].weight), id(model[2].bias)}
    # run eagerly, the two stages compute what the whole program does
    x, y = torch.randn(4, 12), torch.randint(0, 5, (4,))
    (sent,) = first.module(x)
    out, loss, _ = last.module(sent, y)
    torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(loss, nn.functional.cross_entropy(model(x), y))


def test_split_of_a_cnn_keeps_batch_norm_updates_on_their_stage() -> None:
    model = SmallCNN(width=4)
    exported = trace(model, torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,)))
    split = split_stages(exported, {"model.features": 0, "model.classifier": 1}, "G")
    first, last = split.stages
    buffers = {n for n, _ in first.module.named_buffers()}
    assert any("running_mean" in n for n in buffers) and not list(last.module.buffers())
    assert "adaptive_avg_pool2d.default" in ops(first)  # model.pool has no stage: that of its input


def staged_mlp(*stages: int) -> TrainGraph:
    """An MLP 12-16-5 whose two Linear layers get `stages`."""
    graph = graph_of(mlp((12, 16, 5)))
    for index, stage in zip((0, 2), stages):
        graph.model[index].to(tvmgraph.nn.GraphModule).set_stage(stage)
    return graph


def test_stages_out_of_the_computations_order_are_a_pipeline_error() -> None:
    with pytest.raises(PipelineError, match=r"'model.2' runs on pipeline stage 0 but reads a value that stage 1 "
                                            r"computes.*must follow the order of the computation"):
        staged_mlp(1, 0)(torch.randn(4, 12), torch.randint(0, 5, (4,)))


def test_a_weight_tied_across_stages_is_a_pipeline_error() -> None:
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(8, 8)
            self.head = nn.Linear(8, 8)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(torch.relu(self.embed(x)))

    graph = graph_of(Tied())
    graph.model.embed.to(tvmgraph.nn.GraphModule).set_stage(0)
    graph.model.head.to(tvmgraph.nn.GraphModule).set_stage(1)
    with pytest.raises(PipelineError, match=r"'model.(embed|head).weight' is read on pipeline stages \[0, 1\].*same stage"):
        graph(torch.randn(4, 8), torch.randint(0, 8, (4,)))


def test_stages_without_a_process_group_of_that_size_are_a_distributed_error() -> None:
    with pytest.raises(DistributedError, match=r"2 pipeline stage\(s\) on ranks \{0: 0, 1: 1\}.*process group has "
                                               r"1 rank.*torchrun --nproc_per_node 2"):
        staged_mlp(0, 1)(torch.randn(4, 12), torch.randint(0, 5, (4,)))


def test_stages_of_an_inference_graph_or_with_zero_are_refused() -> None:
    model = mlp((12, 16, 5))

    class Infer(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            return self.model(x)

    graph = Infer()
    graph.model[0].to(tvmgraph.nn.GraphModule).set_stage(0)
    with pytest.raises(UnsupportedOptionError, match=r"set_stage splits a training graph"):
        graph(torch.randn(4, 12))
    training = graph_of(model)
    training.model[0].to(tvmgraph.nn.GraphModule).set_stage(0)
    training.config.enable_zero(True)
    with pytest.raises(UnsupportedOptionError, match=r"enable_zero with pipeline stages"):
        training(torch.randn(4, 12), torch.randint(0, 5, (4,)))


@pytest.mark.parametrize("dropout, random", [(0.0, False), (0.1, True)])
def test_attention_without_dropout_may_run_on_an_early_stage(dropout: float, random: bool) -> None:
    """scaled_dot_product_attention is a seeded op in torch's tags; with dropout_p=0 it draws
    nothing, so stage 0 may recompute it. With dropout it is a PipelineError."""
    from tvmgraph.training.pipeline_split import check_stage_ops

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.layer(x).mean(1))

    model = Encoder()
    exported = trace(model, torch.randn(2, 5, 16), torch.randint(0, 4, (2,)))
    first, _ = split_stages(exported, {"model.layer": 0, "model.head": 1}, "G").stages
    if random:
        with pytest.raises(PipelineError, match=r"pipeline stage 0 calls aten\.(scaled_dot_product_attention|\w*dropout)\S* \(random\)"):
            check_stage_ops(first, "G")
    else:
        check_stage_ops(first, "G")


def test_a_train_step_with_stages_cannot_be_saved(tmp_path) -> None:
    """A saved train step runs in one process: the stages would be dropped silently."""
    with pytest.raises(UnsupportedOptionError, match=r"cannot carry pipeline stages \(set_stage\)"):
        tvmgraph.save(staged_mlp(0, 1), tmp_path / "g", example_args=(torch.randn(4, 12), torch.randint(0, 5, (4,))),
                      program="train_step")

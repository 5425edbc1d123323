"""enable_frozen_weights(): what an inference graph computes from its weights alone (their
packing for the matmuls, their casts under AMP, a shared transpose) runs once per weight version.

Every case compares with eager (float32 tolerances of conftest.TOLERANCES) after the weights
change in each way the option promises to see: in place through the parameter, by
load_state_dict, by an optimizer step, by replacing the parameter; and after a write it does
not see (`.data`), once `graph.refresh_weights()` was called.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import tvm

import tvmgraph
from relay_passes.weight_packing import PACK_FUNCTION, PREPACKED_SUFFIX
from tests.conftest import ModuleGraph, TrainGraph, assert_close
from tvmgraph.errors import ConfigError


def _mlp() -> torch.nn.Module:
    # 64 rows x 256 -> 512: products the Matmul rule packs W for (PREPACK_MAX_ROWS).
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10)).eval()


def _frozen(model: torch.nn.Module) -> ModuleGraph:
    graph = ModuleGraph(model)
    graph.config.enable_frozen_weights(True)
    return graph


def _check(graph: ModuleGraph, model: torch.nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected = model(x)
    assert_close(graph(x), expected)


def test_packs_the_weights_once_and_matches_eager() -> None:
    model, x = _mlp(), torch.randn(64, 256)
    graph = _frozen(model)
    _check(graph, model, x)
    packed = graph.compiled.packed_weights
    assert packed is not None, "the program packs no weight"
    first = packed.get(graph.compiled.binder.tensors(), graph.compiled.binder.tensors())
    assert len(first) == 3  # one per layer
    _check(graph, model, torch.randn(64, 256))
    # Unchanged weights: the same packed tensors, not packed again.
    again = packed.get(graph.compiled.binder.tensors(), graph.compiled.binder.tensors())
    assert all(a is b for a, b in zip(first, again))


def test_sees_every_change_torch_counts() -> None:
    model, x = _mlp(), torch.randn(64, 256)
    graph = _frozen(model)
    _check(graph, model, x)
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # in place through the parameter
    _check(graph, model, x)
    model.load_state_dict(_mlp().state_dict())
    _check(graph, model, x)
    model[2].weight = torch.nn.Parameter(torch.randn(512, 512) * 0.05)  # replaced
    _check(graph, model, x)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().sum().backward()
    optimizer.step()
    _check(graph, model, x)


def test_sees_the_steps_of_a_training_graph_on_the_same_model() -> None:
    """A training graph's kernels update the parameters in place, out of torch's sight: the
    frozen graph kept the weights it packed before the step (0.15 off eager). The step now
    counts its writes in torch's version counter, as eager's optimizer step does; autograd
    then refuses a backward through a forward made before the step, as in eager."""
    model, x = _mlp(), torch.randn(64, 256)
    graph = _frozen(model)
    train = TrainGraph(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.5))
    _check(graph, model, x)
    before = model(x).square().sum()  # saves the weights for its backward
    train(torch.randn(64, 256), torch.randn(64, 10))
    _check(graph, model, x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        before.backward()


def test_a_transposed_weight_shared_by_steps_is_computed_once() -> None:
    """One layer applied three times: ShareTransposes computes W.T once per call, which the
    frozen program computes once per weight version (and packs for the products)."""
    layer = torch.nn.Linear(256, 256)
    model = torch.nn.Sequential(layer, torch.nn.Tanh(), layer, torch.nn.Tanh(), layer).eval()
    x = torch.randn(64, 256)
    graph = _frozen(model)
    _check(graph, model, x)
    with torch.no_grad():
        layer.weight.mul_(-1.0)
    _check(graph, model, x)
    assert graph.compiled.packed_weights is not None


class _ReturnsWeights(tvmgraph.nn.Graph):
    def __init__(self, layer: torch.nn.Linear):
        super().__init__()
        self.layer = layer

    def build(self, x):
        return self.layer(x), self.layer.weight * 2, self.layer.weight.t(), (self.layer.weight * 3).reshape(-1)


def test_values_computed_from_weights_and_returned_are_computed_every_call() -> None:
    """The caller owns what build() returns: a value computed from the weights alone and
    returned is computed in every call, never a kept tensor that changing an output changes."""
    layer = torch.nn.Linear(256, 512).eval()
    graph = _ReturnsWeights(layer)
    graph.config.enable_frozen_weights(True)
    x = torch.randn(64, 256)
    _, doubled, transposed, flat = graph(x)
    doubled.add_(1.0)
    transposed.zero_()
    flat.zero_()
    out, doubled, transposed, flat = graph(x)
    with torch.no_grad():
        assert_close(out, layer(x))
        assert_close(doubled, layer.weight * 2)
        assert_close(transposed, layer.weight.t())
        assert_close(flat, (layer.weight * 3).reshape(-1))


def test_refresh_weights_after_a_write_through_data() -> None:
    model, x = _mlp(), torch.randn(64, 256)
    graph = _frozen(model)
    _check(graph, model, x)
    model[2].weight.data.copy_(torch.randn(512, 512) * 0.05)  # torch's version counter misses it
    graph.refresh_weights()
    _check(graph, model, x)


def test_dynamic_batch_and_bfloat16() -> None:
    model = _mlp()
    graph = _frozen(model)
    graph.config.enable_dynamic_batch(True)
    for rows in (64, 7, 33):
        _check(graph, model, torch.randn(rows, 256))
    amp = _frozen(model)
    amp.config.enable_amp(True, dtype=torch.bfloat16)
    plain = ModuleGraph(model)
    plain.config.enable_amp(True, dtype=torch.bfloat16)
    x = torch.randn(64, 256)
    # Under AMP the weights' bfloat16 casts (kernels of their own) run once too: the same
    # kernels, earlier, bit for bit the unfrozen program's.
    assert torch.equal(amp(x), plain(x))
    assert amp.compiled.packed_weights is not None


def test_a_training_graph_refuses_it() -> None:
    model = torch.nn.Linear(8, 4)
    graph = TrainGraph(model, torch.nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.enable_frozen_weights(True)
    with pytest.raises(ConfigError, match=r"enable_frozen_weights\(\) is for inference graphs.*"
                                          r"enable_frozen_weights\(False\)"):
        graph(torch.randn(4, 8), torch.randn(4, 4))


def test_the_option_takes_booleans_only() -> None:
    with pytest.raises(ConfigError, match=r"enable_frozen_weights\(mode\) takes True or False"):
        tvmgraph.nn.Graph().config.enable_frozen_weights("yes")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to compile CUDA")
def test_a_frozen_graph_built_for_cuda_is_the_unfrozen_program() -> None:
    """On a GPU the option changes nothing yet: the same kernels, no pack_weights."""
    graph = _frozen(_mlp())
    lowered = graph.trace(torch.randn(64, 256)).lower()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    optimized, _ = lowered.build(target, graph.config)
    names = [gv.name_hint for gv in optimized.get_global_vars()]
    assert PACK_FUNCTION not in names and not any(n.endswith(PREPACKED_SUFFIX) for n in names)

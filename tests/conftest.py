"""Shared test helpers: per-dtype tolerances and a graph that wraps one module."""

from __future__ import annotations

import os
import tempfile

# A fresh compiled cache per test session (never the user's ~/.cache); set before tvmgraph is
# imported, since tvmgraph reads its settings once.
os.environ.setdefault("TVMGRAPH_CACHE_DIR", tempfile.mkdtemp(prefix="tvmgraph-test-cache-"))
# Every pass's result is checked (relax.analysis.well_formed) in every compile of the tests.
os.environ.setdefault("TVMGRAPH_CHECK_PASSES", "1")
# A CPU schedule rule's own Python error fails the test instead of leaving the kernel to a slower
# rule (tvmgraph/schedules/apply.py).
os.environ.setdefault("TVMGRAPH_STRICT_SCHEDULES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import tvmgraph  # noqa: E402

# Tolerances for graph-vs-eager comparisons, by dtype (JAX public_test_util style).
# float32 kernels in TVM reassociate sums differently from MKL/oneDNN, hence not bit-exact.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2),  # torch.testing's defaults
    torch.int64: dict(atol=0, rtol=0),
    torch.int8: dict(atol=0, rtol=0),
    torch.int32: dict(atol=0, rtol=0),
    torch.uint8: dict(atol=0, rtol=0),
    torch.bool: dict(atol=0, rtol=0),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **override) -> None:
    """Compare shape and dtype first, then values within the dtype's tolerance."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    tol = {**TOLERANCES[expected.dtype], **override}
    torch.testing.assert_close(actual, expected, **tol)


class ModuleGraph(tvmgraph.nn.Graph):
    """The simplest graph: build(*args) = model(*args)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def build(self, *args):
        return self.model(*args)


class TrainGraph(tvmgraph.nn.Graph):
    """Seed 002's LinearTrainGraph, for any model, loss and optimizers."""

    def __init__(self, model: torch.nn.Module, loss_fn: torch.nn.Module, *optimizers, lr_sch=None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        for i, optimizer in enumerate(optimizers):
            self.add_optimizer(optimizer, lr_sch=lr_sch if i == 0 else None)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def lower_train_step(graph: tvmgraph.nn.Graph, *args):
    """`graph` traced on `args` and its training step (forward, autodiff, optimizer update)
    lowered without calling it: (the LoweredGraph, its compile options), for build-only tests."""
    from tvmgraph import entry

    traced = graph.trace(*args)
    options = traced.signature.options
    state = graph._state()
    plan = entry.training_plan(graph.name, state.optimizers, traced, graph.named_parameters, options,
                               state.grad_scaler)
    return traced.lower(plan), options


def assert_steps_match_eager(graph: tvmgraph.nn.Graph, model: torch.nn.Module, reference: torch.nn.Module,
                             loss_fn, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1, steps: int = 2) -> None:
    """`graph` (a TrainGraph of `model` with SGD, momentum 0.9, learning rate `lr`) against
    `reference` stepped the same way in eager: each step's loss, then every parameter."""
    opt = torch.optim.SGD(reference.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        loss = graph(x, y)
        opt.zero_grad()
        expected = loss_fn(reference(x), y)
        expected.backward()
        opt.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-6, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=1e-5)


class SGDStep(tvmgraph.nn.Graph):
    """One SGD step with lr=1 on `model(*inputs)` (a scalar loss): a parameter moves by minus its
    gradient. Momentum changes nothing on the first step (the buffer starts as the gradient)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))

    def build(self, *inputs):
        loss = self.model(*inputs)
        loss.backward()
        return loss


class Fn(torch.nn.Module):
    """A function of the inputs as a module, so that a graph can hold it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


# The longest modules (minutes each on 2 cores), run first: `make test` shares the modules out
# to two pytest-xdist workers in collection order (--dist loadfile --no-loadscope-reorder, see
# the Makefile), and one of these last left a worker alone for ten minutes at the end.
LONGEST_FIRST = ("tests/numeric/test_opinfo.py", "tests/numeric/test_tuning.py",
                 "tests/numeric/test_dynamic_batch.py", "tests/distributed/test_data_parallel.py",
                 "tests/unit/test_compiled_cache.py", "tests/numeric/test_model_zoo.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable: the order within a module, and of the others, is kept


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)

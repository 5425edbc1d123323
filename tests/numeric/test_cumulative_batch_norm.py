"""Batch norm with `momentum=None` (a cumulative moving average) in a training graph
(tvmgraph/cumulative_batch_norm.py), against eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import TrainGraph


@pytest.mark.parametrize("norm", [lambda: nn.BatchNorm1d(6, momentum=None), lambda: nn.BatchNorm2d(6, momentum=None)],
                         ids=["1d", "2d"])
def test_a_cumulative_average_batch_norm_trains_as_in_eager(norm) -> None:
    """`momentum=None` (a cumulative moving average) was a TraceError: torch computes its factor
    as 1 / float(num_batches_tracked), which export cannot trace (cumulative_batch_norm.py).
    Three steps: each loss, the parameters, the running statistics and the batch count."""
    torch.manual_seed(0)
    two_d = isinstance(norm(), nn.BatchNorm2d)
    model = nn.Sequential(nn.Conv2d(3, 6, 3) if two_d else nn.Linear(4, 6), norm(), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(2))
    x = torch.randn(8, 3, 5, 5) if two_d else torch.randn(8, 4)
    model(x)  # materialize the lazy layer
    reference = copy.deepcopy(model)
    y = torch.randn(8, 2)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        loss = graph(x * 2 + 1, y)
        optimizer.zero_grad()
        expected = nn.functional.mse_loss(reference(x * 2 + 1), y)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    for (name, value), want in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, want, atol=1e-5, rtol=1e-5, msg=name)
    assert int(model[1].num_batches_tracked) == 4  # the materializing call, then three steps

"""The MobileNetV2-style CNN of the demo learns digits in graph mode (>= 95% training accuracy)."""

from __future__ import annotations

import pytest
import torch

from examples.digits import batches, digits_tensors
from examples.train_digits import TrainGraph, accuracy, make_model, make_optimizer


@pytest.mark.slow
def test_cnn_reaches_95_percent_training_accuracy_on_digits() -> None:
    images, labels = digits_tensors()
    epochs, batch = 5, 64
    model = make_model()
    graph = TrainGraph(model, *make_optimizer(model, epochs * (len(images) // batch)))
    data = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for x, y in batches(images, labels, batch, data):
            loss = graph(x, y)
    assert graph.num_compiled == 1
    assert loss.item() < 0.3
    assert accuracy(model, images, labels) >= 0.95

"""Inference in graph mode on scikit-learn's digits (ships with the package, no download).

Trains a small MLP eagerly for a few epochs, then runs the test set through a tvmgraph graph and
through eager PyTorch, and prints accuracy, agreement and time per batch for both.
"""

from __future__ import annotations

import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import tvmgraph


def digits(batch: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).reshape(-1, 64) / 16.0
    y = torch.tensor(data.target)
    n_test = (len(x) // 5) // batch * batch
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


class InferenceGraph(tvmgraph.nn.Graph):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def main() -> None:
    torch.manual_seed(0)
    x_train, y_train, x_test, y_test = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _epoch in range(10):
        for i in range(0, len(x_train), 64):
            loss = nn.functional.cross_entropy(model(x_train[i:i + 64]), y_train[i:i + 64])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    model.eval()
    graph = InferenceGraph(model)
    print(graph)
    batches = x_test.split(64)
    start = time.perf_counter()
    graph(batches[0])
    print(f"first call (trace + lower + compile + run): {time.perf_counter() - start:.2f} s")

    for name, fn in (("graph", graph), ("eager", model)):
        with torch.no_grad():
            start = time.perf_counter()
            preds = torch.cat([fn(b).argmax(-1) for b in batches])
            per_batch = (time.perf_counter() - start) / len(batches) * 1e3
        accuracy = (preds == y_test).float().mean().item()
        print(f"{name:>5}: test accuracy {accuracy:.3f}, {per_batch:.3f} ms per batch of 64")
    with torch.no_grad():
        agree = all(torch.allclose(graph(b), model(b), atol=1e-5) for b in batches)
    print(f"graph and eager logits agree within 1e-5: {agree}")


if __name__ == "__main__":
    main()

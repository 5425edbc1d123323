"""F.ctc_loss / nn.CTCLoss in a graph (tvmgraph/ctc_loss.py), against eager: values for each
reduction, padded and concatenated targets, repeated labels, lengths as tensors or lists, an
impossible alignment (inf, or 0 with zero_infinity), the gradient reaching log_probs directly,
and a CRNN-style model trained two steps. torch.export could not trace torch's own op."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import ModuleGraph, SGDStep, TrainGraph

STEPS, BATCH, CLASSES, LABELS = 12, 4, 6, 5


def _case(variant: str) -> tuple:
    torch.manual_seed(0)
    targets = torch.randint(1, CLASSES, (BATCH, LABELS))
    targets[:, 1] = targets[:, 0]  # a repeated label needs a blank between
    input_lengths, target_lengths = torch.tensor([12, 10, 3, 12]), torch.tensor([5, 3, 0, 5])
    if variant == "concatenated":
        targets = torch.cat([targets[b, :target_lengths[b]] for b in range(BATCH)])
    if variant == "impossible":
        input_lengths = torch.tensor([12, 12, 12, 2])  # 5 labels (one repeated) cannot fit in 2 steps
    if variant == "lists":
        input_lengths, target_lengths = input_lengths.tolist(), target_lengths.tolist()
    return targets, input_lengths, target_lengths


class LogProbs(nn.Module):
    """The loss of log-probabilities held as a parameter (their gradient is torch's own)."""

    def __init__(self, variant: str, reduction: str, zero_infinity: bool) -> None:
        super().__init__()
        self.log_probs = nn.Parameter(torch.randn(STEPS, BATCH, CLASSES).log_softmax(2))
        self.case, self.reduction, self.zero_infinity = _case(variant), reduction, zero_infinity

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        loss = F.ctc_loss(self.log_probs, *self.case, reduction=self.reduction, zero_infinity=self.zero_infinity)
        return (loss * weight).sum() if self.reduction == "none" else loss * weight.sum()


CASES = {
    "padded-mean": ("padded", "mean", False),
    "padded-sum": ("padded", "sum", False),
    "padded-none": ("padded", "none", False),
    "concatenated-mean": ("concatenated", "mean", False),
    "lists-sum": ("lists", "sum", False),
    "impossible-zero-infinity": ("impossible", "mean", True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_ctc_loss_value_and_gradient_are_eagers(case: tuple) -> None:
    torch.manual_seed(1)
    model = LogProbs(*case)
    reference = copy.deepcopy(model)
    weight = torch.rand(BATCH)
    loss = SGDStep(model)(weight)
    expected = reference(weight)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.log_probs.detach(), (reference.log_probs - reference.log_probs.grad).detach(),
                               atol=1e-5, rtol=1e-5)


def test_an_impossible_alignment_is_an_infinite_loss() -> None:
    targets, input_lengths, target_lengths = _case("impossible")
    log_probs = torch.randn(STEPS, BATCH, CLASSES).log_softmax(2)

    class Losses(nn.Module):
        def forward(self, log_probs: torch.Tensor) -> torch.Tensor:
            return F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="none")

    got, want = ModuleGraph(Losses())(log_probs), Losses()(log_probs)
    assert torch.isinf(want[3]) and torch.isinf(got[3])
    torch.testing.assert_close(got[:3], want[:3])


class CRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(5, 8, 3, padding=1)
        self.rnn = nn.GRU(8, 8, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.fc(self.rnn(h)[0]).log_softmax(-1).transpose(0, 1)  # (T, B, C)


def test_a_crnn_trains_with_ctc_as_in_eager() -> None:
    torch.manual_seed(0)
    targets, input_lengths, target_lengths = _case("padded")
    criterion = nn.CTCLoss(blank=0, zero_infinity=True)

    class Loss(nn.Module):
        def forward(self, log_probs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return criterion(log_probs, y, input_lengths, target_lengths)

    model = CRNN()
    reference = copy.deepcopy(model)
    graph = TrainGraph(model, Loss(), torch.optim.Adam(model.parameters(), lr=0.01))
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    x = torch.randn(BATCH, STEPS, 5)
    for _ in range(2):
        loss = graph(x, targets)
        optimizer.zero_grad()
        expected = Loss()(reference(x), targets)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-5, rtol=1e-4)

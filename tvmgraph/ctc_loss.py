"""`F.ctc_loss` (and nn.CTCLoss) while build() is traced: the CTC forward recursion written with
torch ops of static shape, so that export can trace it and autodiff differentiate it.

torch's own `aten._ctc_loss` returns its alpha table with a length that depends on the targets'
values, which export refuses (DynamicOutputShapeException). Here, for each sequence b of the
batch, over the extended labels l' (a blank, then each target followed by a blank: 2S + 1 of
them, S the padded target length, or the total length of 1-D concatenated targets):

    alpha_0(j)  = log p_0(l'_j)                          for j = 0, and j = 1 if the target is not empty
    alpha_t(j)  = logsumexp(alpha_{t-1}(j), alpha_{t-1}(j-1), alpha_{t-1}(j-2) if l'_j is a label
                            other than l'_{j-2}) + log p_t(l'_j)      for t < input_length(b)
    loss(b)     = -logsumexp(alpha_T(2 S_b), alpha_T(2 S_b - 1))

with the time loop unrolled over the static input length. "Impossible" (positions past
2 S_b + 1, the alignments that cannot start there) is `IMPOSSIBLE`, a finite -1e30, not -inf:
chained log-sum-exps over -inf gave NaN gradients in the compiled program (0 * inf in the
backward pass), and with a finite value every step's arithmetic stays finite. A loss from an
impossible alignment (above 1e29) is +inf, as torch's (0 with `zero_infinity=True`). Half
precision log-probabilities are computed in float32, as autocast runs torch's. The reductions
are torch's: `mean` divides each loss by its target length (at least 1) and averages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

IMPOSSIBLE = -1e30
_INFINITE_LOSS = 1e29  # a loss above this summed IMPOSSIBLE


def _logsumexp(*values: torch.Tensor) -> torch.Tensor:
    """logsumexp over `values` (one shape)."""
    stacked = torch.stack(values)
    top = stacked.amax(0).detach()  # any shift gives the same value and gradient
    return torch.log(torch.exp(stacked - top).sum(0)) + top


def _padded_targets(targets: torch.Tensor, target_lengths: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, S) labels: padded targets as given, 1-D concatenated ones cut per sequence (S = their
    total length, an upper bound of each; positions past a target's length are masked later)."""
    if targets.dim() == 2:
        return targets.long()
    total = targets.shape[0]
    starts = torch.cumsum(target_lengths, 0) - target_lengths
    index = (starts[:, None] + torch.arange(total)[None, :]).clamp(max=max(total - 1, 0))
    return targets.long()[index] if total else targets.long().reshape(batch, 0)


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths, target_lengths, blank: int = 0,
             reduction: str = "mean", zero_infinity: bool = False) -> torch.Tensor:
    """F.ctc_loss's value and gradient (see the module docstring)."""
    if log_probs.dtype in (torch.float16, torch.bfloat16):
        log_probs = log_probs.float()
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs, targets = log_probs.unsqueeze(1), targets.unsqueeze(0)
    steps, batch, _ = log_probs.shape
    input_lengths = torch.as_tensor(input_lengths, dtype=torch.long).reshape(batch)
    target_lengths = torch.as_tensor(target_lengths, dtype=torch.long).reshape(batch)
    labels = _padded_targets(targets, target_lengths, batch)
    width = 2 * labels.shape[1] + 1
    blanks = torch.full_like(labels, blank)
    extended = torch.cat([torch.stack([blanks, labels], 2).reshape(batch, width - 1),
                          torch.full((batch, 1), blank, dtype=torch.long)], 1)  # (B, 2S + 1)
    position = torch.arange(width)[None, :]
    inside = position < 2 * target_lengths[:, None] + 1
    previous = torch.cat([torch.full((batch, 2), blank, dtype=torch.long), extended[:, :-2]], 1)
    skips = (position >= 2) & (extended != blank) & (extended != previous)
    emit = log_probs.gather(2, extended[None].expand(steps, batch, width))  # (T, B, 2S + 1)
    impossible = torch.full((batch, width), IMPOSSIBLE, dtype=log_probs.dtype)
    first = (position == 0) | ((position == 1) & (target_lengths[:, None] > 0))
    alpha = torch.where(first & inside, emit[0], impossible)
    for t in range(1, steps):
        one = torch.cat([impossible[:, :1], alpha[:, :-1]], 1)
        two = torch.where(skips, torch.cat([impossible[:, :2], alpha[:, :-2]], 1), impossible)
        advanced = torch.where(inside, _logsumexp(alpha, one, two) + emit[t], impossible)
        alpha = torch.where((t < input_lengths)[:, None], advanced, alpha)
    last = (2 * target_lengths)[:, None]
    before = torch.where(target_lengths[:, None] > 0, alpha.gather(1, (last - 1).clamp(min=0)), impossible[:, :1])
    loss = -_logsumexp(alpha.gather(1, last), before)[:, 0]
    # torch's gradient w.r.t. log_probs is the one through a log_softmax: exp(log_probs) more
    # than the recursion's own, at each step a sequence reads. A term of value 0 adds it, so
    # that a gradient reaching log_probs directly is torch's too (through a log_softmax it
    # cancels, and both give the same gradient).
    probabilities = torch.exp(log_probs).sum(2)  # (T, B)
    read = torch.arange(steps)[:, None] < input_lengths[None, :]
    loss = loss + torch.where(read, probabilities - probabilities.detach(), torch.zeros_like(probabilities)).sum(0)
    infinite = loss > _INFINITE_LOSS
    loss = torch.where(infinite, torch.zeros_like(loss) if zero_infinity else torch.full_like(loss, float("inf")), loss)
    if unbatched:
        loss = loss[0]
    if reduction == "mean":
        return (loss / target_lengths.clamp(min=1).to(loss.dtype)).mean()
    if reduction == "sum":
        return loss.sum()
    return loss


@contextlib.contextmanager
def traceable() -> Iterator[None]:
    """F.ctc_loss is `ctc_loss` above while build() is traced."""
    original = F.ctc_loss
    F.ctc_loss = ctc_loss
    try:
        yield
    finally:
        F.ctc_loss = original

"""Decompositions tvmgraph uses instead of torch's own, where torch's give other numbers than
its eager kernels (tests/numeric/test_silent_ops.py).

- `multilabel_margin_loss_forward`: torch 2.13's decomposition also sums the label slots after
  a target's first -1 (the padding), so any target with padding gave a larger loss than eager
  (1.25 became 8.92). Here those slots are masked out, and the hinge is `where(z > 0, z, 0)`:
  the eager kernel's gradient stops at z == 0, a clamp's would not.

The others give eager's values but NaN gradients where eager's are finite: a `where` or
`maximum` keeps the value finite, but autodiff multiplies the unused branch's infinite
derivative by zero.
- `binary_cross_entropy` at a probability of exactly 0 or 1 (a saturated sigmoid): eager's
  gradient is `(p - y) / max(p (1 - p), 1e-12)`. Here the loss carries that gradient through
  `stop_gradient` (value `loss + (p - stop(p)) * stop(dp)`, exactly the loss).
- `std`, `std_mean` of a constant slice: eager's gradient is 0 there; `sqrt(var)` gave NaN.
- `sinc` at 0: eager's gradient is 0; `sin(pi x) / (pi x)` gave NaN.
- `logit` at 1: eager's gradient is inf; `log(x / (1 - x))` gave NaN (0 * inf).
- `_euclidean_dist` (`torch.cdist` with p=2 over more than 25 rows, or `compute_mode=
  "use_mm_for_euclid_dist"`) at a distance of 0 (`cdist(e, e)`'s diagonal): eager's gradient
  is `(x1 - x2) / d`, masked to 0 there; the square root of the product form gave NaN, and a
  triplet loss over a batch of 30 embeddings trained on NaN.

One skips what eager does:
- `lstm`, `gru`, `rnn_tanh`, `rnn_relu` with `dropout` between layers in training: torch's
  `_rnn_helper` sets the dropout to 0 unless `num_layers < i - 1`, never true, so a 2-layer
  LSTM(dropout=0.5) trained with none (every call gave the eval-mode output). Here such an RNN
  runs layer by layer, with torch's dropout on each layer's output but the last.

And one gives eager's values but another gradient:
- `index_fill` with a tensor value: torch's decomposition copies the value into every slice
  the index lists, so a slice listed twice counted twice in the value's gradient (eager's
  counts each filled slice once: -10.4 came out about 0.3 for an index with two repeats).
  Here the fill is a `where` over a mask of the listed slices.
"""

from __future__ import annotations

import math

import torch

from . import stop_gradient as _stop_gradient  # noqa: F401  (registers tvmgraph::stop_gradient)

aten = torch.ops.aten
_stop = torch.ops.tvmgraph.stop_gradient.default

_REDUCTION_NONE, _REDUCTION_MEAN = 0, 1


def _reduce(loss: torch.Tensor, reduction: int) -> torch.Tensor:
    if reduction == _REDUCTION_MEAN:
        return loss.mean()
    return loss if reduction == _REDUCTION_NONE else loss.sum()


def multilabel_margin_loss_forward(input: torch.Tensor, target: torch.Tensor,
                                   reduction: int) -> tuple[torch.Tensor, torch.Tensor]:
    target_shape = target.shape
    scores, labels = torch.atleast_2d(input), torch.atleast_2d(target)
    dim = scores.shape[1]
    idx = torch.arange(dim, device=labels.device)
    end = torch.amin(torch.where(labels == -1, idx, dim), dim=-1, keepdim=True)
    in_use = idx < end  # [n, slot]: the labels before the first -1
    label_score = torch.gather(scores, -1, torch.where(in_use, labels, 0))  # [n, slot]
    is_target = torch.any(idx == torch.where(in_use, labels, -1).unsqueeze(-1), dim=1)  # [n, j]
    z = 1.0 - label_score.unsqueeze(-1) + scores.unsqueeze(1)  # [n, slot, j]
    z = torch.where(z > 0, z, 0.0) / dim
    z = torch.where(is_target.unsqueeze(1) | ~in_use.unsqueeze(-1), 0.0, z)
    loss = z.sum(dim=(1, 2))
    if input.dim() <= 1:
        loss = loss.reshape(())
    return _reduce(loss, reduction), is_target.to(input.dtype).reshape(target_shape)


def binary_cross_entropy(p: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                         reduction: int = _REDUCTION_MEAN) -> torch.Tensor:
    log_p = torch.clamp_min(torch.log(p), -100)  # torch's clamp of the logs
    log_q = torch.clamp_min(torch.log1p(-p), -100)
    loss = -(target * log_p + (1 - target) * log_q)
    d_p = (p - target) / torch.clamp_min(p * (1 - p), 1e-12)  # eager's gradients
    d_target = log_q - log_p
    loss = _stop(loss) + (p - _stop(p)) * _stop(d_p) + (target - _stop(target)) * _stop(d_target)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction)


def _sqrt_of_variance(var: torch.Tensor) -> torch.Tensor:
    # `== 0`, not `> 0`: a NaN variance (one element with correction 1, a NaN input) stays NaN.
    zero = var == 0
    return torch.where(zero, 0.0, torch.sqrt(torch.where(zero, 1.0, var)))


def std(x: torch.Tensor, dim: list[int] | None = None, *, correction: float | None = None,
        keepdim: bool = False) -> torch.Tensor:
    return _sqrt_of_variance(torch.var(x, dim, correction=correction, keepdim=keepdim))


def std_mean(x: torch.Tensor, dim: list[int] | None = None, *, correction: float | None = None,
             keepdim: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(x, dim, correction=correction, keepdim=keepdim)
    return _sqrt_of_variance(var), mean


def sinc(x: torch.Tensor) -> torch.Tensor:
    zero = x == 0
    scaled = math.pi * torch.where(zero, 1.0, x)
    return torch.where(zero, 1.0, torch.sin(scaled) / scaled)


def index_fill(x: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor | float) -> torch.Tensor:
    """x with the slices along `dim` that `index` lists (negative from the end) set to value."""
    size = x.shape[dim] if x.ndim else 1
    index = index.reshape(-1)
    index = torch.where(index < 0, index + size, index)
    listed = (torch.arange(size, device=x.device)[:, None] == index[None, :]).any(1)
    shape = [1] * x.ndim
    if x.ndim:
        shape[dim] = size
    value = value.to(x.dtype) if isinstance(value, torch.Tensor) else torch.scalar_tensor(value, dtype=x.dtype)
    return torch.where(listed.reshape(shape), value, x)


def logit(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """log(x) - log1p(-x): eager's gradient 1 / (x (1 - x)), inf at 0 and at 1, where torch's
    decomposition `log(x / (1 - x))` gave NaN at 1 (0 * inf) and at 0 with eps."""
    if eps is not None:
        x = x.clamp(eps, 1 - eps)
    return torch.log(x) - torch.log1p(-x)


def euclidean_dist(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """Eager's value (its product form, clamped at 0, square root) with eager's gradient: that
    of `half = (|x1|^2 / 2 - x1 . x2 + |x2|^2 / 2) / d`, which is `(x1 - x2) / d` (0 where d is 0),
    carried by `half - stop(half)` (exactly 0 in value)."""
    x1_norm = x1.pow(2).sum(-1, keepdim=True)
    x2_norm = x2.pow(2).sum(-1, keepdim=True)
    x1_ = torch.cat([x1.mul(-2), x1_norm, torch.ones_like(x1_norm)], -1)
    x2_ = torch.cat([x2, torch.ones_like(x2_norm), x2_norm], -1)
    d = _stop(x1_.matmul(x2_.mT).clamp_min(0).sqrt())
    zero = d == 0
    half = (x1_norm / 2 - x1.matmul(x2.mT) + x2_norm.mT / 2) / torch.where(zero, 1.0, d)
    half = torch.where(zero, 0.0, half)
    return d + (half - _stop(half))


def _with_dropout_between_layers(rnn):
    """torch's decomposition `rnn` (lstm_impl, gru_impl, ...), one layer at a time when it
    should drop out between layers (see the module docstring)."""
    def decomposition(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        if not (train and dropout > 0 and num_layers > 1):
            return rnn(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
        directions, per_layer = 2 if bidirectional else 1, len(params) // num_layers
        is_lstm = isinstance(hx, (list, tuple))  # (h0, c0)
        out, finals = input, []
        for i in range(num_layers):
            rows = slice(i * directions, (i + 1) * directions)
            layer_hx = [h[rows] for h in hx] if is_lstm else hx[rows]
            out, *final = rnn(out, layer_hx, params[i * per_layer:(i + 1) * per_layer], has_biases, 1, 0.0, train,
                              bidirectional, batch_first)
            finals.append(final)
            if i < num_layers - 1:
                out = torch.dropout(out, dropout, train=True)
        return (out, *(torch.cat(states, 0) for states in zip(*finals)))
    return decomposition


def _rnn_decompositions() -> dict:
    from torch._decomp import decomposition_table

    ops = (aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input)
    return {op: _with_dropout_between_layers(decomposition_table[op]) for op in ops if op in decomposition_table}


FIXED = {
    **_rnn_decompositions(),
    aten.multilabel_margin_loss_forward.default: multilabel_margin_loss_forward,
    aten.binary_cross_entropy.default: binary_cross_entropy,
    aten.std.correction: std,
    aten.std_mean.correction: std_mean,
    aten.sinc.default: sinc,
    aten.logit.default: logit,
    aten._euclidean_dist.default: euclidean_dist,
    aten.index_fill.int_Tensor: index_fill,
    aten.index_fill.int_Scalar: index_fill,
}

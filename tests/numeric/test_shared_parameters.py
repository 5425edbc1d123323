"""One Parameter used in several places trains as in eager: weight tying, a module called twice,
one module registered under two names. Every use adds to the one gradient, and the parameter is
updated once (CPU, LLVM, float32).

torch.export lifts a tied parameter once per path (`tok_emb.weight` and `head.weight`) and
reads only one of them; before lowering merged them, the other path's zero gradient was the one
the optimizer applied and the tied weight trained wrong, with no error.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import TrainGraph
from tests.numeric.test_training import STEP_TOL, assert_same_state, eager_step

import tvmgraph


class CausalBlock(nn.Module):
    """Pre-norm block: LayerNorm, causal multi-head attention (SDPA), LayerNorm, GELU MLP.

    The q/k/v projection has no bias: the key bias gets an analytically zero gradient (softmax
    ignores a shift along a row), and AdamW turns the float32 noise of that zero into lr-sized
    steps whose signs differ between any two implementations.
    """

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TiedGPT(nn.Module):
    """Token embedding, learned positions, causal blocks, final LayerNorm, head tied to the embedding."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, seq: int = 8, layers: int = 2):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Parameter(torch.randn(1, seq, d) * 0.02)
        self.blocks = nn.Sequential(*[CausalBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[:, :idx.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


class TokenCrossEntropy(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LinearTwice(nn.Module):
    """One Linear applied twice, with a nonlinearity between."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def adamw_clipped_cosine(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW([{"params": model.parameters(), "clip_grad_max_norm": 1.0}],
                                  lr=1e-2, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)


def train_side_by_side(graph: tvmgraph.nn.Graph, model: nn.Module, reference: nn.Module, ref_optimizer,
                       ref_scheduler, loss_fn: nn.Module, batches: list, **tol) -> None:
    """Run the graph and eager on the same batches; compare loss and parameters after every step."""
    tol = tol or STEP_TOL
    for step, (x, y) in enumerate(batches):
        loss = graph(x, y)
        ref_loss = eager_step(reference, loss_fn, [ref_optimizer], x, y)
        if ref_scheduler is not None:
            ref_scheduler.step()
        torch.testing.assert_close(loss, ref_loss, **tol, msg=lambda m: f"step {step} loss: {m}")
        assert_same_state(model, reference, **tol)


@pytest.mark.slow
def test_tied_gpt_adamw_clipped_cosine_matches_eager():
    """A GPT whose head shares the token embedding's weight: 20 AdamW steps with clipping and a
    cosine schedule match eager (losses and parameters within 2e-5 + 1e-4 rel), and the weight
    stays tied."""
    model = TiedGPT()
    reference = copy.deepcopy(model)
    assert reference.head.weight is reference.tok_emb.weight
    optimizer, scheduler = adamw_clipped_cosine(model)
    ref_optimizer, ref_scheduler = adamw_clipped_cosine(reference)
    graph = TrainGraph(model, TokenCrossEntropy(), optimizer, lr_sch=scheduler)
    batches = [(torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))) for _ in range(20)]
    train_side_by_side(graph, model, reference, ref_optimizer, ref_scheduler, TokenCrossEntropy(), batches)
    assert model.head.weight is model.tok_emb.weight


def test_linear_called_twice_matches_eager():
    """A Linear used twice in one forward gets the sum of both gradient contributions (SGD with
    momentum, 5 steps, against eager)."""
    model = LinearTwice()
    reference = copy.deepcopy(model)

    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    ref_optimizer = sgd(reference)
    graph = TrainGraph(model, nn.MSELoss(), sgd(model))
    batches = [(torch.randn(16, 8), torch.randn(16, 8)) for _ in range(5)]
    train_side_by_side(graph, model, reference, ref_optimizer, None, nn.MSELoss(), batches)


class TwoNames(tvmgraph.nn.Graph):
    """One module registered under two names, each used once in build()."""

    def __init__(self, lin: nn.Linear, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.first = lin
        self.second = lin
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = F.mse_loss(self.second(torch.tanh(self.first(x))), y)
        loss.backward()
        return loss


def test_module_registered_twice_matches_eager():
    """A module reachable by two graph attributes is one set of parameters: both uses add to
    one gradient and the update happens once (SGD, 3 steps, against eager)."""
    model = nn.Linear(8, 8)
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    graph = TwoNames(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batches = [(torch.randn(16, 8), torch.randn(16, 8)) for _ in range(3)]
    train_side_by_side(graph, model, reference, ref_optimizer, None, _TwoNamesLoss(reference), batches)


class _TwoNamesLoss(nn.Module):
    """Eager counterpart of TwoNames.build: eager_step calls loss_fn(model(x), y)."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = lin

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(torch.tanh(out)), y)

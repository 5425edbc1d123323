"""Random ops inside build() (`torch.rand`, `randn_like`, `bernoulli`, `nn.Dropout2d`, ...): fresh
numbers at every call, reproducible under torch.manual_seed, and drawn from the distribution
eager draws from (two-sample Kolmogorov-Smirnov distance against eager's own samples)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmgraph
from tests.conftest import ModuleGraph, TrainGraph


class Draw(tvmgraph.nn.Graph):
    """build(x, p) = draw(x, p), for a function of two tensors."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def build(self, x, p):
        return self.draw(x, p)


N = 40_000
# The two-sample KS distance of two samples of N from one distribution exceeds
# 1.95 * sqrt(2 / N) with probability 0.001.
KS_LIMIT = 1.95 * math.sqrt(2 / N)

CONTINUOUS = {
    "rand": lambda x, p: torch.rand(200, 200),
    "rand_like": lambda x, p: torch.rand_like(x),
    "randn": lambda x, p: torch.randn(200, 200),
    "randn_like": lambda x, p: torch.randn_like(x),
    "randn_float64": lambda x, p: torch.randn(200, 200, dtype=torch.float64),
    "normal_tensor_mean": lambda x, p: torch.normal(x, 2.0),
    "normal_tensor_std": lambda x, p: torch.normal(0.5, p),
    "normal_both_tensors": lambda x, p: torch.normal(x, p),
    "normal_sized": lambda x, p: torch.normal(1.0, 3.0, (200, 200)),
    "uniform_": lambda x, p: x.clone().uniform_(-1, 2),
    "normal_": lambda x, p: x.clone().normal_(3, 0.5),
    "exponential_": lambda x, p: x.clone().exponential_(2.0),
    "log_normal_": lambda x, p: x.clone().log_normal_(0.5, 0.4),
    "cauchy_": lambda x, p: x.clone().cauchy_(1.0, 2.0),
}
DISCRETE = {
    "randint": lambda x, p: torch.randint(3, 9, (200, 200)),
    "randint_high": lambda x, p: torch.randint(5, (200, 200)),
    "randint_like": lambda x, p: torch.randint_like(x, 2, 6),
    "randint_int32": lambda x, p: torch.randint(0, 7, (200, 200), dtype=torch.int32),
    "bernoulli_probs": lambda x, p: torch.bernoulli(p.clamp(0, 1) * 0 + 0.3),
    "bernoulli_p": lambda x, p: torch.bernoulli(x, 0.3),
    "bernoulli_": lambda x, p: x.clone().bernoulli_(0.7),
    "geometric_": lambda x, p: x.clone().geometric_(0.3),
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(200, 200), torch.full((200, 200), 1.5)


def _ks_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """sup |F_a - F_b| of the two empirical distributions."""
    a, b = a.flatten().double().sort().values, b.flatten().double().sort().values
    points = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, points, right=True).double() / a.numel()
    cdf_b = torch.searchsorted(b, points, right=True).double() / b.numel()
    return (cdf_a - cdf_b).abs().max().item()


def _graph_and_eager_draws(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph's first draw (checked fresh at a second call) and eager's, of one dtype and shape."""
    x, p = _inputs()
    torch.manual_seed(0)
    graph = Draw(draw)
    got, again = graph(x, p), graph(x, p)
    expected = draw(x, p)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert not torch.equal(got, again), "the same numbers at two calls"
    return got, expected


@pytest.mark.parametrize("name", sorted(CONTINUOUS))
def test_continuous_draws_follow_eagers_distribution(name: str) -> None:
    got, expected = _graph_and_eager_draws(CONTINUOUS[name])
    distance = _ks_distance(got, expected)
    assert distance < KS_LIMIT, f"KS distance {distance:.4f} against eager's samples (limit {KS_LIMIT:.4f})"


@pytest.mark.parametrize("name", sorted(DISCRETE))
def test_discrete_draws_have_eagers_frequencies(name: str) -> None:
    got, expected = _graph_and_eager_draws(DISCRETE[name])
    values = torch.cat([got.flatten(), expected.flatten()]).unique()
    for value in values.tolist():
        f_got, f_eager = (got == value).double().mean().item(), (expected == value).double().mean().item()
        # Two binomial frequencies of N draws: 5 standard deviations of their difference.
        limit = 5 * math.sqrt(2 * max(f_eager, 1 / N) * (1 - f_eager) / N)
        assert abs(f_got - f_eager) <= limit, f"value {value}: {f_got:.4f} here, {f_eager:.4f} in eager"


def test_manual_seed_reproduces_a_graphs_draws_and_ops_draw_independently() -> None:
    graph = Draw(lambda x, p: (torch.rand_like(x), torch.rand_like(x), torch.randn(200, 200)))
    x, p = _inputs()
    torch.manual_seed(7)
    first = graph(x, p)
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(first, graph(x, p)))
    a, b, _ = first
    correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
    assert abs(correlation) < 5 / math.sqrt(N), f"two rand_like ops correlate: {correlation:.4f}"


@pytest.mark.parametrize("dtype,resolution", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11),
                                              (torch.float32, 2**-24), (torch.float64, 2**-53)])
def test_rand_stays_below_one_at_its_dtypes_resolution(dtype: torch.dtype, resolution: float) -> None:
    """A float32 uniform cast to bfloat16 would round up to 1.0; each dtype draws at its own
    resolution instead, so rand is in [0, 1) and its values are multiples of that resolution."""
    out = Draw(lambda x, p: torch.rand(300, 300, dtype=dtype))(*_inputs()).double()
    assert out.min() >= 0 and out.max() < 1
    assert torch.equal(torch.remainder(out, resolution), torch.zeros_like(out))
    if dtype == torch.float64:  # finer than float32: not every value is a multiple of 2**-24
        assert (torch.remainder(out, 2**-24) != 0).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_bernoulli_and_normal_transform_float32_draws(dtype: torch.dtype) -> None:
    """bernoulli(p) and randn of bfloat16/float16 draw at float32's resolution, as eager (which
    compares p in double): at 8 bits, bernoulli(0.001) of bfloat16 drew ones at 0.0039 (p rounded
    up to 1/256), and no normal passed |z| = 3.53 (float16: 4.08). 4 x 360,000 draws: the
    fraction of ones within 6 standard deviations of p; |z| > 3.6 expected 114 times."""
    n, p = 360_000, 0.001
    draw = Draw(lambda x, q: (torch.zeros(n, dtype=dtype).bernoulli(p), torch.randn(n, dtype=dtype)))
    ones, tails = zip(*[(b.double().mean().item(), (z.double().abs() > 3.6).sum().item())
                        for b, z in (draw(*_inputs()) for _ in range(4))])
    assert abs(sum(ones) / 4 - p) < 6 * math.sqrt(p * (1 - p) / (4 * n)), ones
    assert sum(tails) > 4 * 114 / 2, tails


def test_dropout2d_zeroes_whole_channels_at_rate_p() -> None:
    """nn.Dropout2d draws its mask with bernoulli_(1 - p) on an [N, C, 1, 1] tensor: the stock
    converter returned that uninitialized tensor unchanged."""
    p = 0.3
    out = ModuleGraph(nn.Dropout2d(p).train())(torch.ones(64, 64, 4, 4))
    per_channel = out.flatten(2)
    assert torch.equal(per_channel.amin(-1), per_channel.amax(-1)), "a channel is partly dropped"
    kept = per_channel[:, :, 0]
    torch.testing.assert_close(kept[kept != 0].unique(), torch.tensor([1 / (1 - p)]))
    rate = (kept == 0).double().mean().item()
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / kept.numel())


def test_gumbel_softmax_samples_are_probabilities() -> None:
    """gumbel_softmax draws exponential_ noise: the stock converter's zeros made it NaN."""
    logits = torch.log(torch.tensor([0.1, 0.2, 0.7])).expand(20_000, 3).contiguous()
    graph = Draw(lambda x, p: F.gumbel_softmax(x, tau=0.5, hard=True))
    out = graph(logits, logits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.sum(-1), torch.ones(20_000))
    # hard samples pick class i with probability softmax(logits)_i
    torch.testing.assert_close(out.mean(0), torch.tensor([0.1, 0.2, 0.7]), atol=0.015, rtol=0)


def test_vae_reparameterization_trains_with_fresh_noise() -> None:
    """z = mu + eps * sigma with eps = randn_like(mu): the loss differs between calls on one
    batch (new eps), and mu's layer trains (the gradient flows through z, not into eps)."""
    torch.manual_seed(0)

    class VAE(nn.Module):
        def __init__(self):
            super().__init__()
            self.encode, self.decode = nn.Linear(8, 4), nn.Linear(2, 8)

        def forward(self, x):
            mu, log_var = self.encode(x).chunk(2, -1)
            z = mu + torch.randn_like(mu) * (0.5 * log_var).exp()
            return self.decode(z), mu, log_var

    def loss_fn(out, x):
        recon, mu, log_var = out
        return F.mse_loss(recon, x) - 0.5 * (1 + log_var - mu**2 - log_var.exp()).mean()

    model = VAE()
    before = copy.deepcopy(model.encode.weight)
    graph = TrainGraph(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.randn(16, 8)
    losses = [graph(x, x).item() for _ in range(20)]
    assert len(set(losses)) == len(losses)
    assert not torch.equal(model.encode.weight, before)
    assert sum(losses[-5:]) < sum(losses[:5])


def test_normal_passes_no_gradient_to_its_mean_as_in_torch() -> None:
    """torch.normal(mean, std) is not reparameterized: derivatives.yaml gives mean a zero
    gradient, so a parameter that reaches the loss only through it does not move."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    before = copy.deepcopy(model.weight)
    graph = TrainGraph(model, lambda out, y: torch.normal(out, 1.0).sum() + (y * 0).sum(),
                       torch.optim.SGD(model.parameters(), lr=0.1))
    graph(torch.randn(4, 3), torch.zeros(4, 3))
    assert torch.equal(model.weight, before)


def test_rrelu_with_equal_bounds_trains_as_leaky_relu() -> None:
    """RReLU's slope is drawn from U(lower, upper) in training; with lower == upper it is fixed,
    so graph and eager training must agree step by step (the gradient of x * slope)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.RReLU(0.2, 0.2), nn.Linear(8, 2))
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(5, 6), torch.randn(5, 2)
        loss = graph(x, y)
        optimizer.zero_grad()
        expected = F.mse_loss(eager(x), y)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rrelu_draws_slopes_between_its_bounds_in_training_and_their_mean_in_eval() -> None:
    module = nn.RReLU(0.1, 0.3)
    graph = ModuleGraph(module)
    x = -torch.ones(100, 100)
    module.train()
    slopes = -graph(x)
    assert slopes.min() >= 0.1 and slopes.max() <= 0.3 and slopes.std() > 0.05
    module.eval()
    torch.testing.assert_close(graph(x), module(x))


def test_a_saved_graph_draws_fresh_numbers_after_load(tmp_path) -> None:
    """The deployment artifact keeps the seed input: its runtime draws a seed per call too."""
    torch.manual_seed(0)  # the KS bound holds with probability 0.999: keep the samples fixed
    graph = Draw(lambda x, p: x + torch.randn_like(x))
    x, p = _inputs()
    loaded = tvmgraph.load(tvmgraph.save(graph, str(tmp_path / "noise"), example_args=(x, p)))
    first, second = loaded(x, p), loaded(x, p)
    assert not torch.equal(first, second)
    assert _ks_distance(first, torch.randn(200, 200)) < KS_LIMIT


def test_dropout2d_and_randn_like_under_a_dynamic_batch() -> None:
    """Dropout2d's mask is drawn into an `empty([n, C, 1, 1])`: the stock converter could not
    take a size from the dynamic batch. One program serves every batch size, with its own
    numbers each call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.25), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4))
    graph = TrainGraph(model, nn.CrossEntropyLoss(), torch.optim.SGD(model.parameters(), lr=0.01))
    graph.config.enable_dynamic_batch()
    losses = [graph(torch.ones(b, 3, 6, 6), torch.zeros(b, dtype=torch.long)).item() for b in (8, 5, 8, 5)]
    assert all(math.isfinite(loss) for loss in losses) and len(set(losses)) == 4

    noisy = Draw(lambda x, p: x + torch.randn_like(x))
    noisy.config.enable_dynamic_batch()
    for rows in (64, 3):
        out = noisy(torch.zeros(rows, 500), torch.zeros(rows, 500))
        assert out.shape == (rows, 500) and abs(out.std().item() - 1) < 0.1


def test_torch_distributions_trace_and_train_as_in_eager() -> None:
    """torch.distributions validate their arguments by default (a branch on data export cannot
    trace: every Normal(...).log_prob was a TraceError). A policy-gradient style loss with
    log_prob, entropy and a KL term trains step for step as eager; rsample draws fresh noise."""
    from torch import distributions as D

    def loss_fn(out, target):
        mu, log_sigma = out.chunk(2, -1)
        normal = D.Normal(mu, log_sigma.exp())
        categorical = D.Categorical(logits=out)
        prior = D.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        return (-normal.log_prob(target).sum(-1) - 0.1 * categorical.entropy()
                + D.kl_divergence(normal, prior).sum(-1)).mean()

    torch.manual_seed(0)
    model = nn.Linear(5, 4)
    eager = copy.deepcopy(model)
    graph = TrainGraph(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(3):
        x, target = torch.randn(6, 5), torch.randn(6, 2)
        loss = graph(x, target)
        optimizer.zero_grad()
        expected = loss_fn(eager(x), target)
        expected.backward()
        optimizer.step()
        torch.testing.assert_close(loss, expected.detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    torch.manual_seed(0)
    sampler = Draw(lambda x, p: D.Normal(x, p).rsample())
    mean, spread = torch.zeros(200, 200), torch.full((200, 200), 2.0)
    first = sampler(mean, spread)
    assert not torch.equal(first, sampler(mean, spread))
    assert _ks_distance(first, torch.randn(200, 200) * 2) < KS_LIMIT


def test_alpha_dropout_keeps_a_standard_normal_standard() -> None:
    """nn.AlphaDropout (SELU networks) keeps mean 0 and variance 1 of its input; it draws its
    mask with bernoulli_, which TVM's importer returned unchanged (an uninitialized tensor)."""
    x = torch.randn(400, 400)
    out = ModuleGraph(nn.AlphaDropout(0.3).train())(x)
    assert abs(out.mean().item()) < 0.01 and abs(out.std().item() - 1) < 0.01
    dropped = (out == out.flatten().mode().values).double().mean().item()  # all take one value
    assert abs(dropped - 0.3) < 0.01

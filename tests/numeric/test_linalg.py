"""det, slogdet/logdet, inv and solve (tvmgraph/converters_linalg.py), Cholesky and triangular
solves (tvmgraph/converters_cholesky.py): values and gradients against eager, batched, in
float32 and float64, with row swaps, a singular matrix, and models that train through them (Glow's
invertible 1x1 convolution, a Gaussian process's marginal likelihood)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tvmgraph
from tests.conftest import Fn, ModuleGraph, SGDStep, assert_close
from tvmgraph.errors import UnsupportedOpError


def _well_conditioned(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random matrices kept away from singular (a scaled identity added) whose partial pivoting
    still swaps rows (the identity is added to a permuted copy)."""
    n = shape[-1]
    a = torch.randn(*shape, dtype=dtype)
    return a + 2 * torch.eye(n, dtype=dtype)[torch.randperm(n)]


def _spd(a: torch.Tensor) -> torch.Tensor:
    """A symmetric positive-definite matrix made from any square `a`."""
    return a @ a.mT + torch.eye(a.shape[-1], dtype=a.dtype)


def _cholesky_ops(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    spd = _spd(a)
    lower, upper = torch.linalg.cholesky(spd), torch.linalg.cholesky(spd, upper=True)
    return (lower, upper, torch.linalg.cholesky_ex(spd).L,
            torch.linalg.solve_triangular(lower, b, upper=False), torch.linalg.solve_triangular(upper, b, upper=True),
            torch.linalg.solve_triangular(lower, b.mT, upper=False, left=False),
            torch.linalg.solve_triangular(a, b, upper=True, unitriangular=True),
            torch.linalg.solve_triangular(a[0], b, upper=False, unitriangular=True),
            torch.cholesky_solve(b, lower), torch.cholesky_solve(b, upper, upper=True),
            torch.cholesky_inverse(lower), torch.cholesky_inverse(upper, upper=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cholesky_and_triangular_values_match_eager(dtype: torch.dtype) -> None:
    """Cholesky (lower, upper), triangular solves (lower, upper, from the right, unit diagonal,
    A broadcast over B's batch), cholesky_solve and cholesky_inverse of a batch of 5 x 5 matrices."""
    a, b = torch.randn(3, 5, 5, dtype=dtype), torch.randn(3, 5, 2, dtype=dtype)
    for got, want in zip(ModuleGraph(Fn(_cholesky_ops))(a, b), _cholesky_ops(a, b)):
        assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=1e-4)


def _all_ops(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    sign, logabsdet = torch.linalg.slogdet(a)
    return (torch.linalg.det(a), sign, logabsdet, torch.logdet(a @ a.mT + torch.eye(a.shape[-1], dtype=a.dtype)),
            torch.linalg.inv(a), torch.inverse(a[0]), torch.linalg.solve(a, b), torch.linalg.solve(a, v),
            torch.linalg.solve(a[0], b), torch.linalg.inv_ex(a).inverse, torch.det(a[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_match_eager(dtype: torch.dtype) -> None:
    """Every result of a batch of 5 x 5 systems (one pivot row swapped or more per matrix), a
    right-hand side of two columns, a vector one (torch's rule: B shaped like A without its last
    axis) and one broadcast over A's batch."""
    a, b, v = _well_conditioned(3, 5, 5, dtype=dtype), torch.randn(3, 5, 2, dtype=dtype), torch.randn(3, 5, dtype=dtype)
    for got, want in zip(ModuleGraph(Fn(_all_ops))(a, b, v), _all_ops(a, b, v)):
        assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=1e-4)


@pytest.mark.parametrize("n", [32, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matrices_wider_than_a_vector_match_eager(n: int, dtype: torch.dtype) -> None:
    """The kernels' rows run in 64-byte vectors over aligned chunks with a scalar tail: n a
    multiple of the lanes (32) and not (37), 16 and 8 lanes."""

    def fn(a, spd, b):
        lower = torch.linalg.cholesky(spd)
        return (torch.linalg.inv(a), torch.linalg.solve(a, b), torch.linalg.slogdet(a).logabsdet, lower,
                torch.cholesky_solve(b, lower), torch.linalg.solve_triangular(lower, b, upper=False))

    a = _well_conditioned(2, n, n, dtype=dtype)
    b = torch.randn(2, n, 21, dtype=dtype)
    spd = _spd(torch.randn(2, n, n, dtype=dtype))
    for got, want in zip(ModuleGraph(Fn(fn))(a, spd, b), fn(a, spd, b)):
        assert_close(got, want, atol=1e-4 if dtype == torch.float32 else 1e-9, rtol=1e-4)


def test_singular_matrices_give_eagers_det_and_slogdet() -> None:
    """A zero pivot: det 0, slogdet (0, -inf), as eager (which raises only in inv and solve)."""
    singular = torch.stack([torch.ones(4, 4), torch.tensor([[1.0, 2, 3, 4], [2, 4, 6, 8], [0, 1, 0, 0], [0, 0, 1, 0]])])

    def fn(a):
        return (torch.linalg.det(a), *torch.linalg.slogdet(a))

    for got, want in zip(ModuleGraph(Fn(fn))(singular), fn(singular)):
        assert torch.equal(got, want), (got, want)


class _Loss(nn.Module):
    def __init__(self, fn, *tensors: torch.Tensor):
        super().__init__()
        self.fn = fn
        self.params = nn.ParameterList([nn.Parameter(t.clone()) for t in tensors])

    def forward(self, *weights: torch.Tensor) -> torch.Tensor:
        return sum((out * w).sum() for out, w in zip(self.fn(*self.params), weights))


@pytest.mark.parametrize("name, fn, inputs", [
    ("det", lambda a: (torch.linalg.det(a),), lambda: (_well_conditioned(2, 4, 4),)),
    ("slogdet", lambda a: (torch.linalg.slogdet(a).logabsdet,), lambda: (_well_conditioned(2, 4, 4),)),
    ("logdet", lambda a: (torch.logdet(a @ a.mT + torch.eye(4)),), lambda: (torch.randn(4, 4),)),
    ("inv", lambda a: (torch.linalg.inv(a),), lambda: (_well_conditioned(2, 4, 4),)),
    ("solve", lambda a, b: (torch.linalg.solve(a, b),), lambda: (_well_conditioned(2, 4, 4), torch.randn(2, 4, 3))),
    ("solve_vector", lambda a, b: (torch.linalg.solve(a, b),), lambda: (_well_conditioned(4, 4), torch.randn(4))),
    ("solve_broadcast", lambda a, b: (torch.linalg.solve(a, b),), lambda: (_well_conditioned(4, 4), torch.randn(3, 4, 2))),
    ("cholesky", lambda a: (torch.linalg.cholesky(_spd(a)),), lambda: (torch.randn(2, 4, 4),)),
    ("cholesky_upper", lambda a: (torch.linalg.cholesky(_spd(a), upper=True),), lambda: (torch.randn(4, 4),)),
    ("cholesky_nonsymmetric", lambda a: (torch.linalg.cholesky(a),), lambda: (_spd(torch.randn(4, 4)) + torch.triu(torch.randn(4, 4), 1),)),
    ("solve_triangular", lambda a, b: (torch.linalg.solve_triangular(a, b, upper=False),),
     lambda: (_well_conditioned(2, 4, 4), torch.randn(2, 4, 3))),
    ("solve_triangular_upper_unit", lambda a, b: (torch.linalg.solve_triangular(a, b, upper=True, unitriangular=True),),
     lambda: (torch.randn(4, 4), torch.randn(4, 3))),
    ("solve_triangular_right", lambda a, b: (torch.linalg.solve_triangular(a, b, upper=True, left=False),),
     lambda: (_well_conditioned(4, 4), torch.randn(3, 4))),
    ("cholesky_solve", lambda b, factor: (torch.cholesky_solve(b, factor),),
     lambda: (torch.randn(2, 4, 3), torch.linalg.cholesky(_spd(torch.randn(2, 4, 4))) + 0.1 * torch.randn(2, 4, 4))),
    ("cholesky_inverse_upper", lambda factor: (torch.cholesky_inverse(factor, upper=True),),
     lambda: (_well_conditioned(4, 4).triu(),)),
])
def test_gradients_match_autograd(name: str, fn, inputs) -> None:
    """One SGD step with lr=1 moves each input by minus its gradient: compared with
    torch.autograd of the same weighted sum."""
    tensors = inputs()
    weights = [torch.randn_like(out) for out in fn(*tensors)]
    model = _Loss(fn, *tensors)
    SGDStep(model)(*weights)
    leaves = [t.clone().requires_grad_() for t in tensors]
    grads = torch.autograd.grad(sum((out * w).sum() for out, w in zip(fn(*leaves), weights)), leaves)
    for before, after, grad in zip(tensors, model.params, grads):
        assert_close(before - after.detach(), grad, atol=1e-4, rtol=1e-4)


class InvertibleConv1x1(nn.Module):
    """Glow's flow step: z = W x per pixel, log|det dz/dx| = H W log|det W|."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linalg.qr(torch.randn(channels, channels))[0])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = F.conv2d(x, self.weight[:, :, None, None])
        return z, x.shape[2] * x.shape[3] * torch.linalg.slogdet(self.weight).logabsdet


class TinyGlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = InvertibleConv1x1(6)
        self.scale = nn.Parameter(torch.zeros(1, 6, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, logdet = self.conv(x)
        z = z * torch.exp(self.scale)
        logdet = logdet + x.shape[2] * x.shape[3] * self.scale.sum()
        return (0.5 * (z ** 2).sum((1, 2, 3)) - logdet).mean()  # negative log-likelihood, up to a constant


def _trains_as_eager(model: nn.Module, lr: float, batches: list[tuple[torch.Tensor, ...]]) -> None:
    """Adam steps of `model` in a graph and of a copy in eager: losses and parameters agree."""
    reference = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=lr)

    class Train(SGDStep):
        def __init__(self):
            super(SGDStep, self).__init__()
            self.model = model
            self.add_optimizer(optimizer)

    graph = Train()
    for batch in batches:
        loss = graph(*batch)
        reference_optimizer.zero_grad()
        expected = reference(*batch)
        expected.backward()
        reference_optimizer.step()
        assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-4)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p.detach(), q.detach(), atol=1e-4, rtol=1e-4)


def test_a_flow_with_an_invertible_1x1_convolution_trains_as_eager() -> None:
    _trains_as_eager(TinyGlow(), 0.01, [(torch.randn(4, 6, 5, 5),) for _ in range(3)])


class GaussianProcess(nn.Module):
    """Exact GP regression's negative log marginal likelihood with an RBF kernel, through the
    Cholesky factor of K + noise I (as GPyTorch and textbooks write it)."""

    def __init__(self):
        super().__init__()
        self.log_length = nn.Parameter(torch.tensor(0.3))
        self.log_scale = nn.Parameter(torch.tensor(-0.2))
        self.log_noise = nn.Parameter(torch.tensor(-1.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        distance = torch.cdist(x, x) ** 2
        k = torch.exp(self.log_scale) * torch.exp(-0.5 * distance / torch.exp(self.log_length) ** 2)
        k = k + torch.exp(self.log_noise) * torch.eye(x.shape[0])
        lower = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], lower)
        return 0.5 * (y[:, None] * alpha).sum() + torch.log(torch.diagonal(lower)).sum()


def test_a_gaussian_process_trains_its_kernel_as_eager() -> None:
    x = torch.rand(24, 2) * 4
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(24)
    _trains_as_eager(GaussianProcess(), 0.05, [(x, y)] * 4)


def test_a_dynamic_batch_is_refused_by_name() -> None:
    """The kernels take static shapes: a dynamic-batch graph gets an UnsupportedOpError naming
    the op and the fix, not a failed build."""

    class Solve(tvmgraph.nn.Graph):
        def __init__(self):
            super().__init__()
            self.config.enable_dynamic_batch()

        def build(self, a, b):
            return torch.linalg.solve(a, b)

    with pytest.raises(UnsupportedOpError, match=r"_linalg_solve_ex.*enable_dynamic_batch\(\) off"):
        Solve()(_well_conditioned(3, 4, 4), torch.randn(3, 4, 2))

"""Reductions, scans, scatters, strided views and distances (tvmgraph/converters_reduce.py)
against eager: forward values and indices, and gradients against torch.autograd.

Each test runs one graph holding many ops (one compile). Gradients come from a training graph
whose parameters are the ops' inputs: one SGD step with lr=1 moves each by minus the gradient of
`sum_i sum(out_i * w_i)`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import Fn, ModuleGraph, SGDStep, assert_close
from tvmgraph.errors import UnsupportedOpError


def _ties() -> torch.Tensor:
    return torch.randint(0, 3, (4, 6)).float()  # many repeated values


def _with_nan() -> torch.Tensor:
    x = torch.randn(4, 6)
    x[0, 1] = x[2, 0] = x[2, 4] = float("nan")
    x[3] = float("nan")  # an all-NaN row (its nanmedian index is an accident of torch's sort: not compared)
    return x


def _index() -> torch.Tensor:
    return torch.tensor([[0, 2, 2, 1, 0, 3], [1, 1, 0, 3, 3, 2], [2, 0, 0, 0, 1, 1]])


def reductions(x, t, n):
    """x: random [4, 6]; t: ties; n: with NaN."""
    return (
        torch.amax(x, 1), torch.amin(x, (0, 1), keepdim=True), torch.amax(t, 0), torch.amin(t, 1),
        torch.amax(x[0, 0]), *torch.aminmax(x, dim=0), torch.logsumexp(x, 1),
        *torch.min(x, 1), *torch.max(t, 0, keepdim=True), *torch.min(t, 1),
        torch.argmax(x[1, 2]), torch.argmin(x[1, 2]), torch.any(t > 1), torch.any(x > 5), torch.any(x[0, 0] > 0),
        torch.logsumexp(x[0, 0], 0),
        *torch.var_mean(x, 1), *torch.std_mean(x, 0, correction=0, keepdim=True),
        torch.nanmedian(n, 1).values, torch.nanmedian(n[:3], 1).indices, torch.nanmedian(n), torch.nanmedian(t),
        *torch.median(x, 0), *torch.median(n[:3], 1), torch.median(t), torch.median(n),
        *torch.kthvalue(x, 2, 1), *torch.kthvalue(x, 4, 0, keepdim=True), *torch.mode(t, 1), *torch.mode(t, 0),
    )


def special_values(s):
    """s [5, 3]: rows all -inf, all +inf, with NaN, with ties, plain. TVM's max/min start from
    the lowest finite float and skip NaN, and its argmax stays at -1 on an all -inf row: these
    came out -3.4e38, 2.0 (another element's value gathered at -1), and 2 for [NaN, -1, 2]."""
    return (torch.amax(s, 1), torch.amin(s, 1), *torch.max(s, 1), *torch.min(s, 1), torch.argmax(s, 1),
            torch.argmin(s, 1, keepdim=True), s.max(), s.min(), torch.argmax(s), torch.argmax(s[:2]),
            torch.amax(s[:2], 0), *torch.max(s[:2], 0), torch.argmin(s[1:2], keepdim=True),
            # the same start value in scans, mode and norms: cummax of [-inf, -inf, ..] was 0 at index -1,
            # the mode of [inf, inf, inf] 0.0, vector_norm(ord=-inf) of an all-inf row 3.4e38
            *torch.cummax(s, 1), *torch.cummin(s, 1), *torch.mode(s[:2], 1),
            torch.linalg.vector_norm(s[:2], float("-inf"), 1), torch.linalg.vector_norm(s, float("inf"), 1),
            torch.cdist(s[:2, None], s[:2, None], p=float("inf")))


def _special_values() -> torch.Tensor:
    inf, nan = float("inf"), float("nan")
    return torch.tensor([[-inf, -inf, -inf], [inf, inf, inf], [nan, -1.0, 2.0], [2.0, 1.0, 2.0], [0.5, -inf, inf]])


def sorts(s, b, i):
    """s [4, 6] float32 with NaN and infinities (at most one NaN a row: the order among tied
    NaNs of topk/kthvalue is an accident of torch's selection); b: bfloat16 with ties; i: int8.
    torch sorts NaN above +inf. TVM's sort left NaN in place ([1, NaN, 3, 2] sorted to
    [1, NaN, 2, 3]), sorted bfloat16 wrongly (median [4, 2, 2, 1] was 4) and refused int8."""
    return (*torch.sort(s, 1), *torch.sort(s, 1, descending=True), *torch.sort(s, stable=True, dim=0),
            torch.argsort(s, 1, descending=True), torch.msort(s), *torch.topk(s, 2, 1),
            *torch.topk(s, 3, 1, largest=False), *torch.kthvalue(s, 2, 1), *torch.kthvalue(s, 6, 1),
            torch.quantile(s, 0.3, 1), torch.nanquantile(s, 0.7, 1), *torch.median(s, 0),
            *torch.sort(b, 1), *torch.sort(b, 0, descending=True), *torch.topk(b, 2, 1), *torch.median(b, 1),
            *torch.kthvalue(b, 5, 1), *torch.cummax(b, 1), *torch.sort(i, 1), *torch.sort(i > 0, stable=True, dim=1))


def _sort_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[1.0, nan, 3.0, 2.0, -inf, inf], [nan, 0.0, -1.0, 5.0, 4.0, inf],
                            [inf, 3.0, nan, -inf, 2.0, 1.0], [0.5, -0.5, 0.25, 2.0, 3.0, -1.0]])
    ties = torch.tensor([[4.0, 2.0, 2.0, 1.0, 3.0, 0.5], [1.5, -2.0, 1.25, 8.0, -2.0, 0.0]]).bfloat16()
    return special, ties, torch.randint(-5, 5, (3, 6), dtype=torch.int8)


def scans(x, t, n):
    return (*torch.cummax(x, 1), *torch.cummin(x, 0), *torch.cummax(t, 1), *torch.cummin(t, 0),
            *torch.cummax(n, 1), torch.logcumsumexp(x, 1), torch.logcumsumexp(x * 40, 0))


def scatters(x, src, index, mask):
    """x [3, 6], src [3, 6], index [3, 6], mask [3, 6]."""
    row_index = torch.tensor([0, 2, 0])
    source = src
    out = [torch.scatter_add(x, 1, index, src), torch.masked_scatter(x, mask, src),
           torch.scatter(x, 1, index[:, :2], src[:3, :2])]
    for reduce in ("sum", "prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            out.append(torch.scatter_reduce(x, 1, index, src, reduce, include_self=include_self))
    for reduce in ("prod", "mean", "amax", "amin"):
        for include_self in (True, False):
            out.append(torch.index_reduce(x, 0, row_index, source, reduce, include_self=include_self))
    return tuple(out)


def views(x, s):
    """x [4, 6], s [2, 4]: copies of views and scatters into views."""
    return (
        x.unfold(1, 3, 2), torch.unfold_copy(x, 0, 2, 1), torch.tensor(3.0).unfold(0, 1, 1) * x[0, 0],
        torch.as_strided(x, (2, 2), (1, 2)), torch.as_strided(x, (3, 3), (7, 1), 2),
        torch.as_strided_copy(x, (2, 3), (6, 2), 1),
        torch.diagonal_scatter(x, s[0], 1),
        torch.diagonal_scatter(x, s[1, :2] * 2, -2), torch.narrow_copy(x, 1, 1, 3),
        torch.permute_copy(x, (1, 0)), torch.view_copy(x, (3, 8)), *torch.unbind_copy(x[:2], 0),
        torch.index_select(x[2, 2], 0, torch.tensor([0])),
    )


def scatter_into_view(x, s):
    """Forward and gradient checked apart: eager's gradient for x is wrong (see below)."""
    return (torch.as_strided_scatter(x, s, (2, 3), (6, 2), 1),)


def products(a, b, m, v, bias):
    """a [5, 3], b [4, 3], m [2, 5, 3], v [3], bias [5]."""
    weight = torch.arange(24.0).reshape(2, 3, 4) / 10
    return (
        torch.cdist(a, b), torch.cdist(a, b, p=1), torch.cdist(a, b, p=3), torch.cdist(a, b, p=float("inf")),
        torch.cdist(a, a), F.pdist(a), F.pdist(a, p=1), torch.dist(a, a * 2), torch.dist(a, b[0], 3),
        torch.addmv(bias, a, v, beta=0.5, alpha=2), torch.addbmm(a @ a.T, m, m.transpose(1, 2), alpha=0.5),
        F.bilinear(a, b[:1].expand(5, 3), weight[:, :, :3], bias[:2]),
    )


def searches(s, v, x, w, ids, offsets, per_sample):
    """s: sorted [3, 5]; v [3, 4]; x [2, 5]; w: table [10, 3]; ids, offsets, per_sample: bags."""
    return (
        torch.searchsorted(s, v), torch.searchsorted(s, v, right=True), torch.searchsorted(s[0], v),
        torch.nonzero_static(x > 0, size=6), torch.nonzero_static(x > 0, size=12, fill_value=-3),
        F.embedding_bag(ids, w, offsets, mode="sum"), F.embedding_bag(ids, w, offsets, mode="mean"),
        F.embedding_bag(ids, w, offsets, mode="max"),
        F.embedding_bag(ids, w, offsets, mode="sum", per_sample_weights=per_sample, padding_idx=2),
        # repeats from an input (offsets: 0, 2, 2, 5; a zero first), their sum given
        torch.repeat_interleave(offsets, output_size=9), w[:4].repeat_interleave(offsets, dim=0, output_size=9),
        x.repeat_interleave(ids[:5] % 3, dim=1, output_size=7),
    )


def scatter_ties(x, src):
    """x, src [3, 6] of small integers: ties (amax/amin share the gradient evenly among them, x
    included) and zeros (prod's gradient treats a single zero and several zeros apart).
    Not amax/amin with include_self=False: there eager still counts a tie of the excluded x
    in the share (the src's gradient halves), the graph does not."""
    index = _index()
    return (torch.scatter_reduce(x, 1, index, src, "amax"), torch.scatter_reduce(x, 1, index, src, "amin"),
            torch.scatter_reduce(x, 1, index, src, "prod"),
            torch.scatter_reduce(x, 1, index, src, "prod", include_self=False))


def _small_integers() -> torch.Tensor:
    return torch.randint(-1, 2, (3, 6)).float()


def larger_sources(x, src, index):
    """src [4, 7] is larger than index [3, 6]: only its corner is read (eager's backward refuses it)."""
    return (torch.scatter_add(x, 1, index, src), torch.scatter_reduce(x, 1, index, src, "amax"),
            torch.masked_scatter(x, x > 0, src))


def narrow_indices(x, src, index):
    """An index narrower than x in a dimension other than the scattered one (x [3, 4, 5], index
    [3, 3, 5] on dim 2, [2, 4, 5] on dim 1): TOPI's scatter numbered the index's rows as x's
    and wrote elsewhere (3.6 off), and gather's gradient, a scatter, too (3.1 off)."""
    wide = index[:, :, :4].clone()  # [3, 3, 4] on dim 0: narrower in both other dimensions
    return (torch.scatter_add(x, 2, index, src), torch.scatter(x, 2, index, src),
            torch.scatter_reduce(x, 2, index, src, "amax"), torch.scatter_reduce(x, 1, index[:2] % 4, src[:2], "mean"),
            torch.gather(x, 2, index), torch.gather(x, 0, wide % 3), torch.scatter_add(x, 0, wide % 3, src[:, :, :4]))


def _narrow_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    index = torch.stack([torch.randperm(5) for _ in range(9)]).reshape(3, 3, 5)
    return torch.randn(3, 4, 5), torch.randn(3, 3, 5), index


def odd_scatters(x, b, scalar, empty_index, empty_wide):
    """What OpInfo's all-dtype samples found: empty indices of any integer type and rank (a
    TVM error before), 0-d scatter and gather (TVM's kernels need an axis), mode and scatters
    and index_add of bool (TVM has no bool min, == or scatter kernel)."""
    zero = torch.zeros((), dtype=torch.int64)
    return (
        torch.gather(x[0], 0, empty_index), torch.gather(x[0], 0, empty_wide),
        torch.scatter(x, 1, empty_index[None], 1.0),
        torch.scatter(scalar, 0, zero, x[0, 0]), torch.scatter(scalar, 0, zero, 2.5), torch.gather(scalar, 0, zero),
        *torch.mode(b, 1), *torch.mode(b[0], 0, keepdim=True),
        torch.scatter_add(b, 1, _index(), b[:, :6]), torch.scatter_reduce(b, 1, _index(), b[:, :6], "prod"),
        torch.scatter_reduce(b, 0, _index()[:2, :4] % 3, b[1:, :4], "amin", include_self=False),
        torch.index_add(b, 1, torch.tensor([0, 2, 2]), b[:, :3]),
    )


def empties(e, rows):
    """Ops on empty tensors (tvmgraph/empty_results.py): cumprod of one crashed the process,
    argsort and take failed inside TVM."""
    return (torch.cumprod(e, 0), torch.argsort(e), torch.take(e, torch.zeros(0, dtype=torch.int64)),
            torch.cumsum(rows, 1), *torch.sort(rows, 0), torch.softmax(rows, 1), rows.sum(0))


def takes(x, s, i, j):
    """torch.take with a 0-d index, as an input (i, j) or a constant: torch.export refused it
    (the decomposition of take guards on the index's value); the index counts from the end too."""
    return (torch.take(x, i), torch.take(x, j), torch.take(s, i * 0), torch.take(x, torch.tensor(5)),
            torch.take(x, torch.stack([i, j])))


def _scatter_inputs():
    return (torch.randn(3, 6), torch.randn(3, 6), _index(), torch.rand(3, 6) > 0.5)


def _search_inputs():
    return (torch.sort(torch.randn(3, 5), 1)[0], torch.randn(3, 4), torch.randn(2, 5), torch.randn(10, 3),
            torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5]), torch.randn(8))


def _product_inputs():
    return (torch.randn(5, 3), torch.randn(4, 3), torch.randn(2, 5, 3), torch.randn(3), torch.randn(5))


BATCHES = {
    "reductions": (reductions, lambda: (torch.randn(4, 6), _ties(), _with_nan())),
    "special_values": (special_values, lambda: (_special_values(),)),
    "scans": (scans, lambda: (torch.randn(4, 6), _ties(), _with_nan())),
    "sorts": (sorts, _sort_inputs),
    "scatters": (scatters, _scatter_inputs),
    "scatter_ties": (scatter_ties, lambda: (_small_integers(), _small_integers())),
    "takes": (takes, lambda: (torch.randn(4, 6), torch.tensor(1.5), torch.tensor(3), torch.tensor(-2))),
    "empties": (empties, lambda: (torch.zeros(0), torch.zeros(0, 3))),
    "odd_scatters": (odd_scatters, lambda: (torch.randn(3, 6), torch.rand(3, 8) > 0.5, torch.tensor(1.5),
                                            torch.zeros(0, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8))),
    "larger_sources": (larger_sources, lambda: (torch.randn(3, 6), torch.randn(4, 7), _index())),
    "narrow_indices": (narrow_indices, _narrow_inputs),
    "scatter_into_view": (scatter_into_view, lambda: (torch.randn(4, 6), torch.randn(2, 3))),
    "views": (views, lambda: (torch.randn(4, 6), torch.randn(2, 4))),
    "products": (products, _product_inputs),
    "searches": (searches, _search_inputs),
}

SLOW = {"reductions", "scatters"}  # one compile of 40-50 ops: over 5 s on 2 cores


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in BATCHES])
def test_forward_matches_eager(name: str) -> None:
    """Every op of the batch returns eager's values, indices, shapes and dtypes."""
    fn, make_args = BATCHES[name]
    torch.manual_seed(0)
    args = make_args()
    expected = fn(*args)
    actual = ModuleGraph(Fn(fn))(*args)
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        try:
            if e.dtype == torch.bool:
                assert torch.equal(a, e)
            else:
                assert_close(a, e, equal_nan=True)
        except AssertionError as error:
            raise AssertionError(f"output {i}: {error}") from None


class LossOfParameters(nn.Module):
    """sum_i sum(out_i * w_i) over the floating outputs of fn(*inputs); the floating inputs at
    `param_at` are parameters."""

    def __init__(self, fn: Callable, args: tuple, param_at: list[int]):
        super().__init__()
        self.fn, self.args, self.param_at = fn, args, param_at
        self.params = nn.ParameterList([nn.Parameter(args[i].clone()) for i in param_at])

    def forward(self, *weights: torch.Tensor) -> torch.Tensor:
        args = list(self.args)
        for i, p in zip(self.param_at, self.params):
            args[i] = p
        outputs = [o for o in self.fn(*args) if o.is_floating_point()]
        return sum((o * w).sum() for o, w in zip(outputs, weights))


GRADIENT_BATCHES = {
    "reductions": [0, 1],  # not the NaN input: NaN * w makes a NaN loss
    "scans": [0, 1],
    "sorts": [0],  # on finite values (below): NaN * w makes a NaN loss
    "scatters": [0, 1],
    "scatter_ties": [0, 1],
    "views": [0, 1],
    "products": [0, 1, 2, 3, 4],
    "searches": [3, 6],
    "takes": [0, 1],
    "narrow_indices": [0, 1],
}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("name", list(GRADIENT_BATCHES))
def test_gradient_matches_eager(name: str) -> None:
    """The gradients of every op of the batch are torch.autograd's (ties of amax/amin/scatter
    amax share the gradient evenly, as in torch)."""
    fn, make_args = BATCHES[name]
    param_at = GRADIENT_BATCHES[name]
    torch.manual_seed(1)
    args = make_args()
    if name in ("reductions", "scans"):
        args = (*args[:2], torch.nan_to_num(args[2], nan=0.5))
    if name == "sorts":
        args = (torch.randn(4, 6), *args[1:])
    leaves = [a.clone().requires_grad_() if i in param_at else a for i, a in enumerate(args)]
    outputs = [o for o in fn(*leaves) if o.is_floating_point()]
    weights = [torch.randn_like(o) for o in outputs]
    sum((o * w).sum() for o, w in zip(outputs, weights)).backward()
    model = LossOfParameters(fn, args, param_at)
    SGDStep(model)(*weights)
    for i, p in zip(param_at, model.params):
        assert_close(args[i] - p.detach(), leaves[i].grad, atol=1e-4, rtol=1e-4)


def test_repeat_interleave_of_a_tensor_of_repeats_needs_its_output_size() -> None:
    """Without output_size the length is the sum of the values: refused, naming the fix."""
    graph = ModuleGraph(Fn(lambda r: torch.repeat_interleave(r)))
    with pytest.raises(UnsupportedOpError, match=r"repeat_interleave with a tensor of repeats.*pass output_size="):
        graph(torch.tensor([1, 2]))


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_bag_max_gives_a_tied_maximum_its_first_row_s_gradient(padding_idx: int | None) -> None:
    """A table of small integers: rows tie for a bag's maximum. Eager's gradient goes to the row
    its `max_indices` names (the first maximum); a `max` reduction shared it between the tied
    rows (found by a sweep: every call of a training graph off, by up to 3.7). An empty bag
    (offsets 2, 2) and repeated ids too."""
    torch.manual_seed(0)
    table = torch.randint(-1, 2, (6, 4)).float()
    ids, offsets = torch.tensor([0, 1, 2, 2, 3, 1, 4, 5, 0]), torch.tensor([0, 2, 2, 6])
    weights = torch.randn(4, 4)

    def loss(w):
        return (F.embedding_bag(ids, w, offsets, mode="max", padding_idx=padding_idx) * weights).sum()

    leaf = table.clone().requires_grad_()
    loss(leaf).backward()
    model = LossOfParameters(lambda w: (loss(w),), (table,), [0])
    SGDStep(model)(torch.ones(()))
    assert_close(table - model.params[0].detach(), leaf.grad, atol=1e-6, rtol=1e-6)


def test_as_strided_scatter_gradient_is_the_true_one() -> None:
    """y = as_strided_scatter(x, s, ...): dy/dx is 1 where s does not land, 0 where it does.
    Eager's backward puts x's gradient on the overwritten elements instead (OpInfo expects its
    gradcheck to fail); the graph gives the true gradient."""
    x, s, w = torch.randn(4, 6), torch.randn(2, 3), torch.randn(4, 6)
    view = ((2, 3), (6, 2), 1)
    model = LossOfParameters(scatter_into_view, (x, s), [0, 1])
    SGDStep(model)(w)
    assert_close(x - model.params[0].detach(), torch.as_strided_scatter(w, torch.zeros(2, 3), *view))
    assert_close(s - model.params[1].detach(), torch.as_strided(w, *view))


def test_histc_counts_as_eager() -> None:
    """torch.histc had no lowering. Elements on the edges (`max` counts into the last bin),
    outside the range and NaN (not counted), x's own range when min == max (widened when x has
    one value), float64, an n-d input: every count equal to eager's."""

    def fn(x):
        edges = torch.arange(0, 1.0001, 0.01)
        return (torch.histc(x, 5, -2, 2), torch.histc(x, 7, 0.1, 0.7), torch.histc(x.view(8, -1, 5) * 3, 13, -3.3, 3.3),
                torch.histc(x[4:], 10), torch.histc(torch.full_like(x, 2.0), 4), torch.histc(x.double(), 11, -1, 1),
                torch.histc(edges, 10, 0, 1))

    torch.manual_seed(0)
    x = torch.randn(1000)
    x[:4] = torch.tensor([-2.0, 2.0, 0.0, float("nan")])
    for got, want in zip(ModuleGraph(Fn(fn))(x), fn(x)):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def _covariances(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    frequencies, weights = torch.arange(10) % 3 + 1, torch.linspace(0.1, 1.0, 10)
    return (torch.cov(x), torch.cov(x, correction=0), x.cov(correction=2), torch.cov(x[0]),
            torch.cov(x, fweights=frequencies), torch.cov(x, aweights=weights),
            torch.cov(x, fweights=frequencies, aweights=weights, correction=3), torch.corrcoef(x), x.corrcoef(),
            torch.corrcoef(x[0]), torch.cov(x.double()))


def test_cov_and_corrcoef_match_eager() -> None:
    """torch.export refused both (torch checks their weights and degrees of freedom on the host,
    tvmgraph/covariance.py): unweighted, frequency and analytic weights, corrections, 1-d and
    float64 inputs, the Tensor methods."""
    x = torch.randn(3, 10)
    for got, want in zip(ModuleGraph(Fn(_covariances))(x), _covariances(x)):
        assert_close(got, want)


def test_cov_with_no_degrees_of_freedom_is_eagers_nan() -> None:
    """One observation with correction 1: eager warns and divides by zero (NaN); the graph too."""
    x = torch.randn(3, 1)

    def fn(x):
        return torch.cov(x), torch.cov(x, correction=0)

    with pytest.warns(UserWarning, match="degrees of freedom"):
        got = ModuleGraph(Fn(fn))(x)
    with pytest.warns(UserWarning, match="degrees of freedom"):
        want = fn(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)


def test_cov_gradient_matches_autograd() -> None:
    x, w = torch.randn(4, 12), torch.randn(4, 4)
    model = LossOfParameters(lambda x: (torch.cov(x, aweights=torch.linspace(0.5, 1.5, 12)),), (x,), [0])
    SGDStep(model)(w)
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad((torch.cov(leaf, aweights=torch.linspace(0.5, 1.5, 12)) * w).sum(), leaf)
    assert_close(x - model.params[0].detach(), grad, atol=1e-5, rtol=1e-4)


def test_a_product_of_two_constant_tensors_is_bound_before_it_is_read() -> None:
    """TVM's importer returns `a * b` of two constants (two linspaces) as an unbound expression;
    `sum` of it read no dimensions (AttributeError, a CompileError). result_shapes.py binds it."""

    def fn(x):
        return x + (torch.linspace(0, 1, 10) * torch.linspace(1, 2, 10)).sum()

    x = torch.randn(3, 10)
    assert_close(ModuleGraph(Fn(fn))(x), fn(x))


def test_a_norm_of_a_row_holding_nan_is_nan() -> None:
    """The p-norm's root went through `where(sum > 0, sum ** (1/p), 0)` (0 for a zero row, with
    torch's zero gradient there): a NaN sum is not > 0, so a row holding NaN had norm 0 and
    F.normalize scaled it by 1 / eps (1e12) where eager gives NaN. The same for std (a NaN row,
    one element with correction 1: 0 where eager gives NaN) and cdist. Inf rows stay inf, zero
    rows 0."""
    x = torch.tensor([[float("inf"), 1.0, 2.0], [float("nan"), 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 4.0, 0.0]])

    def fn(x):
        return (x.norm(dim=1), torch.linalg.vector_norm(x, 3, dim=1), torch.linalg.vector_norm(x, 0.5, dim=1),
                F.normalize(x, dim=1), torch.dist(x[1], x[3]), x.std(dim=1), x[:, :1].std(dim=1),
                torch.std_mean(x, dim=1)[0], torch.cdist(x, x[2:]), torch.cdist(x, x[2:], p=3))

    with pytest.warns(UserWarning, match="degrees of freedom"):  # eager's, for the one-element std
        want = fn(x)
    for got, expected in zip(ModuleGraph(Fn(fn))(x), want):
        torch.testing.assert_close(got, expected, equal_nan=True)


def test_x_to_the_zero_is_one_with_a_zero_gradient() -> None:
    """torch: x ** 0 is 1 (NaN included) and its gradient 0. TVM's power gradient is
    `dy * 0 * x ** -1`: inf * 0 = NaN at x = 0 (converters.power_of_scalar returns ones)."""
    x = torch.tensor([0.0, -0.0, 1.0, -2.0, float("nan")])
    assert_close(ModuleGraph(Fn(lambda x: x ** 0))(x), x ** 0)
    finite = x[:4]
    model = LossOfParameters(lambda x: (x.pow(0) * 3.0 + x,), (finite,), [0])
    SGDStep(model)(torch.ones(4))
    assert_close(finite - model.params[0].detach(), torch.ones(4))  # d(x ** 0 * 3 + x) = 1


def test_embedding_bag_max_of_a_bag_of_minus_infinity_is_minus_infinity() -> None:
    """TVM's argmax gives -1 for an all -inf row, and the gather then read outside the bag."""
    inf = float("inf")
    table, ids, offsets = torch.tensor([[-inf, -inf], [-inf, 1.0], [2.0, 3.0]]), torch.tensor([0, 1, 2]), torch.tensor([0, 2])
    fn = lambda w: (F.embedding_bag(ids, w, offsets, mode="max"),)  # noqa: E731
    assert torch.equal(ModuleGraph(Fn(fn))(table)[0], fn(table)[0])


def test_float32_scans_accumulate_in_float64_as_eager() -> None:
    """torch's CPU cumsum and cumprod carry their running value in a double. TVM's scan carried
    it in float32: the last cumsum of 200000 values of 1e3 + randn was 2e-5 off (eager 4e-8).
    Against float64, within eager's own error; the gradient (a reversed cumsum) too."""
    torch.manual_seed(0)
    x = 1e3 + torch.randn(200000, 3)
    p = 1 + torch.randn(100000) * 1e-3
    ops = lambda x, p: (torch.cumsum(x, 0), torch.cumprod(p, 0), torch.cumsum(x, 0, dtype=torch.float32))  # noqa: E731
    exact = (x.double().cumsum(0), p.double().cumprod(0), x.double().cumsum(0))
    for got, want in zip(ModuleGraph(Fn(ops))(x, p), exact):
        assert got.dtype == torch.float32
        assert_close(got.double(), want, atol=0, rtol=1e-7)
    model = _CumsumWeighted(200000)
    g = 1e3 + torch.randn(200000)
    SGDStep(model)(g)  # lr 1 from zero: w is minus the gradient, g's reversed cumulative sums
    assert_close(-model.w.detach().double(), g.double().flip(0).cumsum(0).flip(0), atol=0, rtol=1e-7)


class _CumsumWeighted(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (torch.cumsum(self.w, 0) * g).sum()

"""The gradients of tvmgraph/gradients' scan, sort, einsum, scatter and nondiff families (and
the concat fix) against torch.autograd, several ops per compiled graph.

Each group builds one Relax function ``sum_i sum(f_i(x_i) * w_i)``, differentiates it with
``relax.transform.Gradient`` and compares every input's gradient with ``torch.autograd`` on the
equivalent torch ops, in float64 (``grad_check.TOLERANCES``). Inputs hold exact zeros, ties
and repeated indices where the gradient has a special case there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from tvm import relax

import tvmgraph
from tvmgraph.errors import UnsupportedOpError
from tvmgraph.training import train_step

from tests.conftest import TrainGraph, assert_steps_match_eager
from tests.numeric.grad_check import (
    TOLERANCES,
    CompiledVJP,
    Inputs,
    OpCase,
    assert_close,
    emit,
    normal,
    torch_output_shape,
    torch_vjp,
)

op = relax.op
DTYPE = "float64"


def check_batch(cases: list[OpCase]) -> None:
    """All ``cases`` in one graph: the loss and every differentiable input's gradient equal
    torch's."""
    rng = np.random.default_rng(0)
    inputs = [[a.astype(DTYPE) if a.dtype.kind == "f" else a for a in c.inputs(rng)] for c in cases]
    diffs = [[i for i, a in enumerate(xs) if a.dtype.kind == "f" and i not in c.nondiff]
             for c, xs in zip(cases, inputs)]
    shapes = [torch_output_shape(c.torch_fn, xs) for c, xs in zip(cases, inputs)]
    weights = [rng.standard_normal(s).astype(DTYPE) for s in shapes]
    params, require, flat = [], [], []
    for k, (xs, w) in enumerate(zip(inputs, weights)):
        vars_ = [relax.Var(f"c{k}_x{i}", relax.TensorType(a.shape, str(a.dtype))) for i, a in enumerate(xs)]
        w_var = relax.Var(f"c{k}_w", relax.TensorType(w.shape, DTYPE))
        params.append((vars_, w_var))
        require += [vars_[i] for i in diffs[k]]
        flat += [*xs, w]
    builder = relax.BlockBuilder()
    with builder.function("main", [v for vars_, w in params for v in (*vars_, w)]):
        with builder.dataflow():
            loss = None
            for case, (vars_, w_var) in zip(cases, params):
                out = emit(case.relax_fn(*vars_))
                term = emit(op.sum(op.multiply(out, w_var)))
                loss = term if loss is None else emit(op.add(loss, term))
            gv = builder.emit_output(loss)
        builder.emit_func_output(gv)
    mod = relax.transform.Gradient("main", require_grads=require)(builder.get())
    got = CompiledVJP(mod).grads(*flat)
    tol, at = TOLERANCES[DTYPE], 0
    for case, xs, diff, w in zip(cases, inputs, diffs, weights):
        _, expected = torch_vjp(case.torch_fn, xs, diff, w)
        for i, want in zip(diff, expected):
            assert_close(got[at], want, tol, f"{case.id} d/dx{i}")
            at += 1
    assert at == len(got), f"{len(got)} gradients, {at} compared"


def arrays(*values: object) -> Inputs:
    """Fixed inputs (float lists become float64, int lists int64)."""
    return lambda rng: [np.asarray(v) for v in values]


def with_zeros(shape: tuple[int, ...], zeros: list[tuple[int, ...]]) -> Inputs:
    """A normal input with exact zeros at ``zeros``."""
    def make(rng: np.random.Generator) -> list[np.ndarray]:
        x = rng.standard_normal(shape)
        for at in zeros:
            x[at] = 0.0
        return [x]
    return make


# fmt: off
SCAN = [
    OpCase("cumprod", lambda x: op.cumprod(x, 1), lambda x: torch.cumprod(x, 1), normal((3, 5))),
    OpCase("cumprod-zeros", lambda x: op.cumprod(x, 1), lambda x: torch.cumprod(x, 1),
           with_zeros((4, 5), [(0, 2), (1, 0), (1, 3), (2, 4), (3, 1), (3, 2)])),
    OpCase("cumprod-flat", lambda x: op.cumprod(x), lambda x: torch.cumprod(x.reshape(-1), 0),
           with_zeros((2, 3), [(0, 2)])),
    OpCase("prod-axis", lambda x: op.prod(x, [1]), lambda x: torch.prod(x, 1),
           with_zeros((4, 3), [(1, 1), (2, 0), (2, 2)])),
    OpCase("prod-all-keepdims", lambda x: op.prod(x, None, keepdims=True),
           lambda x: torch.prod(x).reshape(1, 1), normal((2, 3))),
    OpCase("prod-all-one-zero", lambda x: op.prod(x), torch.prod, with_zeros((2, 3), [(1, 2)])),
]

SORT = [
    OpCase("topk-both", lambda x: relax.TupleGetItem(emit(op.topk(x, 2, 1, "both")), 0),
           lambda x: torch.topk(x, 2, 1).values, normal((3, 5))),
    OpCase("topk-values-smallest", lambda x: op.topk(x, 3, 0, "values", largest=False),
           lambda x: torch.topk(x, 3, 0, largest=False).values, normal((4, 2))),
    OpCase("sort-descending", lambda x: op.sort(x, 1, descending=True),
           lambda x: torch.sort(x, 1, descending=True).values, normal((3, 4))),
    OpCase("argsort-gather",
           lambda x: op.gather_elements(x, emit(op.argsort(x, 0, dtype="int64")), 0),
           lambda x: torch.sort(x, 0).values, normal((4, 3))),
    OpCase("median-all", lambda x: op.median(x), torch.median, normal((3, 3))),
    OpCase("median-all-ties", lambda x: op.median(x), torch.median,
           arrays([[1.0, 2.0, 2.0], [2.0, 5.0, 0.0]])),
    OpCase("median-axis", lambda x: relax.TupleGetItem(emit(op.median(x, 1)), 0),
           lambda x: torch.median(x, 1).values, normal((3, 5))),
    OpCase("median-axis-keepdims", lambda x: relax.TupleGetItem(emit(op.median(x, 0, True)), 0),
           lambda x: torch.median(x, 0, keepdim=True).values, normal((4, 2))),
]

EINSUM = [
    OpCase("einsum-matmul", lambda a, b: op.einsum((a, b), "ij,jk->ik"),
           lambda a, b: torch.einsum("ij,jk->ik", a, b), normal((2, 3), (3, 4))),
    OpCase("einsum-diagonal", lambda x: op.einsum((x,), "ii->i"),
           lambda x: torch.diagonal(x), normal((3, 3))),
    OpCase("einsum-trace", lambda x: op.einsum((x,), "ii"), torch.trace, normal((4, 4))),
    OpCase("einsum-batch-diagonal", lambda x: op.einsum((x,), "...ii->...i"),
           lambda x: torch.diagonal(x, dim1=-2, dim2=-1), normal((2, 3, 3))),
    OpCase("einsum-summed-away", lambda a, b: op.einsum((a, b), "ij,k->i"),
           lambda a, b: torch.einsum("ij,k->i", a, b), normal((2, 3), (4,))),
    OpCase("einsum-same-operand", lambda x: op.einsum((x, x), "ij,ij->j"),
           lambda x: torch.einsum("ij,ij->j", x, x), normal((3, 2))),
]

SCATTER = [
    OpCase("index_put", lambda x, i, j, v: op.index_put(x, (i, j), v),
           lambda x, i, j, v: torch.index_put(x, (i, j), v),
           lambda rng: [rng.standard_normal((3, 4)), np.array([0, 2, 2]), np.array([1, 3, 0]),
                        rng.standard_normal((3,))]),
    OpCase("index_fill-repeated-index", lambda x, i, v: op.index_put(
               x, (emit(op.broadcast_to(op.reshape(i, [3, 1]), [3, 2])), emit(op.broadcast_to(
                   relax.const(np.array([0, 1])), [3, 2]))), v),
           lambda x, i, v: torch.index_fill(x, 0, i, v),
           lambda rng: [rng.standard_normal((4, 2)), np.array([1, 3, 1]), np.array(0.7)]),
    OpCase("index_put-accumulate-broadcast", lambda x, i, j, v: op.index_put(x, (i, j), v, True),
           lambda x, i, j, v: torch.index_put(x, (i, j), v, accumulate=True),
           lambda rng: [rng.standard_normal((3, 4)), np.array([[0], [2]]), np.array([1, 1, 3]),
                        rng.standard_normal((3,))]),
    OpCase("scatter", lambda x, i, u: op.scatter_elements(x, i, u, 1),
           lambda x, i, u: torch.scatter(x, 1, i, u),
           lambda rng: [rng.standard_normal((3, 5)), np.array([[0, 4], [1, 2], [3, 0]]),
                        rng.standard_normal((3, 2))]),
    OpCase("scatter-add-repeats", lambda x, i, u: op.scatter_elements(x, i, u, 0, "add"),
           lambda x, i, u: torch.scatter_add(x, 0, i, u),
           lambda rng: [rng.standard_normal((3, 2)), np.array([[1, 1], [1, 0]]),
                        rng.standard_normal((2, 2))]),
    OpCase("slice_scatter-step", lambda x, s: op.slice_scatter(x, s, 1, 6, 2, axis=1),
           lambda x, s: torch.slice_scatter(x, s, 1, 1, 6, 2), normal((2, 6), (2, 3))),
    OpCase("concat-one-part", lambda x: op.concat([x], 0), lambda x: torch.cat([x]), normal((2, 3))),
    OpCase("concat-empty-part", lambda x, e, y: op.concat([x, e, y], 1),
           lambda x, e, y: torch.cat([x, e, y], 1), normal((2, 3), (2, 0), (2, 1))),
    OpCase("nanmean-mask", lambda x: op.where(emit(op.logical_not(emit(op.isnan(x)))), x, x * x),
           lambda x: torch.where(~torch.isnan(x), x, x * x), normal((2, 3))),
    OpCase("astype-truncation",
           lambda x: op.subtract(x, emit(op.astype(emit(op.astype(x, "int64")), DTYPE))),
           lambda x: x - x.long().double(), normal((2, 3))),
    OpCase("arange-times-x",
           lambda x: op.multiply(x, emit(op.astype(emit(op.arange(0, 4, 1, "int64")), DTYPE))),
           lambda x: x * torch.arange(4), normal((2, 4))),
]


def grid_sample_case(method: str, padding: str, align: bool) -> OpCase:
    """``F.grid_sample`` on a (2, 3, 4, 5) input with a (2, 3, 4, 2) grid reaching past [-1, 1]."""
    return OpCase(
        f"grid_sample-{method}-{padding}-{'aligned' if align else 'unaligned'}",
        lambda x, g: op.image.grid_sample(x, emit(op.permute_dims(g, [0, 3, 1, 2])), method=method,
                                          padding_mode=padding, align_corners=align),
        lambda x, g: F.grid_sample(x, g, mode=method, padding_mode=padding, align_corners=align),
        lambda rng: [rng.standard_normal((2, 3, 4, 5)), rng.uniform(-1.4, 1.4, (2, 3, 4, 2))],
    )


GRID_SAMPLE = [grid_sample_case("bilinear", padding, align)
               for padding in ("zeros", "border", "reflection") for align in (False, True)]
GRID_SAMPLE.append(grid_sample_case("nearest", "zeros", False))
# fmt: on


@pytest.mark.parametrize("cases", [
    pytest.param(SCAN, id="scan"),
    pytest.param(SORT, id="sort", marks=pytest.mark.slow),  # topk/argsort kernels compile slowly
    pytest.param(EINSUM, id="einsum"),
    pytest.param(SCATTER, id="scatter-masks-casts"),
    pytest.param(GRID_SAMPLE, id="grid_sample", marks=pytest.mark.slow),
])
def test_gradients_match_torch(cases: list[OpCase]) -> None:
    """Every case's input gradients equal torch.autograd's (float64)."""
    check_batch(cases)


def test_unsupported_configuration_names_the_limit() -> None:
    """A configuration a gradient does not cover fails at ``Gradient`` time, saying which, and
    the train step turns that into UnsupportedOpError."""
    x = relax.Var("x", relax.TensorType((3, 4), DTYPE))
    idx = relax.Var("i", relax.TensorType((3, 4), "int64"))
    builder = relax.BlockBuilder()
    with builder.function("main", [x, idx]):
        with builder.dataflow():
            out = emit(op.scatter_elements(x, idx, x, 1, "mean"))
            gv = builder.emit_output(op.sum(out))
        builder.emit_func_output(relax.Tuple([gv]))
    mod = builder.get()
    with pytest.raises(RuntimeError, match="reduction='mean'"):
        relax.transform.Gradient("main", require_grads=[x], target_index=0)(mod)
    with pytest.raises(UnsupportedOpError, match="does not cover: gradient of relax.scatter_elements"):
        train_step._differentiate(mod, [0], 0, "graph")


##################### Through a training graph #####################


class OneStep(tvmgraph.nn.Graph):
    """``SGD(lr=1)`` on ``loss_fn(p, *inputs)``: a step changes ``p`` by minus its gradient."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], param: torch.Tensor) -> None:
        super().__init__()
        self.holder = nn.ParameterList([nn.Parameter(param.clone())])
        self.loss_fn = loss_fn
        self.add_optimizer(torch.optim.SGD(self.holder.parameters(), lr=1.0))

    def build(self, *inputs: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.holder[0], *inputs)
        loss.backward()
        return loss


def eager_grad(loss_fn: Callable[..., torch.Tensor], param: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    p = param.clone().requires_grad_(True)
    loss_fn(p, *inputs).backward()
    return p.grad


def test_bfloat16_loss_is_differentiated() -> None:
    """A loss computed in bfloat16 (``Gradient`` takes float16/32/64 only) gets eager's gradient."""
    def loss_fn(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (p.bfloat16() * w).sum()

    param, w = torch.randn(3, 4), torch.randn(3, 4).bfloat16()
    graph = OneStep(loss_fn, param)
    graph(w)
    torch.testing.assert_close(param - graph.holder[0].detach(), eager_grad(loss_fn, param, w))


def test_empty_parameter_and_input_run() -> None:
    """Empty tensors reach the kernels with TVM's compact strides (0 after an empty dimension),
    not torch's: a roll of an empty parameter trains (it failed with "expected to be compact")."""
    def loss_fn(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.roll(p, 1, 0) * w).sum()

    graph = OneStep(loss_fn, torch.randn(2, 0, 3))
    loss = graph(torch.randn(2, 0, 3))
    assert float(loss) == 0.0 and graph.holder[0].shape == (2, 0, 3)


def test_an_unused_data_dependent_shape_does_not_stop_training() -> None:
    """`torch.where(mask)` whose result nothing reads: export keeps it alive through its size
    checks, which the importer ignores; the graph trains as eager (it was refused as a shape
    "on the way to the loss")."""
    model = nn.Linear(4, 4)
    reference = copy.deepcopy(model)

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            rows, cols = torch.where(y > 0)  # noqa: F841 - unused on purpose
            return y

    graph = TrainGraph(Unused(), nn.MSELoss(), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert_steps_match_eager(graph, model, reference, nn.MSELoss(), torch.randn(3, 4), torch.randn(3, 4))


def test_data_dependent_shape_gradient_is_unsupported() -> None:
    """``torch.combinations`` (a ``nonzero`` shape) on the way to the loss is a tvmgraph error."""
    def loss_fn(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (torch.combinations(p, 1) * w).sum()

    graph = OneStep(loss_fn, torch.randn(3))
    with pytest.raises(UnsupportedOpError, match="shape from tensor values"):
        graph(torch.randn(3, 1))



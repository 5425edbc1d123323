"""Max pooling's forward kernel (tvmgraph/max_pool_forward.py): -inf as torch where TOPI had the
lowest finite number, one window over a whole plane as a reduction; integer poolings keep TVM's
kernel. Numbers against torch, NaN and infinities included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tvm import relax
from tvm.script import relax as R

from tests.conftest import ModuleGraph, assert_close
from tvmgraph import max_pool_forward  # noqa: F401  (registers the legalization)


def legalized_kernels(rank: int, shape: tuple, kernel: tuple, padding: int = 0, dtype: str = "float32") -> set[str]:
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor(shape, dtype))
    pool = relax.op.nn.max_pool2d if rank == 2 else relax.op.nn.max_pool3d
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(pool(x, kernel, kernel, padding, layout="NCHW" if rank == 2 else "NCDHW")))
        bb.emit_func_output(out)
    return {gv.name_hint for gv in relax.transform.LegalizeOps()(bb.get()).get_global_vars()} - {"main"}


@pytest.mark.parametrize("rank, shape, kernel", [(2, (2, 3, 5, 7), (5, 7)), (3, (1, 2, 3, 4, 5), (3, 4, 5))],
                         ids=["2d", "3d"])
def test_a_whole_plane_pooling_becomes_a_reduction(rank: int, shape: tuple, kernel: tuple) -> None:
    assert legalized_kernels(rank, shape, kernel) == {"global_max_pool"}


@pytest.mark.parametrize("kernel, padding", [((5, 3), 0), ((5, 7), 1)], ids=["part_of_the_plane", "padded"])
def test_other_poolings_are_windows(kernel: tuple, padding: int) -> None:
    assert legalized_kernels(2, (2, 3, 5, 7), kernel, padding) == {"max_pool2d"}


def test_an_integer_pooling_keeps_tvms_kernel() -> None:
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((2, 3, 4, 4), "int32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.nn.max_pool2d(x, (2, 2), (2, 2))))
        bb.emit_func_output(out)
    text = relax.transform.LegalizeOps()(bb.get()).script()
    assert "pool_max" in text, text  # TOPI's block


class GlobalPools(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.adaptive_max_pool2d(x, 1), F.max_pool2d(x, x.shape[-2:]), F.max_pool1d(x.flatten(2), 20),
                F.adaptive_max_pool3d(x.unsqueeze(1), 1))


class WindowPools(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (F.max_pool2d(x, 2), F.max_pool2d(x, 3, 1, 1), F.max_pool2d(x, 2, 1, 1, dilation=2),
                F.max_pool2d(x, 3, 2, ceil_mode=True), F.adaptive_max_pool2d(x, (2, 5)),
                F.max_pool3d(x.unsqueeze(1), 2, 1, 1), F.max_pool1d(x.flatten(2), 3, 2, 1))


def test_windows_of_minus_infinity_are_minus_infinity_as_in_eager() -> None:
    """A window that holds only -inf (with or without padding) is -inf, as in eager (TOPI's
    kernel gave the lowest finite float, -3.4e38)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5)
    x[0] = float("-inf")
    x[1, :, :2] = float("-inf")
    x[1, 1, 3, 4] = float("nan")
    for got, expected in zip(ModuleGraph(WindowPools())(x), WindowPools()(x)):
        assert_close(got, expected, equal_nan=True)


def test_global_max_pools_match_eager_with_nan_and_infinities() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5)
    x[0, 1, 2, 3] = float("nan")
    x[1, 2] = float("-inf")
    x[1, 0, 0, 0] = float("inf")
    for got, expected in zip(ModuleGraph(GlobalPools())(x), GlobalPools()(x)):
        assert_close(got, expected, equal_nan=True)

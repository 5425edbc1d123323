"""A kernel that TVM fails to build vectorized is built serial (codegen._build_part_or_split),
and the others of its part stay vectorized."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import Fn, ModuleGraph
from tvmgraph import codegen


def test_a_bfloat16_slice_scatter_compiles_and_matches_eager(caplog: pytest.LogCaptureFixture) -> None:
    """Its `where` tests `0 < int64(10 <= i)`: TVM 0.27's bfloat16 legalization raised
    "IntImm can only take scalar, but boolx32 was supplied" on the vector form, and the graph
    failed to compile (the OpInfo sweep in bfloat16, every sample with a nonzero start)."""
    x = torch.randn(20, 20, 20).to(torch.bfloat16)
    src = torch.randn(10, 20, 20).to(torch.bfloat16)

    def fn(x, src):
        return torch.slice_scatter(x, src, dim=0, start=10, end=20), (x * 2).exp()

    with caplog.at_level(logging.DEBUG, logger=codegen.__name__):
        actual = ModuleGraph(Fn(fn))(x, src)
    expected = fn(x, src)
    assert torch.equal(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1], atol=0, rtol=1e-2)
    serial = [r.getMessage() for r in caplog.records if "built serial" in r.getMessage()]
    # Where the vector form fails (AVX-512's 32 lanes; AVX2's 16 built fine on a Zen 3), that
    # one kernel is rebuilt serial, and no other.
    assert len(serial) <= 1 and all("IntImm can only take scalar" in m for m in serial), serial


def test_a_kernel_failing_serial_too_raises_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split only retries what fails vectorized: an error of the serial build is the one raised."""
    real = codegen._build_part

    def failing(part, target, vectorize, kernel_checks):
        if any(gv.name_hint.startswith("add") for gv in part.get_global_vars()):
            raise RuntimeError(f"cannot build (vectorize={vectorize})")
        return real(part, target, vectorize, kernel_checks)

    monkeypatch.setattr(codegen, "_build_part", failing)
    with pytest.raises(Exception, match=r"cannot build \(vectorize=False\)"):
        ModuleGraph(Fn(lambda a, b: a + b))(torch.randn(4, 8), torch.randn(4, 8))

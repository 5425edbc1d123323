"""benchmarks.kernels gives each engine's time as a share of the machine's limit: compute-bound
kernels (FLOPs per byte at or above the ridge point) against the FMA peak, the others against
the copy bandwidth, by the rule graph.profile uses."""

from __future__ import annotations

import pytest

from benchmarks.kernels import KERNELS, limit_share, moved_bytes
from tvmgraph.hardware import Limits

MACHINE = Limits(cpu="test CPU", threads=2, fma_gflops=200.0, bandwidth_gbs=20.0)  # ridge 10 FLOP/B


def kernel(name: str):
    return next(k for k in KERNELS if k.name == name)


def test_a_large_product_is_a_share_of_the_fma_peak() -> None:
    k = kernel("linear+relu 64x1024->1024")  # 134 MFLOP over 4.7 MB: 28 FLOP per byte
    assert limit_share(k, k.flops / 100e9, moved_bytes(k), MACHINE) == "50% FMA"  # 100 of 200 GFLOP/s


def test_a_batch_one_product_is_a_share_of_the_bandwidth() -> None:
    k = kernel("linear+relu 1x4096->4096")  # 0.5 FLOP per byte: W read once
    nbytes = 4 * (4096 + 4096 * 4096 + 4096 + 4096)
    assert moved_bytes(k) == nbytes
    assert limit_share(k, nbytes / 15e9, nbytes, MACHINE) == "75% BW"  # 15 of 20 GB/s


@pytest.mark.parametrize("name", ["softmax 32x128x128", "transpose 1024x1024 (weight)"])
def test_a_kernel_without_flops_is_a_share_of_the_bandwidth(name: str) -> None:
    k = kernel(name)
    assert limit_share(k, 1e-3, moved_bytes(k), MACHINE).endswith(" BW")

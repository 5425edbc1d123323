"""On CUDA, torch.export records scaled_dot_product_attention as a fused kernel that nothing
lowers; tracing for a CUDA device selects the math backend (tvmgraph/trace.py). Checked here
without a GPU: the backends the context enables. tests/gpu/test_cuda.py runs an encoder block."""

from __future__ import annotations

import torch

from tvmgraph.trace import math_attention


def test_a_cuda_device_traces_attention_with_the_math_backend_only() -> None:
    with math_attention([torch.device("cpu"), torch.device("cuda", 0)]):
        assert torch.backends.cuda.math_sdp_enabled()
        assert not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # restored


def test_cpu_tracing_keeps_every_backend() -> None:
    with math_attention([torch.device("cpu")]):
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()

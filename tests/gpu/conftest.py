"""Every GPU test compares with eager float32 on the same GPU, which must then be float32."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_tf32():
    """Eager must compute in float32 to be the reference: cuBLAS and cuDNN (convolutions by
    default) would round through TF32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

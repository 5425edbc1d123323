"""The model zoo (tests/numeric/zoo.py: ResNet-18, a GPT with tied weights, LSTM, GRU, U-Net,
ViT, seq2seq, Llama, a 1-D audio CNN) trained on the GPU: every step's loss, parameters and
buffers against eager float64 and float32 on the same GPU, as on the CPU
(tests/numeric/test_model_zoo.py). Models no one here wrote run through dlight's rules and
tvmgraph's GPU rules, where the CUDA tests' own models do not reach. Skipped without a GPU.

The zoo's models added on 2026-12-05 (MobileNetV3, ConvNeXt, TransformerEncoder, TCN, atrous CNN)
have not run on a GPU yet: a session with one adds them to GPU_CHECKED once they pass."""

from __future__ import annotations

import pytest
import torch

from tests.numeric.test_dynamic_batch import assert_zoo_trains_with_varying_batch
from tests.numeric.test_model_zoo import assert_zoo_trains_as_in_eager

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


GPU_CHECKED = ["audio_m5", "gpt_tied", "gru", "llama", "lstm", "resnet18", "seq2seq", "unet", "vit"]


@pytest.mark.parametrize("name", GPU_CHECKED)
def test_zoo_trains_on_the_gpu_as_in_eager(name: str) -> None:
    assert_zoo_trains_as_in_eager(name, torch.device("cuda"), steps=4)


@pytest.mark.parametrize("name", ["gpt_tied", "llama", "resnet18", "seq2seq", "lstm", "unet"])
def test_zoo_trains_on_the_gpu_with_a_dynamic_batch(name: str) -> None:
    """Batch sizes 3, 5 and 1 through one compile: the kernels' extents symbolic on the GPU
    (the embedding gradient's count of tokens among them)."""
    assert_zoo_trains_with_varying_batch(name, torch.device("cuda"))

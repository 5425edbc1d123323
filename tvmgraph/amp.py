"""Mixed precision (AMP) and loss scaling: the torch side.

`GraphConfig.enable_amp(True)` traces `build()` under `torch.autocast`, at the ATen level
(tvmgraph/trace.py, `_export`), so the program records autocast's casts as explicit `_to_copy`
ops: every op computes in the dtype autocast's policy gives it, exactly as in eager,
and parameters stay float32 inputs whose gradients come back through the casts as float32.

`Graph.set_grad_scaler(scaler)` takes a `torch.amp.GradScaler` (or `tvmgraph.amp.GradScaler`,
which has OneFlow's `flow.amp.GradScaler` signature). The compiled train step scales the loss,
unscales the gradients, skips the update on a non-finite gradient and updates the scale
(tvmgraph/training/loss_scale.py); the scale and growth tracker live in the scaler's own
`_scale` / `_growth_tracker` tensors, as in eager, so `scaler.get_scale()` and
`scaler.state_dict()` read them.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError, OptimizerError

AMP_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DEFAULT_DTYPE = {"cpu": "bfloat16", "cuda": "float16"}  # torch.autocast's defaults


def dtype_name(dtype: object) -> str | None:
    """`torch.bfloat16` -> "bfloat16"; None stays None (the device's default)."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype) and dtype in AMP_DTYPES:
        return AMP_DTYPES[dtype]
    raise ConfigError(f"GraphConfig.enable_amp(mode, dtype) takes dtype=torch.bfloat16, torch.float16 or None "
                      f"(the device's autocast default: bfloat16 on CPU, float16 on CUDA), got {dtype!r}")


def autocast_args(device: torch.device, amp: bool, dtype: str | None) -> tuple[str, torch.dtype] | None:
    """`torch.autocast`'s (device_type, dtype) for tracing build(); None without AMP."""
    if not amp:
        return None
    return device.type, getattr(torch, dtype or _DEFAULT_DTYPE.get(device.type, "bfloat16"))


class GradScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` with OneFlow's signature (`flow.amp.GradScaler`): no device
    argument (the graph keeps the scale on its own device), the same defaults as torch's."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__("cpu", init_scale, growth_factor, backoff_factor, growth_interval, enabled)


def check_scaler(graph_name: str, scaler: Any) -> torch.amp.GradScaler | None:
    """`scaler` if it is a GradScaler (None: no loss scaling), else an OptimizerError."""
    if scaler is None or isinstance(scaler, torch.amp.GradScaler):
        return scaler
    raise OptimizerError(f"{graph_name}: set_grad_scaler(grad_scaler) takes a torch.amp.GradScaler "
                         f"(or tvmgraph.amp.GradScaler) or None, got {type(scaler).__name__}; create one with "
                         f"torch.amp.GradScaler('cpu', init_scale=2.**16).")


def scaler_tensors(scaler: torch.amp.GradScaler, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaler's scale and growth tracker on `device`, created as its first `scale()` would."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    if scaler._scale.device != device:
        scaler._scale = scaler._scale.to(device)
        scaler._growth_tracker = scaler._growth_tracker.to(device)
    return scaler._scale, scaler._growth_tracker


def scaler_hypers(scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """[growth_factor, backoff_factor, growth_interval]: inputs, so changing them needs no recompile."""
    return torch.tensor([scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval],
                        dtype=torch.float64, device=device)

"""Device and precision choices shared by training, evaluation and prediction."""
from __future__ import annotations

import contextlib

import torch

from .errors import VitftError

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' picks cuda, then mps, then cpu; an unavailable explicit choice is a clear error."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VitftError(f"--device {device} asked for, but CUDA is not available here; use --device auto or cpu")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise VitftError("--device mps asked for, but MPS is not available here; use --device auto or cpu")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise VitftError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps") from err


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed-precision context for `precision` ('fp32' is a no-op)."""
    if precision not in PRECISIONS:
        raise VitftError(f"unknown precision {precision!r}; use bf16, fp16 or fp32")
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "fp16" and device.type == "cpu":
        raise VitftError("fp16 autocast is for GPUs; use --precision bf16 or fp32 on the CPU")
    return torch.autocast(device_type=device.type, dtype=PRECISIONS[precision])

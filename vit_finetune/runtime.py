"""Device and precision choices shared by training, evaluation and prediction."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

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


def check_precision(device: torch.device, precision: str) -> None:
    if precision not in PRECISIONS:
        raise VitftError(f"unknown precision {precision!r}; use bf16, fp16 or fp32")
    if precision == "fp16" and device.type == "cpu":
        raise VitftError("fp16 autocast is for GPUs; use --precision bf16 or fp32 on the CPU")


@contextlib.contextmanager
def compute_context(device: torch.device, precision: str) -> Iterator[None]:
    """Autocast for `precision` ('fp32': none) and, on the CPU, the math attention kernel.

    On the CPU, PyTorch's flash-attention kernel is never faster than the math path and its bf16
    backward is much slower (ViT at 64 tokens: 186 vs 136 img/s training; at 197 tokens: 61 vs 45).
    """
    check_precision(device, precision)
    with contextlib.ExitStack() as stack:
        if device.type == "cpu":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if precision != "fp32":
            stack.enter_context(torch.autocast(device_type=device.type, dtype=PRECISIONS[precision]))
        yield


def fit_cpu_threads(device: torch.device, workers: int, processes: int = 1) -> None:
    """On the CPU, give torch only the cores that loader workers and sibling processes leave free.

    OpenMP threads that share a core with a busy worker wait on each other at every op: on a
    2-core machine, 2 torch threads beside 1 loader worker run ~100x slower than 1 thread.
    An explicit OMP_NUM_THREADS wins.
    """
    if device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    free = (os.cpu_count() or 1) // max(processes, 1) - workers
    torch.set_num_threads(max(1, free))

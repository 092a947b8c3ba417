"""Device and precision choices shared by training, evaluation and prediction."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import VitftError

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# what `--device auto` means where it is set (cpu, cuda, cuda:N, mps): the test suite pins the CPU with it, and its
# subprocesses (torchrun ranks, CLI runs) inherit it
DEVICE_ENV = "VITFT_DEVICE"


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' picks $VITFT_DEVICE where set, else cuda, then mps, then cpu; an unavailable explicit choice is a
    clear error."""
    asked, fix = f"--device {device}", "use --device auto or cpu"
    if device == "auto" and os.environ.get(DEVICE_ENV, "auto").strip() not in ("", "auto"):
        device = os.environ[DEVICE_ENV].strip()
        asked, fix = f"{DEVICE_ENV}={device}", f"unset {DEVICE_ENV} or set it to cpu"
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VitftError(f"{asked} asked for, but CUDA is not available here; {fix}")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise VitftError(f"{asked} asked for, but MPS is not available here; {fix}")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise VitftError(f"unknown device {device!r} ({asked}); use auto, cpu, cuda, cuda:N or mps") from err


def check_precision(device: torch.device, precision: str) -> None:
    if precision not in PRECISIONS:
        raise VitftError(f"unknown precision {precision!r}; use bf16, fp16 or fp32")
    if precision == "fp16" and device.type == "cpu":
        raise VitftError("fp16 autocast is for GPUs; use --precision bf16 or fp32 on the CPU")


@contextlib.contextmanager
def compute_context(device: torch.device, precision: str) -> Iterator[None]:
    """Autocast for `precision` ('fp32': none) and, on the CPU, the math attention kernel.

    On the CPU, PyTorch's flash-attention kernel is never faster than the math path and its bf16
    backward is much slower (measurements in the README).
    """
    check_precision(device, precision)
    with contextlib.ExitStack() as stack:
        if device.type == "cpu":
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        if precision != "fp32":
            stack.enter_context(torch.autocast(device_type=device.type, dtype=PRECISIONS[precision]))
        yield


@dataclass(frozen=True)
class CpuPlan:
    """How a loader shares the CPU: its worker processes, and torch's threads while it runs."""

    workers: int
    threads: Optional[int]  # None: torch keeps its own setting (not the CPU, or OMP_NUM_THREADS is set)
    why: str  # one line for the start-up log

    def describe(self) -> str:
        threads = f"{self.threads} torch thread(s)" if self.threads else f"torch's {torch.get_num_threads()} thread(s)"
        return f"{self.workers} loader worker(s) + {threads} ({self.why})"


def cpu_cores(processes: int = 1) -> int:
    """The cores this process may use (its affinity mask), shared evenly among `processes`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(processes, 1))


def fit_cpu_threads(device: torch.device, workers: Optional[int], processes: int = 1, data_ms: float = 1.0,
                    model_ms: float = 200.0) -> CpuPlan:
    """Choose loader workers (when not given) and torch threads together, from the work per image.

    On the CPU, OpenMP threads that share a core with a busy worker wait on each other at every op (2 torch
    threads beside 1 worker on 2 cores are far slower than 1 thread), so a worker costs torch a whole core.
    With c cores, data work D and model work M per image (single-core ms), 0 workers take D + M/c per
    image and w workers max(D/w, M/(c-w)): a worker pays off only when D > M/(c(c-1)), and then the data
    gets its share D/(D+M) of the cores. ViT steps dwarf cached augmentation by two orders of magnitude or more,
    so small CPUs train fastest with no worker at all. An explicit OMP_NUM_THREADS
    wins over the thread count. Off the CPU, torch's threads barely matter: workers default to cores - 1 (<= 8).
    """
    cores = cpu_cores(processes)
    if device.type != "cpu":
        chosen = max(0, min(8, cores - 1)) if workers is None else workers
        return CpuPlan(chosen, None, f"{device.type}: workers feed the accelerator")
    share = data_ms / max(data_ms + model_ms, 1e-9)
    why = f"data ~{data_ms:.2g} ms vs model ~{model_ms:.2g} ms per image on {cores} core(s)"
    if workers is None:
        pays_off = cores > 1 and data_ms * cores * (cores - 1) > model_ms
        workers = min(cores - 1, max(1, round(cores * share))) if pays_off else 0
    else:
        why = f"--workers {workers} on {cores} core(s)"
    if "OMP_NUM_THREADS" in os.environ:
        return CpuPlan(workers, None, why + ", OMP_NUM_THREADS set")
    return CpuPlan(workers, max(1, cores - workers), why)


@contextlib.contextmanager
def torch_threads(threads: Optional[int]) -> Iterator[None]:
    """torch.set_num_threads(threads) for the block, then the previous count again (None: no change)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads and torch.get_num_threads() != previous:
            torch.set_num_threads(previous)

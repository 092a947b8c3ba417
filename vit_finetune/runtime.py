"""Device and precision choices shared by training, evaluation and prediction."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import VitftError
from .files import atomic_write

log = logging.getLogger("vitft")

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
    """Fails on a precision that is unknown or unusable on `device` ('auto' is always usable)."""
    if precision != "auto" and precision not in PRECISIONS:
        raise VitftError(f"unknown precision {precision!r}; use auto, bf16, fp16 or fp32")
    if precision == "fp16" and device.type == "cpu":
        raise VitftError("fp16 autocast is for GPUs; use --precision bf16 or fp32 on the CPU")


@contextlib.contextmanager
def compute_context(device: torch.device, precision: str) -> Iterator[None]:
    """Autocast for `precision` ('fp32': none) and, on the CPU, the math attention kernel.

    On the CPU, PyTorch's flash-attention kernel is never faster than the math path and its bf16
    backward is much slower (measurements in the README).
    """
    check_precision(device, precision)
    if precision == "auto":
        raise VitftError("compute_context needs a chosen precision: pass choose_precision(device, 'auto').precision")
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


def own_cpu_use() -> float:
    """The cores this process has kept busy on average since it started (its CPU time over its age): its own
    share of the load average, at most. 0 where the process's start time is unknown (no /proc)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return 0.0
    age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.process_time() / age if age > 0 else 0.0


def others_load(processes: int = 1) -> float:
    """The cores that other programs keep busy: the 1-minute load average less this run's own use (its
    `processes` alike); 0 where there is no load average (Windows)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return max(0.0, load - own_cpu_use() * max(processes, 1))


def fit_cpu_threads(device: torch.device, workers: Optional[int], processes: int = 1, data_ms: float = 1.0,
                    model_ms: float = 200.0, threads: Optional[int] = None) -> CpuPlan:
    """Choose loader workers (when not given) and torch threads together, from the work per image and the cores
    that other programs leave free.

    On the CPU, OpenMP threads that share a core with a busy worker wait on each other at every op (2 torch
    threads beside 1 worker on 2 cores are far slower than 1 thread), so a worker costs torch a whole core.
    With c cores, data work D and model work M per image (single-core ms), 0 workers take D + M/c per
    image and w workers max(D/w, M/(c-w)): a worker pays off only when D > M/(c(c-1)), and then the data
    gets its share D/(D+M) of the cores. ViT steps dwarf cached augmentation by two orders of magnitude or more,
    so small CPUs train fastest with no worker at all. A core that another program keeps busy (others_load,
    rounded: half a core counts) stalls torch's threads the same way, so the plan leaves it out: on 2 cores
    beside one busy process, 1 thread ran twice as fast as 2. `threads` (--threads) fixes torch's thread count,
    else an explicit OMP_NUM_THREADS keeps torch's own. Off the CPU, torch's threads barely matter: workers
    default to cores - 1 (<= 8).
    """
    if threads is not None and threads < 1:
        raise VitftError(f"--threads {threads}: torch needs at least 1 thread; leave it out to let vitft choose")
    cores = cpu_cores(processes)
    fixed = f", --threads {threads}" if threads else ""
    if device.type != "cpu":
        chosen = max(0, min(8, cores - 1)) if workers is None else workers
        return CpuPlan(chosen, threads, f"{device.type}: workers feed the accelerator{fixed}")
    load = 0.0 if threads else others_load(processes)
    busy = min(cores - 1, int(load + 0.5))
    free = cores - busy
    on = f"{free} of {cores} core(s): other programs keep the rest busy, load {load:.1f}; --threads N overrides" \
        if busy else f"{cores} core(s)"
    if workers is None:
        share = data_ms / max(data_ms + model_ms, 1e-9)
        pays_off = free > 1 and data_ms * free * (free - 1) > model_ms
        workers = min(free - 1, max(1, round(free * share))) if pays_off else 0
        why = f"data ~{data_ms:.2g} ms vs model ~{model_ms:.2g} ms per image on {on}"
    else:
        why = f"--workers {workers} on {on}"
    if threads:
        return CpuPlan(workers, threads, why + fixed)
    if "OMP_NUM_THREADS" in os.environ:
        return CpuPlan(workers, None, why + ", OMP_NUM_THREADS set")
    return CpuPlan(workers, max(1, free - workers), why)


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


# ---- precision by measurement -------------------------------------------------------------------
BF16_MIN_SPEEDUP = 1.1  # bf16 costs accuracy: on the CPU it must be clearly faster, not level within noise
MEASURE_SECONDS = 0.1  # time spent timing each dtype after its warm-up call (at least one timed call)
MEASURE_FLOPS = 4 * 256 * 384 * 1536  # per measured call: 256 token rows through ViT-S's MLP, fewer for wider models
CACHE_ENV = "VITFT_CACHE_DIR"
DEFAULT_WIDTHS = (384, 1536)  # ViT-S: for `vitft env` and where no model is at hand
_BF16_UNITS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}  # /proc/cpuinfo flag -> name


def cache_dir() -> Path:
    """vitft's per-user cache: $VITFT_CACHE_DIR, else $XDG_CACHE_HOME/vitft, else ~/.cache/vitft."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vitft"


def _cpuinfo_field(name: str) -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == name), None)
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what the platform module knows."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> Optional[frozenset[str]]:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none: macOS, Windows)."""
    flags = _cpuinfo_field("flags")
    return frozenset(flags.split()) if flags is not None else None


def cpu_capability() -> str:
    """One line on what matters for bf16: torch's SIMD level and the CPU's bf16 units, e.g. 'AVX2, no bf16 units'."""
    simd, flags = torch.backends.cpu.get_cpu_capability(), cpu_flags()
    if flags is None:
        return f"{simd}, bf16 units unknown"
    units = [name for flag, name in _BF16_UNITS.items() if flag in flags]
    return f"{simd}, bf16 units: {' and '.join(units)}" if units else f"{simd}, no bf16 units"


def model_widths(model: nn.Module) -> tuple[int, int]:
    """(embed dim, widest linear layer in the blocks: the MLP's hidden width), the shapes a step's matmuls have."""
    widest = max((m.out_features for m in model.blocks.modules() if isinstance(m, nn.Linear)), default=0)
    return model.embed_dim, max(widest, model.embed_dim)


@dataclass(frozen=True)
class MatmulTiming:
    """Seconds for one forward pass through a (dim -> hidden -> dim) linear pair per dtype, and its FLOPs."""

    seconds: dict[str, float]  # precision -> seconds
    flops: float

    def gflops(self, precision: str) -> float:
        return self.flops / self.seconds[precision] / 1e9

    def speedup(self, precision: str) -> float:
        """How many times faster than fp32 (below 1: slower)."""
        return self.seconds["fp32"] / self.seconds[precision]


def measure_matmuls(device: torch.device, widths: tuple[int, int], precisions: tuple[str, ...],
                    rows: Optional[int] = None) -> MatmulTiming:
    """Time the model's own matmul shapes under each precision's autocast, as a training step runs them
    (`rows` tokens: by default 256 for ViT-S, fewer for wider models).

    Each dtype gets a warm-up call, then the dtypes take turns for about MEASURE_SECONDS each (at least one call;
    the fastest counts): where bf16 is emulated (no bf16 units) a call is slow and it gets one or two, so the
    whole takes well under a second on any CPU. On one thread, timed by its CPU time: the ratio is the same per
    core, and neither OpenMP threads stalling nor other jobs of a busy shared machine skew it.
    """
    dim, hidden = widths
    rows = rows or max(64, min(256, round(MEASURE_FLOPS / (4 * dim * hidden))))
    generator = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(shape, generator=generator).to(device) for shape in
                 ((rows, dim), (hidden, dim), (dim, hidden)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(precision: str) -> None:
        with torch.inference_mode(), compute_context(device, precision):
            nn.functional.linear(nn.functional.linear(x, w1), w2)
        sync()

    # on the CPU, this thread's CPU time: other processes on a shared machine take wall time, not this
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {precision: [] for precision in precisions}
    with torch_threads(1):
        for precision in precisions:
            run(precision)  # warm-up: kernel selection and first-call allocations
        end = time.perf_counter() + MEASURE_SECONDS * len(precisions)
        while time.perf_counter() < end or not times[precisions[-1]]:
            for precision in precisions:  # in turns, so a busy moment hits each dtype alike
                start = clock()
                run(precision)
                times[precision].append(clock() - start)
    seconds = {precision: min(taken) for precision, taken in times.items()}
    return MatmulTiming(seconds, flops=2 * 2 * rows * dim * hidden)


def _ratio(speedup: float) -> str:
    """'14x slower', '1.6x faster': two digits, none after the point from 10x on."""
    if speedup < 1:
        slower = 1 / speedup
        return f"{slower:.0f}x slower" if slower >= 10 else f"{slower:.2g}x slower"
    return f"{speedup:.0f}x faster" if speedup >= 10 else f"{speedup:.2g}x faster"


def cpu_bf16_speedup(widths: tuple[int, int]) -> float:
    """bf16's speed against fp32 on this CPU for these widths: measured once, then read from the per-user cache
    (keyed by CPU model, torch version and widths, so new hardware or a new torch measures again)."""
    path = cache_dir() / "precision.json"
    key = f"{cpu_model()} | torch {torch.__version__} | widths {widths[0]}x{widths[1]}"
    try:
        cached = json.loads(path.read_text())
        cached = cached if isinstance(cached, dict) else {}
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key)
    speedup = entry.get("bf16_speedup") if isinstance(entry, dict) else None
    if isinstance(speedup, (int, float)) and speedup > 0:  # anything else (a hand-edited file): measure again
        return float(speedup)
    timing = measure_matmuls(torch.device("cpu"), widths, ("fp32", "bf16"))
    cached[key] = {"bf16_speedup": timing.speedup("bf16"), "fp32_gflops": timing.gflops("fp32"),
                   "bf16_gflops": timing.gflops("bf16"), "capability": cpu_capability()}
    try:
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(cached, indent=1) + "\n"))
    except OSError as err:  # a read-only home: the choice still stands, it is measured again next time
        log.debug("cannot cache the precision measurement in %s: %s", path, err)
    return timing.speedup("bf16")


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run computes in, and why: the start-up line's `precision ...` part."""

    precision: str
    reason: str
    bf16_speedup: Optional[float] = None  # measured on the CPU (fp32 time / bf16 time); None: not measured

    def describe(self) -> str:
        return f"precision {self.precision} ({self.reason})"


def choose_precision(device: torch.device, requested: str = "auto",
                     widths: tuple[int, int] = DEFAULT_WIDTHS) -> PrecisionChoice:
    """`requested` as given, or for 'auto': on CUDA bf16 where the GPU has it (else fp16, with a grad scaler in
    training); on the CPU bf16 only where a short measurement of these matmul widths finds it faster (without
    bf16 units PyTorch emulates bf16 and a step is 10-20x slower); elsewhere fp32. An explicit bf16 that
    measures slower on this CPU still runs, with a warning."""
    check_precision(device, requested)
    if requested != "auto":
        if requested == "bf16" and device.type == "cpu":
            speedup = cpu_bf16_speedup(widths)
            if speedup < 1:
                log.warning("--precision bf16: bf16 measured %s than fp32 on this CPU (%s); --precision auto "
                            "would pick fp32", _ratio(speedup), cpu_capability())
            return PrecisionChoice("bf16", f"asked for; bf16 measured {_ratio(speedup)} on this CPU", speedup)
        return PrecisionChoice(requested, "asked for")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16", "auto: this GPU computes in bf16")
        return PrecisionChoice("fp16", "auto: this GPU has no bf16, so fp16 with a grad scaler")
    if device.type != "cpu":
        return PrecisionChoice("fp32", f"auto: fp32 on {device.type}")
    speedup = cpu_bf16_speedup(widths)
    chosen = "bf16" if speedup >= BF16_MIN_SPEEDUP else "fp32"
    return PrecisionChoice(chosen, f"bf16 measured {_ratio(speedup)} on this CPU: {cpu_capability()}", speedup)

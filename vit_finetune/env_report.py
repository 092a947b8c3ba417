"""`vitft env`: what a bug report needs, in one paste: versions, devices, the CPU and its measured matmul speed,
what `precision: auto` picks, threads and loader workers, the HF cache and whether the Hub answers.

Works offline, in a few seconds: the Hub check is the short one `weights` makes before any download (run
beside the measurements), and the matmul measurement is the one `precision: auto` makes (well under a second).
"""
from __future__ import annotations

import os
import platform
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from . import __version__

PACKAGES = ("torch", "timm", "huggingface_hub", "albumentations", "safetensors")
CUDA_ROWS = 8192  # a GPU needs big matmuls to show its speed; a CPU is measured at the sizes auto measures


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _cpu(flags) -> dict[str, Any]:
    import torch

    from .runtime import cpu_capability, cpu_cores, cpu_model

    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return {
        "model": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": cpu_cores(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": None if flags is None else {flag: flag in flags for flag in wanted},
        "summary": cpu_capability(),
    }


def _auto(device, choice) -> dict[str, Any]:
    """What `precision: auto` picks: the precision as a plain value, and why (the start-up line's words)."""
    return {"device": str(device), "precision": choice.precision, "reason": choice.reason,
            "bf16_speedup": choice.bf16_speedup}


def _devices() -> list[str]:
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def _throughput(widths: tuple[int, int]) -> dict[str, dict[str, float]]:
    """Measured matmul GFLOP/s per device and precision (one CPU thread, as `auto` measures)."""
    import torch

    from .runtime import measure_matmuls

    timing = measure_matmuls(torch.device("cpu"), widths, ("fp32", "bf16"))
    result = {"cpu (1 thread)": {p: round(timing.gflops(p), 1) for p in timing.seconds}}
    if torch.cuda.is_available():
        timing = measure_matmuls(torch.device("cuda"), widths, ("fp32", "bf16", "fp16"), rows=CUDA_ROWS)
        result["cuda"] = {p: round(timing.gflops(p), 1) for p in timing.seconds}
    return result


def _hub() -> dict[str, Any]:
    from huggingface_hub import constants

    from .weights.download import hub_unreachable

    offline = constants.HF_HUB_OFFLINE
    unreachable = None if offline else hub_unreachable()
    reachable = "not checked: HF_HUB_OFFLINE is set" if offline else ("no: " + unreachable if unreachable else "yes")
    return {"cache": constants.HF_HUB_CACHE, "endpoint": constants.ENDPOINT, "reachable": reachable}


def collect() -> dict[str, Any]:
    """Everything `vitft env` prints, as a JSON-ready mapping."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        hub = pool.submit(_hub)  # a name lookup and a connect with a timeout: beside the measurements
        import torch

        from .runtime import DEFAULT_WIDTHS, choose_precision, cpu_cores, cpu_flags, resolve_device

        device = resolve_device("auto")
        cores = cpu_cores()
        report = {
            "versions": {"vitft": __version__, **{name: _version(name) for name in PACKAGES},
                         "python": platform.python_version()},
            "platform": platform.platform(),
            "devices": _devices(),
            "cpu": _cpu(cpu_flags()),
            "matmul_gflops": _throughput(DEFAULT_WIDTHS),
            "matmul_widths": list(DEFAULT_WIDTHS),
            "auto": _auto(device, choose_precision(device, "auto", DEFAULT_WIDTHS)),
            "threads": {
                "torch": torch.get_num_threads(),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "loader_workers": f"on the CPU a loader worker takes a whole core from torch: with {cores} core(s), "
                                  "workers only where an image's data work exceeds its model work / "
                                  f"{cores * (cores - 1)} (cores x (cores - 1)), and torch gets the other cores, less "
                                  "those other programs keep busy (load average); --workers and --threads override it",
            },
        }
        report["hub"] = hub.result()
    return report


def format_text(report: dict[str, Any]) -> str:
    """The report as `key: value` lines, the form people paste into an issue."""
    lines = [f"- {name}: {value}" for name, value in report["versions"].items()]
    cpu = report["cpu"]
    flags = cpu["flags"]
    shown_flags = "unknown (no /proc/cpuinfo)" if flags is None else \
        ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in flags.items())
    lines += [
        f"- platform: {report['platform']}",
        f"- devices: {', '.join(report['devices'])}",
        f"- CPU: {cpu['model']}, {cpu['cores']} core(s) ({cpu['cores_usable']} usable)",
        f"- CPU capability: {cpu['summary']}; flags: {shown_flags}",
    ]
    widths = "x".join(str(w) for w in report["matmul_widths"])
    for where, gflops in report["matmul_gflops"].items():
        speeds = ", ".join(f"{p} {value:g}" for p, value in gflops.items())
        lines.append(f"- matmul GFLOP/s, {where}, widths {widths}: {speeds}")
    threads = report["threads"]
    lines += [
        f"- auto picks: device {report['auto']['device']}, precision {report['auto']['precision']} "
        f"({report['auto']['reason']}; widths {widths}, measured once per machine and cached)",
        f"- torch threads: {threads['torch']} (OMP_NUM_THREADS {threads['OMP_NUM_THREADS'] or 'not set'})",
        f"- loader workers: {threads['loader_workers']}",
        f"- HF cache: {report['hub']['cache']}",
        f"- Hub {report['hub']['endpoint']} reachable: {report['hub']['reachable']}",
    ]
    return "\n".join(lines)


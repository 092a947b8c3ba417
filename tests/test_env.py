"""`vitft env`: the bug-report summary, as text and as JSON, offline and within its time bound."""
from __future__ import annotations

import json
import logging
import re
import time
from importlib.metadata import version

import pytest
import torch
from huggingface_hub import constants
from typer.testing import CliRunner

from vit_finetune import __version__, runtime
from vit_finetune.cli import app

CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, so the connect is refused at once


@pytest.fixture
def offline_hub(monkeypatch):
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED_PORT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def env(*args: str):
    logging.getLogger("vitft").handlers.clear()  # cli binds its handler to the first CliRunner's stderr
    result = CliRunner().invoke(app, ["env", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_text_names_versions_cpu_speed_choice_and_hub(offline_hub):
    lines = env().splitlines()
    for package in ("torch", "timm", "huggingface_hub", "albumentations", "safetensors"):
        assert f"- {package}: {version(package)}" in lines
    assert f"- vitft: {__version__}" in lines and lines[-1].startswith(f"- Hub {CLOSED_PORT} reachable: no: ")
    assert f"- CPU: {runtime.cpu_model()}, " in "\n".join(lines)
    assert f"- CPU capability: {runtime.cpu_capability()}; flags: avx2 " in "\n".join(lines)
    widths = "x".join(map(str, runtime.DEFAULT_WIDTHS))
    assert any(re.fullmatch(rf"- matmul GFLOP/s, cpu \(1 thread\), widths {widths}: fp32 [\d.]+, bf16 [\d.]+", line)
               for line in lines)
    assert any(re.fullmatch(r"- auto picks: device cpu, precision (fp32|bf16) \(bf16 measured .+ on this CPU: .+; "
                            rf"widths {widths}, measured once per machine and cached\)", line) for line in lines)
    assert f"- torch threads: {torch.get_num_threads()} " in "\n".join(lines)
    assert f"with {runtime.cpu_cores()} core(s)" in "\n".join(lines)
    assert f"- HF cache: {constants.HF_HUB_CACHE}" in lines


def test_json_for_machines(offline_hub):
    report = json.loads(env("--json"))
    assert set(report) == {"versions", "platform", "devices", "cpu", "matmul_gflops", "matmul_widths", "auto",
                           "threads", "hub"}
    assert report["versions"]["torch"] == version("torch") and report["devices"][0] == "cpu"
    assert set(report["cpu"]["flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert all(gflops > 0 for gflops in report["matmul_gflops"]["cpu (1 thread)"].values())
    choice = runtime.choose_precision(torch.device("cpu"))  # cached: the same
    assert (report["auto"]["precision"], report["auto"]["reason"]) == (choice.precision, choice.reason)
    assert report["auto"]["precision"] in ("fp32", "bf16")  # a value for machines, not a sentence
    assert report["hub"]["reachable"].startswith("no: 127.0.0.1:9 does not answer")


def test_offline_mode_skips_the_hub_check(offline_hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("vit_finetune.weights.download.hub_unreachable", None)  # never called
    assert json.loads(env("--json"))["hub"]["reachable"] == "not checked: HF_HUB_OFFLINE is set"


def test_env_takes_under_five_seconds(offline_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("VITFT_CACHE_DIR", str(tmp_path))  # nothing cached: auto measures too
    # two measurements (the report's and auto's) of 2 x MEASURE_SECONDS each plus their warm-up calls: about a
    # second; the rest of the 5 s is the margin for a CPU shared with other jobs
    start = time.perf_counter()
    env()
    assert time.perf_counter() - start < 5

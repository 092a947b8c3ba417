"""The device `--device auto` picks (the CPU in tests, subprocesses too), and how a loader shares the CPU with
torch: the choice of workers and threads, and that it is undone after."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from PIL import Image

from vit_finetune import VitftError, runtime
from vit_finetune.data.loaders import ImageDataset, build_loader
from vit_finetune.data.transforms import build_transforms
from vit_finetune.runtime import DEVICE_ENV, compute_context, fit_cpu_threads, resolve_device

CPU = torch.device("cpu")


@pytest.fixture
def cores(monkeypatch):
    def use(n: int) -> None:
        monkeypatch.setattr(runtime, "cpu_cores", lambda processes=1: max(1, n // processes))
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return use


def test_small_cpus_give_every_core_to_torch(cores):
    cores(2)
    plan = fit_cpu_threads(CPU, None, data_ms=0.2, model_ms=20.0)  # cached 64 px crops, a small ViT step
    assert (plan.workers, plan.threads) == (0, 2)
    assert "0 loader worker(s) + 2 torch thread(s)" in plan.describe()


def test_workers_pay_off_when_decoding_is_a_real_share_of_the_work(cores):
    cores(16)
    plan = fit_cpu_threads(CPU, None, data_ms=50.0, model_ms=150.0)  # big photos decoded at every step
    assert (plan.workers, plan.threads) == (4, 12)  # a quarter of the work, a quarter of the cores
    cores(2)
    assert fit_cpu_threads(CPU, None, data_ms=50.0, model_ms=150.0).workers == 0  # would cost torch half


def test_explicit_workers_and_processes_share_the_cores(cores):
    cores(16)
    assert fit_cpu_threads(CPU, 3, processes=2).threads == 5  # 8 cores per process, 3 to the workers
    plan = fit_cpu_threads(torch.device("cuda"), None)
    assert plan.threads is None and plan.workers == 8  # off the CPU, torch's threads are left alone


def test_loader_restores_torchs_thread_count(tmp_path, cores):
    cores(2)
    for i in range(4):
        Image.fromarray(np.full((20, 20, 3), 40 * i, np.uint8)).save(tmp_path / f"{i}.png")
    dataset = ImageDataset(sorted(tmp_path.glob("*.png")), build_transforms({}, 16, train=False), img_size=16)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loader = build_loader(dataset, 2, train=False)
        assert loader.cpu_plan.threads == 2 and torch.get_num_threads() == 1
        during = [torch.get_num_threads() for _ in loader]
        assert during == [2, 2] and torch.get_num_threads() == 1  # as evaluate()/predict() found it
    finally:
        torch.set_num_threads(previous)


# ---- the device ------------------------------------------------------------------------------------------
AUTO_WITH_CUDA = """
import torch
torch.cuda.is_available = lambda: True  # a GPU machine, as far as vitft can tell
from vit_finetune.runtime import resolve_device
print(resolve_device("auto"))
"""


def test_tests_run_on_the_cpu_even_where_cuda_is_available(monkeypatch):
    """conftest pins VITFT_DEVICE=cpu: `--device auto` then means the CPU in this process and in the subprocesses
    tests start (torchrun ranks, CLI runs), whatever the machine has; an explicit --device still wins."""
    assert os.environ[DEVICE_ENV] == "cpu"
    proc = subprocess.run([sys.executable, "-c", AUTO_WITH_CUDA], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert (proc.returncode, proc.stdout.strip()) == (0, "cpu"), proc.stderr
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cuda") == torch.device("cuda")
    monkeypatch.delenv(DEVICE_ENV)
    assert resolve_device("auto") == torch.device("cuda")  # what an unpinned run on a GPU machine picks


def test_an_unavailable_device_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VitftError, match=r"^--device cuda:1 asked for, but CUDA is not available here; use --device"):
        resolve_device("cuda:1")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(VitftError, match=rf"^{DEVICE_ENV}=cuda asked for, but CUDA is not available here; "
                                         rf"unset {DEVICE_ENV} or set it to cpu$"):
        resolve_device("auto")
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(VitftError, match=rf"^unknown device 'tpu' \({DEVICE_ENV}=tpu\); use auto, cpu, cuda"):
        resolve_device("auto")


@pytest.mark.gpu
def test_auto_picks_the_gpu_and_bf16_runs_there():
    device = resolve_device("auto")
    assert device.type == "cuda"
    x = torch.randn(8, 8, device=device)
    with compute_context(device, "bf16"):
        assert (x @ x).dtype == torch.bfloat16

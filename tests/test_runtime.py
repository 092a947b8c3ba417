"""The device `--device auto` picks (the CPU in tests, subprocesses too), and how a loader shares the CPU with
torch: the choice of workers and threads (cores other programs keep busy left out, --threads fixing it), and that
it is undone after."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, invoke_cli, make_images
from PIL import Image

from vit_finetune import VitftError, runtime
from vit_finetune.data.loaders import ImageDataset, build_loader
from vit_finetune.data.transforms import build_transforms
from vit_finetune.runtime import DEVICE_ENV, compute_context, fit_cpu_threads, resolve_device

CPU = torch.device("cpu")


@pytest.fixture
def cores(monkeypatch):
    """use(n): a machine of n cores, no other program busy on it (load average 0) unless the test says so."""
    def use(n: int) -> None:
        monkeypatch.setattr(runtime, "cpu_cores", lambda processes=1: max(1, n // processes))
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return use


def load(monkeypatch, average: float, own: float = 0.0) -> None:
    """A 1-minute load average of `average`, of which this process's own use is `own` cores."""
    monkeypatch.setattr(os, "getloadavg", lambda: (average, average, average))
    monkeypatch.setattr(runtime, "own_cpu_use", lambda: own)


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


def test_cores_other_programs_keep_busy_are_left_to_them(cores, monkeypatch):
    """On 2 cores beside one busy process, 1 torch thread ran at 6 img/s where 2 ran at 3: a busy core is left out,
    and the start-up line says so. The run's own share of the load is not another program's."""
    cores(2)
    load(monkeypatch, 2.3, own=1.0)  # another program keeps one core busy
    plan = fit_cpu_threads(CPU, None, data_ms=0.2, model_ms=20.0)
    assert (plan.workers, plan.threads) == (0, 1)
    assert plan.describe() == ("0 loader worker(s) + 1 torch thread(s) (data ~0.2 ms vs model ~20 ms per image on 1 "
                               "of 2 core(s): other programs keep the rest busy, load 1.3; --threads N overrides)")
    assert fit_cpu_threads(CPU, 0).threads == 1  # explicit workers too
    load(monkeypatch, 1.2, own=1.0)  # only this run's own work
    assert fit_cpu_threads(CPU, None, data_ms=0.2, model_ms=20.0).threads == 2
    cores(16)
    load(monkeypatch, 12.0)  # 12 of 16 busy: the data's quarter of the 4 free cores is a worker
    plan = fit_cpu_threads(CPU, None, data_ms=50.0, model_ms=150.0)
    assert (plan.workers, plan.threads) == (1, 3)


def test_threads_option_fixes_torchs_threads(cores, monkeypatch):
    cores(2)
    load(monkeypatch, 4.0)
    plan = fit_cpu_threads(CPU, None, data_ms=0.2, model_ms=20.0, threads=2)
    assert plan.threads == 2 and plan.describe().endswith("on 2 core(s), --threads 2)")  # the load is not read
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert fit_cpu_threads(CPU, 0, threads=3).threads == 3  # --threads wins over OMP_NUM_THREADS
    assert fit_cpu_threads(torch.device("cuda"), None, threads=4).threads == 4
    with pytest.raises(VitftError, match=r"^--threads 0: torch needs at least 1 thread; leave it out"):
        fit_cpu_threads(CPU, None, threads=0)


def test_threads_reach_torch_in_training_and_validation(tmp_path, cores, monkeypatch):
    """`vitft finetune --threads 1` (a TrainConfig option, so the CLI has it): every forward pass, training and
    validation, runs on 1 torch thread although torch had 2 and the 2 cores are free."""
    from vit_finetune.models.vit import VisionTransformer

    cores(2)
    seen = []
    forward = VisionTransformer.forward

    def recording(self, *args, **kwargs):
        seen.append((self.training, torch.get_num_threads()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(VisionTransformer, "forward", recording)
    data = make_images(tmp_path / "data", {"a": 8, "b": 8}, size=32)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = invoke_cli("finetune", "--data", data, "--pretrained", "none", "--model", "vit_tiny_patch16_224",
                            "--img-size", 32, "--model-kwargs", "patch_size=8", "--model-kwargs", "embed_dim=32",
                            "--model-kwargs", "depth=1", "--model-kwargs", "num_heads=2", "--epochs", 1,
                            "--batch-size", 4, "--val-split", 0.25, "--quiet", "--precision", "fp32",
                            "--output", tmp_path / "run", "--threads", 1)
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == 2  # given back after the run
    finally:
        torch.set_num_threads(previous)
    assert {training for training, _ in seen} == {True, False}
    assert {threads for _, threads in seen} == {1}


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

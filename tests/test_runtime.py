"""How a loader shares the CPU with torch: the choice of workers and threads, and that it is undone after."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vit_finetune import runtime
from vit_finetune.data.loaders import ImageDataset, build_loader
from vit_finetune.data.transforms import build_transforms
from vit_finetune.runtime import fit_cpu_threads

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

"""precision 'auto': chosen per device by a cached measurement, stated at start-up, and used by every command.

The CPU's measurement is simulated (its timings and its capability flags replaced), so each case runs on any CPU;
the decision, the cache and the call sites are the real ones.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from conftest import TINY, make_subset

from vit_finetune import runtime
from vit_finetune.config import TrainConfig
from vit_finetune.engine.trainer import Trainer
from vit_finetune.errors import VitftError
from vit_finetune.runtime import MatmulTiming, choose_precision, compute_context
from vit_finetune.tasks.evaluate import evaluate

CPU = torch.device("cpu")
AVX2_NO_UNITS = "AVX2, no bf16 units"


@pytest.fixture
def simulated_cpu(monkeypatch, tmp_path):
    """A CPU whose bf16 matmuls take `cpu.bf16_seconds` against fp32's 0.01 s; records each measurement.

    Its flags are an AVX2 CPU's without bf16 units, and the cache is a fresh folder."""
    monkeypatch.setenv("VITFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"sse2", "avx", "avx2", "fma"}))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")

    class Cpu:
        bf16_seconds = 0.14  # 14x slower, as emulated bf16 is
        measured: list[tuple[int, int]] = []

    def measure(device, widths, precisions, rows=None):
        Cpu.measured.append(widths)
        return MatmulTiming({"fp32": 0.01, "bf16": Cpu.bf16_seconds}, flops=1e9)

    monkeypatch.setattr(runtime, "measure_matmuls", measure)
    return Cpu


def test_auto_picks_fp32_where_bf16_measures_slower_and_says_why(simulated_cpu):
    choice = choose_precision(CPU, "auto", (192, 576))
    assert choice.precision == "fp32" and choice.bf16_speedup == pytest.approx(1 / 14)
    assert choice.describe() == f"precision fp32 (bf16 measured 14x slower on this CPU: {AVX2_NO_UNITS})"


@pytest.mark.parametrize("bf16_seconds, expected", [(0.00625, "bf16"), (0.0095, "fp32")])
def test_auto_picks_bf16_only_where_it_is_clearly_faster(simulated_cpu, bf16_seconds, expected):
    simulated_cpu.bf16_seconds = bf16_seconds  # 1.6x faster: bf16; 1.05x: within noise, fp32 keeps its accuracy
    choice = choose_precision(CPU, "auto", (192, 576))
    assert choice.precision == expected
    assert f"faster on this CPU: {AVX2_NO_UNITS}" in choice.reason


def test_the_measurement_is_cached_per_machine_and_widths(simulated_cpu, tmp_path):
    choose_precision(CPU, "auto", (192, 576))
    assert simulated_cpu.measured == [(192, 576)]
    cache = json.loads((tmp_path / "cache" / "precision.json").read_text())
    (key, entry), = cache.items()
    assert runtime.cpu_model() in key and torch.__version__ in key and "192x576" in key
    assert entry["bf16_speedup"] == pytest.approx(1 / 14)

    simulated_cpu.bf16_seconds = 0.001  # were it measured again, bf16 would win: the cached result must stand
    assert choose_precision(CPU, "auto", (192, 576)).precision == "fp32"
    assert simulated_cpu.measured == [(192, 576)]  # no second measurement
    assert choose_precision(CPU, "auto", (384, 1536)).precision == "bf16"  # other widths: measured anew
    assert simulated_cpu.measured == [(192, 576), (384, 1536)]


def test_explicit_bf16_that_measures_slower_runs_with_a_warning(simulated_cpu, caplog):
    caplog.set_level("WARNING", logger="vitft")
    choice = choose_precision(CPU, "bf16", (192, 576))
    assert choice.precision == "bf16"
    warning, = [r.getMessage() for r in caplog.records]
    assert warning == (f"--precision bf16: bf16 measured 14x slower than fp32 on this CPU ({AVX2_NO_UNITS}); "
                       "--precision auto would pick fp32")
    caplog.clear()
    assert choose_precision(CPU, "fp32", (192, 576)).describe() == "precision fp32 (asked for)"
    simulated_cpu.bf16_seconds = 0.005
    faster = choose_precision(CPU, "bf16", (64, 256))  # other widths, where bf16 measures faster: no warning
    assert faster.precision == "bf16" and not caplog.records


@pytest.mark.parametrize("bf16_supported, expected", [(True, "bf16"), (False, "fp16")])
def test_cuda_auto_is_bf16_where_supported_else_fp16(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: bf16_supported)
    monkeypatch.setattr(runtime, "measure_matmuls", None)  # nothing is measured on a GPU
    assert choose_precision(torch.device("cuda"), "auto").precision == expected


def test_unknown_precision_and_unresolved_auto_are_errors():
    with pytest.raises(VitftError, match="unknown precision 'fp8'; use auto, bf16, fp16 or fp32"):
        choose_precision(CPU, "fp8")
    with pytest.raises(VitftError, match="compute_context needs a chosen precision"):
        with compute_context(CPU, "auto"):
            pass


def test_real_measurement_is_short_and_ranks_the_dtypes():
    start = time.perf_counter()
    timing = runtime.measure_matmuls(CPU, runtime.DEFAULT_WIDTHS, ("fp32", "bf16"))
    elapsed = time.perf_counter() - start
    assert set(timing.seconds) == {"fp32", "bf16"} and all(s > 0 for s in timing.seconds.values())
    assert timing.gflops("fp32") > 0.1 and timing.speedup("fp32") == 1
    # MEASURE_SECONDS per dtype plus a warm-up and a last call each; a busy shared machine gets a wide margin
    assert elapsed < 2 * runtime.MEASURE_SECONDS + 2.0


def test_training_states_the_measured_choice(simulated_cpu, small_images, tiny_model_dir, tmp_path):
    cfg = TrainConfig(data=str(small_images), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"),
                      epochs=1, batch_size=8, workers=0, quiet=True)
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.precision == "fp32"
    assert simulated_cpu.measured == [(TINY["embed_dim"], 4 * TINY["embed_dim"])]  # the model's own widths
    device_line = next(line for line in trainer.describe() if line.startswith("device:"))
    assert device_line.startswith(f"device: cpu, precision fp32 (bf16 measured 14x slower on this CPU: "
                                  f"{AVX2_NO_UNITS});")


@pytest.mark.parametrize("bf16_seconds, expected", [(0.14, "fp32"), (0.005, "bf16")])
def test_evaluation_uses_the_same_choice(simulated_cpu, tiny_model_dir, class_images, tmp_path, bf16_seconds,
                                         expected):
    simulated_cpu.bf16_seconds = bf16_seconds
    data = make_subset(class_images, tmp_path / "data", 2)
    report = evaluate(str(tiny_model_dir), data, workers=0, batch_size=32)
    assert report.runtime["precision"] == expected


def test_explain_in_bf16_gives_float_heat_maps(tiny_model_dir, class_images):
    from vit_finetune.tasks.explain import explain

    images = sorted((class_images / "forest").iterdir())[:2]
    results = explain(str(tiny_model_dir), images, method="rollout", precision="bf16", batch_size=2)
    assert [r.error for r in results] == [None, None]
    assert all(r.grid.dtype == np.float32 and r.heatmap.dtype.kind == "f" for r in results)

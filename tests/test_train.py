"""Fine-tuning on real images: run folder contents, resume, interruption, DDP, bad images, errors."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from vit_finetune import create_model, save_pretrained
from vit_finetune.cli import app
from vit_finetune.errors import VitftError
from vit_finetune.train import CHECKPOINT, TrainConfig, finetune, load_recipe

from conftest import CLASSES, TINY, make_subset

REPO = Path(__file__).resolve().parents[1]
# small and quick: a tiny pretrained-style checkpoint at 32 px, 2 epochs over 240 real images
QUICK = dict(epochs=2, batch_size=24, lr=0.02, workers=0, img_size=None, warmup_epochs=0, quiet=True)


def _cli_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), NO_ALBUMENTATIONS_UPDATE="1", OMP_NUM_THREADS="1")


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def run(small_intel, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    result = finetune(data=str(small_intel), pretrained=str(tiny_model_dir), output=str(out), **QUICK)
    return out, result


def test_run_folder_has_every_file_and_loss_falls(run):
    run_dir, result = run
    for name in ("config.json", "model.safetensors", "metrics.csv", "curves.png", "train_config.json",
                 str(CHECKPOINT)):
        assert (run_dir / name).is_file(), name
    rows = _rows(run_dir)
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert set(rows[0]) >= {"train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "seconds"}
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["label_names"] == CLASSES and config["num_classes"] == 6
    assert config["pretrained_cfg"]["mean"] and config["pretrained_cfg"]["crop_pct"]
    assert config["vitft"]["best"]["epoch"] == result.best_epoch
    assert result.epochs_done == 2 and 0 <= result.best_top1 <= 1


def test_best_model_reloads_with_its_validation_accuracy(run):
    run_dir, result = run
    model = create_model(f"local-dir:{run_dir}", pretrained=True)
    assert model.pretrained_cfg["label_names"] == CLASSES
    best = max(_rows(run_dir), key=lambda r: float(r["val_top1"]))
    assert float(best["val_top1"]) == pytest.approx(result.best_top1, abs=1e-4)


def test_resume_continues_at_the_next_epoch(run, tmp_path):
    run_dir, _ = run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run_dir), str(copy)], check=True)
    result = finetune(resume=copy, epochs=4)
    rows = _rows(copy)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert rows[:2] == _rows(run_dir)[:2]
    # the schedule is stretched to the new length: epoch 3 is no longer stuck at the old run's min_lr
    assert float(rows[2]["lr"]) > 10 * float(rows[1]["lr"])
    state = torch.load(copy / CHECKPOINT, weights_only=False)
    assert state["epoch"] == 4 and result.epochs_done == 4
    assert state["global_step"] == 4 * (216 // 24)  # 216 train images, full batches only


def test_resume_of_a_finished_run_asks_for_more_epochs(run):
    with pytest.raises(VitftError, match="already finished 2 epochs"):
        finetune(resume=run[0])


def test_sigint_checkpoints_mid_epoch_and_resume_finishes(small_intel, tiny_model_dir, tmp_path):
    """A signal mid-run leaves a loadable checkpoint at the exact step; resume completes the schedule."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vit_finetune", "finetune", "--data", str(small_intel), "--pretrained",
           str(tiny_model_dir), "--output", str(out), "--epochs", "3", "--batch-size", "8", "--workers", "0",
           "--save-every", "3", "--quiet"]
    proc = subprocess.Popen(cmd, env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (out / CHECKPOINT).exists() and time.time() < deadline:
        time.sleep(0.2)
    assert (out / CHECKPOINT).exists(), proc.communicate()[0]
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    assert "interrupted" in output and "--resume" in output
    state = torch.load(out / CHECKPOINT, weights_only=False)
    steps_per_epoch = 216 // 8
    assert state["global_step"] == state["epoch"] * steps_per_epoch + state["step_in_epoch"]
    assert state["global_step"] < 3 * steps_per_epoch
    assert not list(out.glob("**/*.tmp"))  # nothing half-written left behind

    result = finetune(resume=out)
    final = torch.load(out / CHECKPOINT, weights_only=False)
    assert result.epochs_done == 3 and final["global_step"] == 3 * steps_per_epoch
    assert [int(r["epoch"]) for r in _rows(out)] == [1, 2, 3]


def test_two_process_ddp_on_gloo(small_intel, tiny_model_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           "-m", "vit_finetune", "finetune", "--data", str(small_intel), "--pretrained", str(tiny_model_dir),
           "--output", str(out), "--epochs", "1", "--batch-size", "12", "--workers", "0", "--quiet"]
    proc = subprocess.run(cmd, env=_cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x2 processes" in proc.stdout + proc.stderr
    assert "effective batch 24 = 12 x 1 accum x 2 proc" in proc.stdout + proc.stderr
    rows = _rows(out)
    assert len(rows) == 1  # rank 0 alone writes
    # both ranks' halves (12 + 12 of 24 val images) are reduced into one accuracy: a multiple of 1/24, not 1/12
    correct = float(rows[0]["val_top1"]) * 24
    assert correct == pytest.approx(round(correct), abs=1e-3)


def test_bad_images_are_skipped_and_reported(intel_dir, tiny_model_dir, tmp_path, caplog):
    data = make_subset(intel_dir, tmp_path / "data", 12)
    good = sorted((intel_dir / "forest").iterdir())[0].read_bytes()
    (data / "forest" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (data / "forest" / "empty.jpg").write_bytes(b"")
    (data / "sea" / "notes.jpg").write_text("not an image")
    Image.open(sorted((intel_dir / "sea").iterdir())[0]).convert("CMYK").save(data / "sea" / "cmyk.jpg")
    Image.open(sorted((intel_dir / "street").iterdir())[0]).convert("L").save(data / "street" / "gray.png")
    Image.open(sorted((intel_dir / "glacier").iterdir())[0]).convert("RGBA").save(data / "glacier" / "rgba.png")
    caplog.set_level("WARNING", logger="vitft")
    result = finetune(data=str(data), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"),
                      **dict(QUICK, epochs=1, batch_size=8))
    assert result.epochs_done == 1
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "empty.jpg" in warnings and "notes.jpg" in warnings and "truncated.jpg" in warnings


def test_cli_errors_are_one_line(small_intel, tiny_model_dir, tmp_path, run):
    runner = CliRunner()
    cases = [
        (["finetune", "--data", str(tmp_path / "nope")], "does not exist"),
        (["finetune", "--data", str(small_intel), "--pretrained", str(tiny_model_dir), "--output", str(run[0])],
         "--overwrite"),
        (["finetune", "--resume", str(tmp_path)], "no last"),
        (["finetune", "--data", str(small_intel), "--pretrained", str(tiny_model_dir / "model.safetensors")],
         "--model"),
        (["finetune", "--data", str(small_intel), "--pretrained", "vit_bse_patch16_224"], "did you mean"),
        (["finetune", "--data", str(small_intel), "--model-kwargs", "patch_size"], "KEY=VALUE"),
        (["finetune", "--data", str(small_intel), "--pretrained", str(tiny_model_dir), "--output", str(small_intel),
          "--overwrite"], "not a vitft run folder"),
        (["finetune", "--resume", str(run[0]), "--recipe", str(REPO / "recipes" / "intel_cpu.yaml")], "--recipe"),
    ]
    for args, needle in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert needle in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert len(list(small_intel.rglob("*.jpg"))) == 240  # --overwrite left the data alone


def test_recipes_are_complete_configs(tmp_path):
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert {p.name for p in recipes} >= {"intel_vit_b16.yaml", "intel_cpu.yaml", "linear_probe.yaml"}
    for path in recipes:
        TrainConfig.from_dict(load_recipe(path))  # every key is an option
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 3\nlearning_rate: 0.1\n")
    with pytest.raises(VitftError, match="learning_rate"):
        TrainConfig.from_dict(load_recipe(bad))


def test_linear_probe_trains_only_the_head(small_intel, tiny_model_dir, tmp_path):
    before = create_model(f"local-dir:{tiny_model_dir}", pretrained=True).state_dict()
    out = tmp_path / "probe"
    finetune(data=str(small_intel), pretrained=str(tiny_model_dir), output=str(out), freeze_backbone=True,
             **dict(QUICK, epochs=1))
    after = create_model(f"local-dir:{out}", pretrained=True).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"head.weight", "head.bias"}


def test_distilled_deit_trains_both_heads_on_the_labels(small_intel, tmp_path, caplog):
    """No teacher: the loss is on the mean of head and head_dist (timm's train-mode output), so a linear probe
    moves both heads and nothing else; the run says so once."""
    caplog.set_level("INFO", logger="vitft")
    torch.manual_seed(0)
    model = create_model("deit_tiny_distilled_patch16_224", num_classes=len(CLASSES), **TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start = save_pretrained(model, tmp_path / "start")
    out = tmp_path / "distilled"
    finetune(data=str(small_intel), pretrained=str(start), output=str(out), freeze_backbone=True,
             max_steps_per_epoch=3, **dict(QUICK, epochs=1))
    after = create_model(f"local-dir:{out}", pretrained=True).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"head.weight", "head.bias", "head_dist.weight", "head_dist.bias"}
    notes = [r.getMessage() for r in caplog.records if "head_dist" in r.getMessage()]
    assert len(notes) == 1 and "both heads" in notes[0], notes


def test_recipe_and_flags_merge(small_intel, tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data: {small_intel}\npretrained: {tiny_model_dir}\nepochs: 5\nbatch_size: 24\n"
                      "workers: 0\nmax_steps_per_epoch: 2\nquiet: true\n")
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["finetune", "--recipe", str(recipe), "--epochs", "1", "--output", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["epochs"] == 1 and saved["batch_size"] == 24 and saved["max_steps_per_epoch"] == 2
    assert TINY["img_size"] == create_model(f"local-dir:{out}", pretrained=True).patch_embed.img_size[0]


def test_ema_mixup_accumulation_bf16_and_unfreeze_work_together(small_intel, tiny_model_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="vitft")
    result = finetune(data=str(small_intel), pretrained=str(tiny_model_dir), output=str(tmp_path / "combo"),
                      ema=True, ema_decay=0.99, mixup=0.2, cutmix=1.0, accum_steps=2, precision="bf16",
                      freeze_backbone=True, unfreeze_after=1, max_steps_per_epoch=3,
                      **dict(QUICK, epochs=2, batch_size=8))
    assert result.epochs_done == 2
    state = torch.load(tmp_path / "combo" / CHECKPOINT, weights_only=False)
    assert state["global_step"] == 6 and state["ema"] is not None
    assert any("unfreezing the backbone" in r.getMessage() for r in caplog.records)
    before = create_model(f"local-dir:{tiny_model_dir}", pretrained=True).state_dict()
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], state["model"]["blocks.0.attn.qkv.weight"])

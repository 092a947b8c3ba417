"""Fine-tuning on generated class images: run folder contents, resume, interruption, DDP, bad images, errors."""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CLASSES, TINY, invoke_cli, make_images, make_subset
from conftest import torchrun as _torchrun
from PIL import Image
from typer.testing import CliRunner

from vit_finetune import create_model, save_pretrained
from vit_finetune.cli import app
from vit_finetune.config import TrainConfig, load_recipe
from vit_finetune.data.datasets import find_dataset
from vit_finetune.data.images import load_rgb
from vit_finetune.data.transforms import build_transforms
from vit_finetune.engine.api import finetune
from vit_finetune.engine.trainer import Trainer
from vit_finetune.errors import VitftError
from vit_finetune.run_folder import CHECKPOINT, RunFolder

REPO = Path(__file__).resolve().parents[1]
# small and quick: a tiny pretrained-style checkpoint at 32 px, 2 epochs over 240 generated images
QUICK = dict(epochs=2, batch_size=24, lr=0.02, workers=0, img_size=None, warmup_epochs=0, quiet=True, device="cpu",
             precision="fp32")  # the same numbers on every CPU (auto may pick bf16)


def load_checkpoint(run_dir) -> dict:
    return RunFolder(run_dir).read_checkpoint()


def _cli_env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), NO_ALBUMENTATIONS_UPDATE="1", OMP_NUM_THREADS="1")


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _evaluate_run(run_dir: Path, data: Path, val_split: float = 0.1, seed: int = 0) -> tuple[int, int, float]:
    """(correct, images, mean cross-entropy) of the run folder's saved model on the run's validation split, run
    here: reloaded from config.json + model.safetensors, every image through the eval transform, one fp32 pass."""
    model = create_model(f"local-dir:{run_dir}", pretrained=True).eval()
    val = find_dataset(data, val_split, seed).val
    transform = build_transforms(model.pretrained_cfg, tuple(model.patch_embed.img_size), train=False)
    images = torch.stack([transform(image=load_rgb(path))["image"] for path, _ in val])
    labels = torch.tensor([label for _, label in val])
    with torch.no_grad():
        logits = model(images)
    return int((logits.argmax(1) == labels).sum()), len(val), torch.nn.functional.cross_entropy(logits, labels).item()


@pytest.fixture(scope="module")
def run(small_images, tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    result = finetune(data=str(small_images), pretrained=str(tiny_model_dir), output=str(out), **QUICK)
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


def test_best_model_reloads_with_its_validation_accuracy(run, small_images):
    run_dir, result = run
    assert create_model(f"local-dir:{run_dir}", pretrained=True).pretrained_cfg["label_names"] == CLASSES
    correct, images, loss = _evaluate_run(run_dir, small_images)
    assert images == 24 and correct / images == pytest.approx(result.best_top1, abs=1e-9)
    best = _rows(run_dir)[result.best_epoch - 1]
    # the generated classes are easy (top-1 may be 100% in every epoch): the loss tells the epochs' weights apart
    assert float(best["val_top1"]) == round(correct / images, 5)
    assert float(best["val_loss"]) == pytest.approx(loss, abs=2e-5)


def test_resume_continues_at_the_next_epoch(run, tmp_path, caplog):
    run_dir, _ = run
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(run_dir), str(copy)], check=True)
    caplog.set_level("INFO", logger="vitft")
    result = finetune(resume=copy, epochs=4)
    rows = _rows(copy)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    weights_line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert f"this run's checkpoint {copy / CHECKPOINT}" in weights_line and str(tiny_dir(run)) in weights_line
    # the schedule is stretched to the new length: epoch 3 is no longer stuck at the old run's min_lr
    assert float(rows[2]["lr"]) > 10 * float(rows[1]["lr"])
    state = torch.load(copy / CHECKPOINT, weights_only=True)
    assert state["epoch"] == 4 and result.epochs_done == 4
    assert state["global_step"] == 4 * (216 // 24)  # 216 train images, full batches only


def tiny_dir(run) -> str:
    return json.loads((run[0] / "train_config.json").read_text())["pretrained"]


def test_resume_of_a_finished_run_asks_for_more_epochs(run):
    with pytest.raises(VitftError, match="already finished 2 epochs"):
        finetune(resume=run[0])


def _interrupt_after(monkeypatch, step: int) -> None:
    """A real SIGINT to this process right after optimizer step `step`: a Ctrl-C at a known point of the run, the
    same on any machine (the trainer's handler turns it into a checkpoint and a clean stop)."""
    optimizer_step = Trainer.optimizer_step

    def step_then_interrupt(self) -> float:
        lr = optimizer_step(self)
        if self.state.global_step == step:
            os.kill(os.getpid(), signal.SIGINT)
        return lr

    monkeypatch.setattr(Trainer, "optimizer_step", step_then_interrupt)


def test_sigint_mid_epoch_then_resume_matches_an_uninterrupted_run(two_classes, tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """Ctrl-C in the middle of epoch 2 leaves a checkpoint at that step; --resume then ends where an uninterrupted
    run ends (weights and EMA), with everything random on: crops and flips, cutmix, drop path, a cosine LR."""
    options = dict(TINIEST, data=str(two_classes), pretrained=str(tiny_model_dir), val_split=0.2, epochs=2, lr=1.0,
                   ema=True, cutmix=1.0)
    steps_per_epoch = 16 // 4
    _interrupt_after(monkeypatch, steps_per_epoch + 1)
    out = tmp_path / "interrupted"
    args = [f"--{key.replace('_', '-')}={value}" for key, value in options.items() if not isinstance(value, bool)]
    result = invoke_cli("finetune", *args, "--ema", "--quiet", "--output", out)
    assert result.exit_code == 130, result.output  # interrupted: a failure to the shell, as Ctrl-C is
    assert "interrupted after 1 epoch" in result.output and f"--resume {out}" in result.output
    state = load_checkpoint(out)
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (1, 1, steps_per_epoch + 1)
    assert not list(out.glob("**/*.tmp"))  # nothing half-written left behind
    monkeypatch.undo()

    assert finetune(resume=out).epochs_done == 2
    finetune(output=str(tmp_path / "straight"), **options)
    resumed, straight = load_checkpoint(out), load_checkpoint(tmp_path / "straight")
    assert resumed["global_step"] == straight["global_step"] == 2 * steps_per_epoch
    assert [int(r["epoch"]) for r in _rows(out)] == [1, 2]
    moved = max((straight["model"][k] - state["model"][k]).abs().max() for k in state["model"])
    assert moved > 1e-3  # the three steps after the signal changed the weights: equal below is not trivial
    for part in ("model", "ema"):
        for key, value in straight[part].items():
            torch.testing.assert_close(resumed[part][key], value, atol=1e-6, rtol=0, msg=f"{part} {key}")


@pytest.mark.slow  # subprocesses (torchrun, a signal): several seconds each
def test_two_process_ddp_on_gloo_with_accumulation(small_images, tiny_model_dir, tmp_path):
    out = tmp_path / "ddp"
    proc = _torchrun("--data", str(small_images), "--pretrained", str(tiny_model_dir), "--output", str(out),
                     "--epochs", "1", "--batch-size", "6", "--accum-steps", "2", "--max-steps-per-epoch", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x2 processes" in proc.stdout + proc.stderr
    assert "effective batch 24 = 6 x 2 accum x 2 proc" in proc.stdout + proc.stderr
    rows = _rows(out)
    assert len(rows) == 1  # rank 0 alone writes
    # both ranks' halves (12 + 12 of 24 val images) are reduced into one accuracy: the saved model's own on all 24
    correct, images, loss = _evaluate_run(out, small_images)
    assert rows[0]["val_images"] == str(images) == "24"
    assert float(rows[0]["val_top1"]) == round(correct / images, 5)
    assert float(rows[0]["val_loss"]) == pytest.approx(loss, abs=2e-5)
    assert torch.load(out / CHECKPOINT, weights_only=True)["global_step"] == 4


@pytest.mark.slow  # subprocesses (torchrun, a signal): several seconds each
@pytest.mark.parametrize("batch, accum, phase", [(4, 1, ""), (2, 2, ""), (8, 1, "freeze_backbone: true\n"),
                                                 (8, 1, "train_blocks: 1\n"), (4, 1, "balance: sampler\n")],
                         ids=["batch", "accumulation", "head-phase", "partial-on-activations", "balanced-sampler"])
def test_two_processes_end_with_the_weights_of_one_with_twice_the_batch(two_classes, tiny_model_dir, tmp_path,
                                                                       batch, accum, phase):
    """DDP is one process with the global batch: rank r takes every second image of the epoch's permutation (the
    same permutation one process takes), so each step's two halves make up the one process's batch, and every image
    is augmented from its own seed wherever it is loaded. Drop path and mixup are off (each rank would draw its own).
    The head phase (a linear probe on cached features) and partial fine-tuning on cached activations (--train-blocks)
    average their gradients by hand; there each rank's batch is its whole shard (one step per epoch), so the global
    batch is again the one process's. --balance sampler: the ranks take the interleaved shards of one global
    class-balanced draw, as they take the permutation's."""
    head_phase = "freeze_backbone" in phase
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data: {two_classes}\npretrained: {tiny_model_dir}\nval_split: 0.2\nepochs: 2\nopt: sgd\n"
                      f"lr: 10\ndrop_path: 0\nwarmup_epochs: 0\naccum_steps: {accum}\n{phase}"
                      "seed: 1\nworkers: 0\ndevice: cpu\nprecision: fp32\nquiet: true\n")
    proc = _torchrun("--recipe", str(recipe), "--batch-size", str(batch), "--output", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    finetune(load_recipe(recipe), batch_size=2 * batch, output=str(tmp_path / "one"))
    two, one = load_checkpoint(tmp_path / "two"), load_checkpoint(tmp_path / "one")
    assert two["global_step"] == one["global_step"] == 2 * 16 // (2 * batch * accum)
    start = create_model(f"local-dir:{tiny_model_dir}", pretrained=True).state_dict()
    moved = max((one["model"][k] - start[k]).abs().max() for k in one["model"] if not k.startswith("head."))
    assert (moved > 1e-3) != head_phase  # the backbone trained (or stayed frozen): equal below is not trivial
    for key, value in one["model"].items():
        torch.testing.assert_close(two["model"][key], value, atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow  # subprocesses (torchrun, a signal): several seconds each
def test_ddp_with_fewer_validation_images_than_processes(tiny_model_dir, tmp_path):
    data = make_images(tmp_path / "data" / "train", {"buildings": 8, "forest": 8})
    make_images(tmp_path / "data" / "val", {"forest": 1})
    out = tmp_path / "ddp"
    proc = _torchrun("--data", str(data.parent), "--pretrained", str(tiny_model_dir), "--output", str(out),
                     "--epochs", "1", "--batch-size", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _rows(out)[0]["val_images"] == "1"  # rank 1 had none and validated nothing


def test_bad_images_are_skipped_and_reported(class_images, tiny_model_dir, tmp_path, caplog):
    data = make_subset(class_images, tmp_path / "data", 12)
    good = sorted((class_images / "forest").iterdir())[0].read_bytes()
    (data / "forest" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (data / "forest" / "empty.jpg").write_bytes(b"")
    (data / "sea" / "notes.jpg").write_text("not an image")
    Image.open(sorted((class_images / "sea").iterdir())[0]).convert("CMYK").save(data / "sea" / "cmyk.jpg")
    Image.open(sorted((class_images / "street").iterdir())[0]).convert("L").save(data / "street" / "gray.png")
    Image.open(sorted((class_images / "glacier").iterdir())[0]).convert("RGBA").save(data / "glacier" / "rgba.png")
    caplog.set_level("WARNING", logger="vitft")
    result = finetune(data=str(data), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"),
                      **dict(QUICK, epochs=1, batch_size=8))
    assert result.epochs_done == 1
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "empty.jpg" in warnings and "notes.jpg" in warnings and "truncated.jpg" in warnings


def test_cli_errors_are_one_line(small_images, tiny_model_dir, tmp_path, run):
    runner = CliRunner()
    cases = [
        (["finetune", "--data", str(tmp_path / "nope")], "does not exist"),
        (["finetune", "--data", str(small_images), "--pretrained", str(tiny_model_dir), "--output", str(run[0])],
         "--overwrite"),
        (["finetune", "--resume", str(tmp_path)], "no last"),
        (["finetune", "--data", str(small_images), "--pretrained", str(tiny_model_dir / "model.safetensors")],
         "--model"),
        (["finetune", "--data", str(small_images), "--pretrained", "vit_bse_patch16_224"], "did you mean"),
        (["finetune", "--data", str(small_images), "--model-kwargs", "patch_size"], "KEY=VALUE"),
        (["finetune", "--data", str(small_images), "--pretrained", str(tiny_model_dir), "--output", str(small_images),
          "--overwrite"], "is inside --data"),
        (["finetune", "--resume", str(run[0]), "--recipe", str(REPO / "recipes" / "intel_cpu.yaml")], "--recipe"),
    ]
    for args, needle in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert needle in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert len(list(small_images.rglob("*.jpg"))) == 240  # --overwrite left the data alone


def test_recipes_are_complete_configs(tmp_path):
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert {p.name for p in recipes} >= {"intel_vit_b16.yaml", "intel_cpu.yaml", "linear_probe.yaml"}
    for path in recipes:
        TrainConfig.from_dict(load_recipe(path))  # every key is an option
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 3\nlearning_rate: 0.1\n")
    with pytest.raises(VitftError, match="learning_rate"):
        TrainConfig.from_dict(load_recipe(bad))


def test_linear_probe_trains_only_the_head(small_images, tiny_model_dir, tmp_path):
    before = create_model(f"local-dir:{tiny_model_dir}", pretrained=True).state_dict()
    out = tmp_path / "probe"
    finetune(data=str(small_images), pretrained=str(tiny_model_dir), output=str(out), freeze_backbone=True,
             **dict(QUICK, epochs=1))
    after = create_model(f"local-dir:{out}", pretrained=True).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"head.weight", "head.bias"}


def test_distilled_deit_trains_both_heads_on_the_labels(small_images, tmp_path, caplog):
    """No teacher: the loss is on the mean of head and head_dist (timm's train-mode output), so a linear probe
    moves both heads and nothing else; the run says so once."""
    caplog.set_level("INFO", logger="vitft")
    torch.manual_seed(0)
    model = create_model("deit_tiny_distilled_patch16_224", num_classes=len(CLASSES), **TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start = save_pretrained(model, tmp_path / "start")
    out = tmp_path / "distilled"
    finetune(data=str(small_images), pretrained=str(start), output=str(out), freeze_backbone=True,
             max_steps_per_epoch=3, **dict(QUICK, epochs=1))
    after = create_model(f"local-dir:{out}", pretrained=True).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"head.weight", "head.bias", "head_dist.weight", "head_dist.bias"}
    notes = [r.getMessage() for r in caplog.records if "head_dist" in r.getMessage()]
    assert len(notes) == 1 and "both heads" in notes[0], notes


def test_recipe_and_flags_merge(small_images, tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data: {small_images}\npretrained: {tiny_model_dir}\nepochs: 5\nbatch_size: 24\n"
                      "workers: 0\nmax_steps_per_epoch: 2\nquiet: true\ndevice: cpu\n")
    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["finetune", "--recipe", str(recipe), "--epochs", "1", "--output", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["epochs"] == 1 and saved["batch_size"] == 24 and saved["max_steps_per_epoch"] == 2
    assert TINY["img_size"] == create_model(f"local-dir:{out}", pretrained=True).patch_embed.img_size[0]


def _ema_decay(step: int, decay: float) -> float:
    """timm's ModelEmaV3 decay with warmup at optimizer step `step`: 0 (a copy) at step 1, then rising to `decay`."""
    return 0.0 if step <= 1 else min(decay, 1 - step ** (-2 / 3))


def test_ema_mixup_accumulation_bf16_and_unfreeze_work_together(small_images, tiny_model_dir, tmp_path, caplog):
    """Each feature does its part in the combined run: the head phase leaves the backbone as it was, the LR schedule
    starts over when the backbone thaws, the forward passes run in bf16 on mixed (soft) targets, and the EMA follows
    its recurrence after every optimizer step (two micro-batches each)."""
    caplog.set_level("INFO", logger="vitft")
    cfg = TrainConfig(data=str(small_images), pretrained=str(tiny_model_dir), output=str(tmp_path / "combo"),
                      ema=True, ema_decay=0.99, mixup=0.2, cutmix=1.0, accum_steps=2,
                      freeze_backbone=True, unfreeze_after=1, max_steps_per_epoch=3,
                      **dict(QUICK, epochs=2, batch_size=8, precision="bf16"))
    trainer = Trainer(cfg, tmp_path / "combo")
    model, ema = trainer.model, trainer.ema.module
    steps = []  # per optimizer step: (global step, its LR, the model's weights after it, the EMA's before and after)
    optimizer_step, loss_fn, losses = trainer.optimizer_step, trainer.train_loss_fn, []

    def recorded_step() -> float:
        lr, ema_before = trainer.optimizer.param_groups[-1]["lr"], _copy(ema.state_dict())
        next_lr = optimizer_step()
        steps.append((trainer.state.global_step, lr, _copy(model.state_dict()), ema_before, _copy(ema.state_dict())))
        return next_lr

    def recorded_loss(logits, targets):
        losses.append((logits.dtype, targets.detach().clone()))
        return loss_fn(logits, targets)

    trainer.optimizer_step, trainer.train_loss_fn = recorded_step, recorded_loss
    start = _copy(model.state_dict())
    with _quiet_progress() as progress:
        assert trainer.run(progress).epochs_done == 2
    assert [step for step, *_ in steps] == [1, 2, 3, 4, 5, 6]
    assert any("unfreezing the backbone" in r.getMessage() for r in caplog.records)
    backbone = "blocks.0.attn.qkv.weight"
    assert all(torch.equal(after[backbone], start[backbone]) for _, _, after, _, _ in steps[:3])  # head phase
    assert not torch.equal(steps[0][2]["head.weight"], start["head.weight"])
    assert (steps[-1][2][backbone] - start[backbone]).abs().max() > 1e-4  # thawed
    lrs = [lr for _, lr, *_ in steps]
    assert lrs[0] > lrs[1] > lrs[2] and lrs[3] > lrs[4]  # a cosine each phase, from the phase's own LR
    assert lrs[0] == pytest.approx(trainer.head_lr) and lrs[3] == pytest.approx(trainer.lr)
    # the fine-tuning epoch: 3 steps x 2 micro-batches, bf16 logits, soft targets that mix two images' labels
    assert [dtype for dtype, _ in losses] == [torch.bfloat16] * 6
    targets = torch.cat([t for _, t in losses])
    assert targets.shape == (48, 6) and torch.allclose(targets.sum(1), torch.ones(48))
    assert (targets.max(1).values < 0.85).any()  # label smoothing alone leaves 0.917 on the true class
    for step, _, after, ema_before, ema_after in steps:
        decay = _ema_decay(step, cfg.ema_decay)
        for key, value in ema_after.items():
            expected = decay * ema_before[key].float() + (1 - decay) * after[key].float()
            torch.testing.assert_close(value.float(), expected, atol=1e-6, rtol=1e-5, msg=f"step {step} {key}")
    assert (steps[-1][4][backbone] - steps[-1][2][backbone]).abs().max() > 1e-5  # the EMA lags the weights
    assert load_checkpoint(tmp_path / "combo")["global_step"] == 6


def _copy(state: dict) -> dict:
    return {key: value.detach().clone() for key, value in state.items()}


# ---- regression tests of issue 8 ----------------------------------------------------------------
TINIEST = dict(epochs=1, batch_size=4, lr=0.02, workers=0, warmup_epochs=0, quiet=True, device="cpu", precision="fp32")


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("two"), {"buildings": 10, "forest": 10})


def _normalize(transform) -> tuple:
    """The (mean, std) a transform normalises with, read from what it makes of a black and a white image."""
    black, white = (transform(image=np.full((40, 40, 3), v, np.uint8))["image"][:, 20, 20] for v in (0, 255))
    std = 1 / (white - black)
    return tuple(np.round((-black * std).tolist(), 4)), tuple(np.round(std.tolist(), 4))


def test_resume_builds_data_and_ema_with_the_runs_preprocessing(two_classes, tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=2, **TINY)  # the arch's default mean/std: 0.5
    model.pretrained_cfg.update(mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6))
    weights = save_pretrained(model, tmp_path / "weights")
    out = tmp_path / "run"
    finetune(data=str(two_classes), pretrained=str(weights), output=str(out), ema=True, **TINIEST)
    state = RunFolder(out).read_checkpoint()
    trainer = Trainer(TrainConfig.from_dict({**state["config"], "epochs": 2}), out, state)
    expected = ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert _normalize(trainer.train_set.transform) == expected
    assert _normalize(trainer.val_set.transform) == expected
    assert tuple(trainer.ema.module.pretrained_cfg["mean"]) == expected[0]


def test_resume_matches_an_uninterrupted_run(two_classes, tiny_model_dir, tmp_path):
    """2 epochs + a resume to 4 end where 4 epochs straight end: weights and the resumed epochs' metrics.

    Deterministic augmentation (whole square images, no flip) and a constant LR (min_lr = the scaled LR),
    so that the only state carried across the resume is the checkpoint's.
    """
    lr = 0.02 * 4 / 512  # the LR the trainer derives for a batch of 4
    options = dict(TINIEST, data=str(two_classes), pretrained=str(tiny_model_dir), min_lr=lr, scale=(1.0, 1.0),
                   ratio=(1.0, 1.0), hflip=0.0, max_steps_per_epoch=3)
    finetune(output=str(tmp_path / "a"), **dict(options, epochs=2))
    finetune(resume=tmp_path / "a", epochs=4)
    finetune(output=str(tmp_path / "b"), **dict(options, epochs=4))
    resumed, straight = RunFolder(tmp_path / "a").read_checkpoint(), RunFolder(tmp_path / "b").read_checkpoint()
    assert resumed["global_step"] == straight["global_step"] == 12
    for key, value in straight["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, atol=1e-6, rtol=1e-5, msg=key)
    for row_a, row_b in zip(_rows(tmp_path / "a")[2:], _rows(tmp_path / "b")[2:]):
        assert (row_a["train_loss"], row_a["val_loss"]) == (row_b["train_loss"], row_b["val_loss"])


def test_checkpoint_is_never_unpickled(two_classes, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), **TINIEST)
    torch.load(out / CHECKPOINT, weights_only=True)  # RNG states are tensors and plain values

    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    state = torch.load(out / CHECKPOINT, weights_only=True)
    state["rng"]["python"] = Payload()
    torch.save(state, out / CHECKPOINT)
    with pytest.raises(VitftError, match="never unpickled"):
        finetune(resume=out, epochs=2)
    assert not marker.exists()


def test_overwrite_checks_everything_before_replacing_the_old_run(run, two_classes, tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    old = tmp_path / "old"
    subprocess.run(["cp", "-r", str(run[0]), str(old)], check=True)
    before = sorted(p.name for p in old.iterdir())
    bad = [(dict(data=str(tmp_path / "typo")), "typo does not exist"),
           (dict(data=str(two_classes), pretrained="vit_bse_patch16_224"), "did you mean"),
           (dict(data=str(two_classes), epochs=0), "--epochs must be at least 1")]
    for options, message in bad:
        with pytest.raises(VitftError, match=message):
            finetune(output=str(old), overwrite=True, **{**TINIEST, "pretrained": str(tiny_model_dir), **options})
        assert sorted(p.name for p in old.iterdir()) == before, options

    def crash(self, progress):
        raise RuntimeError("power cut")

    monkeypatch.setattr(Trainer, "run", crash)
    with pytest.raises(RuntimeError, match="power cut"):
        finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(old), overwrite=True, **TINIEST)
    kept = list(tmp_path.glob("old.replaced-*"))
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == before  # a crash leaves the old run
    monkeypatch.undo()

    finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(old), overwrite=True, **TINIEST)
    assert json.loads((old / "train_config.json").read_text())["data"] == str(two_classes)
    assert len(list(tmp_path.glob("old.replaced-*"))) == 1  # only the crashed run's; this run's was removed


def test_one_class_is_an_error_before_training(tmp_path, tiny_model_dir):
    data = make_images(tmp_path / "data", {"forest": 10})
    with pytest.raises(VitftError, match="at least two class"):
        finetune(data=str(data), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"), val_split=0.2,
                 **TINIEST)
    assert not (tmp_path / "run").exists()


def test_default_weights_follow_the_model(two_classes, tmp_path):
    """No --pretrained: the --model's default weights (here not in an empty offline HF cache), not vit_b_16's."""
    (tmp_path / "hf").mkdir()
    env = dict(_cli_env(), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "vit_finetune", "finetune", "--data", str(two_classes), "--model",
           "vit_tiny_patch16_224", "--output", str(tmp_path / "run"), "--device", "cpu", "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    tag = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    assert f"no --pretrained given: using {tag}, the default weights of --model vit_tiny_patch16_224" in output
    assert f"timm/{tag}" in output and "not in the local HF cache" in output and "vit_b_16" not in output


def test_validation_drops_images_that_fail_to_decode(tmp_path, tiny_model_dir, caplog):
    data = tmp_path / "data"
    make_images(data / "train", {"buildings": 8, "forest": 8})
    make_images(data / "val", {"buildings": 2, "forest": 2}, seed=1)
    noise = np.random.default_rng(0).integers(0, 255, (200, 200, 3), dtype=np.uint8)
    Image.fromarray(noise).save(data / "val" / "forest" / "truncated.jpg")
    jpeg = (data / "val" / "forest" / "truncated.jpg").read_bytes()
    (data / "val" / "forest" / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])  # header fine, decode fails
    caplog.set_level("INFO", logger="vitft")
    finetune(data=str(data), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"), **TINIEST)
    assert _rows(tmp_path / "run")[0]["val_images"] == "4"  # not 5: the replacement is not counted again
    # the start-up lines say how the CPU is shared between loader workers and torch
    assert any(re.search(r"\d+ loader worker\(s\) \+ .*thread", r.getMessage()) for r in caplog.records)


def test_resume_refuses_options_that_define_the_run(run):
    changes = (("seed", 5), ("val_split", 0.3), ("img_size", 48), ("pretrained", "vit_tiny_patch16_224"),
               ("model", "vit_small_patch16_224"), ("model_kwargs", {"depth": 1}))
    for option, value in changes:
        with pytest.raises(VitftError, match=f"keeps its own --{option.replace('_', '-')}"):
            finetune(resume=run[0], epochs=3, **{option: value})
    assert RunFolder(run[0]).read_checkpoint()["epoch"] == 2  # nothing ran


def test_recipe_values_are_coerced_and_checked(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 1e-3\nepochs: '3'\nema: yes\nscale: [0.5, 1]\nlayer_decay: null\n")
    cfg = TrainConfig.from_dict(load_recipe(recipe))
    assert (cfg.lr, cfg.epochs, cfg.ema, cfg.scale, cfg.layer_decay) == (0.001, 3, True, (0.5, 1.0), None)
    cases = [({"epochs": "ten"}, "option 'epochs' must be an integer, got 'ten'"),
             ({"lr": "fast"}, "option 'lr' must be a number"),
             ({"epochs": 2.5}, "'epochs' must be an integer"),
             ({"ema": "maybe"}, "'ema' must be true or false"),
             ({"scale": 0.5}, "'scale' must be a list of 2 numbers"),
             ({"model_kwargs": "depth=6"}, "'model_kwargs' must be a mapping"),
             ({"epoch": 3}, "epoch (did you mean epochs?)")]
    for values, message in cases:
        with pytest.raises(VitftError, match=re.escape(message)) as err:
            TrainConfig.from_dict(values)
        assert "\n" not in str(err.value)


def test_max_steps_flag_and_warmup_that_covers_the_run(small_images, tiny_model_dir, tmp_path):
    out = tmp_path / "short"
    args = ["finetune", "--data", str(small_images), "--pretrained", str(tiny_model_dir), "--output", str(out),
            "--epochs", "1", "--warmup-epochs", "1", "--max-steps-per-epoch", "5", "--batch-size", "8",
            "--workers", "0", "--device", "cpu", "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "would cover most of this 1-epoch run" in result.output and "warmup 0.2 (capped from 1)" in result.output
    assert "warming up for a fifth of it instead: 0.2 epochs (1 step)" in result.output
    assert json.loads((out / "train_config.json").read_text())["max_steps_per_epoch"] == 5
    assert RunFolder(out).read_checkpoint()["global_step"] == 5


def test_from_scratch_metadata_is_honest(two_classes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kwargs = dict(TINY, depth=1)
    finetune(data=str(two_classes), pretrained="none", model="vit_tiny_patch16_224", model_kwargs=kwargs, **TINIEST)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("-vit_tiny_patch16_224-custom")  # not a stock vit_tiny_patch16_224
    cfg = json.loads((run_dir / "config.json").read_text())["pretrained_cfg"]
    assert "tag" not in cfg and "license" not in cfg and cfg["mean"] == [0.5, 0.5, 0.5]


# ---- the frozen phase on cached features (issue 10) ------------------------------------------------
def _count_backbone_images(model: torch.nn.Module) -> list[int]:
    seen = [0]
    model.patch_embed.register_forward_hook(lambda module, args, out: seen.__setitem__(0, seen[0] + len(out)))
    return seen


def test_frozen_phase_runs_the_backbone_once_and_validates_as_evaluation_does(two_classes, tiny_model_dir, tmp_path):
    cfg = TrainConfig(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(tmp_path / "probe"),
                      freeze_backbone=True, val_split=0.2, **dict(TINIEST, epochs=6))
    trainer = Trainer(cfg, tmp_path / "probe")
    seen = _count_backbone_images(trainer.model)
    with _quiet_progress() as progress:
        result = trainer.run(progress)
    assert result.epochs_done == 6
    assert seen[0] == 16 + 4  # each training and validation image went through the backbone once, not 6 times
    best = create_model(f"local-dir:{tmp_path / 'probe'}", pretrained=True)
    trainer.state.epoch = cfg.epochs  # past the frozen phase: validate() runs images through the whole model
    assert trainer.validate(best)["val_top1"] == pytest.approx(result.best_top1)
    rows = _rows(tmp_path / "probe")
    assert len(rows) == 6 and float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert torch.load(tmp_path / "probe" / CHECKPOINT, weights_only=True)["epoch"] == 6


def test_head_phase_then_fine_tuning_with_its_own_schedule(two_classes, tiny_model_dir, tmp_path):
    out = tmp_path / "lpft"
    cfg = TrainConfig(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), freeze_backbone=True,
                      unfreeze_after=3, head_lr=0.5, feature_views=2, val_split=0.2,
                      **dict(TINIEST, epochs=5, lr=0.004, warmup_epochs=1))
    trainer = Trainer(cfg, out)
    seen = _count_backbone_images(trainer.model)
    head_group = next(g for g in trainer.optimizer.param_groups if any(p is trainer.model.head.weight
                                                                         for p in g["params"]))
    scale = trainer.effective_batch / cfg.lr_base_size
    assert head_group["lr"] == pytest.approx(0.5 * scale)  # the head phase starts at head_lr, no warmup
    with _quiet_progress() as progress:
        trainer.run(progress)
    steps = trainer.steps_per_epoch
    assert seen[0] == 2 * 16 + 4 + 2 * steps * cfg.batch_size + 4 * 2  # 2 views + val once, then 2 full epochs
    trainer.scheduler.step_update(3 * steps)  # the first step after unfreezing: a fresh warmup from ~0
    assert head_group["lr"] < 1e-5
    trainer.scheduler.step_update(4 * steps)  # halfway through fine-tuning's own cosine: half its LR (above min_lr)
    peak = 0.004 * scale * head_group.get("lr_scale", 1.0)
    assert head_group["lr"] == pytest.approx(cfg.min_lr + 0.5 * (peak - cfg.min_lr))
    assert any("head phase, epochs 1-3" in line and "2 augmented views" in line for line in trainer.describe())
    # resumable: more epochs continue from the checkpoint written when the head phase ended
    result = finetune(resume=str(out), epochs=6)
    assert result.epochs_done == 6 and len(_rows(out)) == 6


def test_feature_set_batches_and_views():
    from vit_finetune.engine.features import FeatureSet

    features = FeatureSet(torch.arange(10.0)[:, None], torch.arange(10), view_sizes=[6, 4])
    assert features.view(1).labels.tolist() == [6, 7, 8, 9] and features.view(2).labels.tolist() == list(range(6))
    steps = list(features.view(0).batches(4, torch.Generator().manual_seed(0), steps=3))
    assert [len(y) for _, y in steps] == [4, 4, 4]  # exactly `steps` full batches: the order starts over
    assert sorted(torch.cat([y for _, y in steps])[:6].tolist()) == list(range(6))
    assert [y.tolist() for _, y in features.batches(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.slow  # subprocesses (torchrun, a signal): several seconds each
def test_two_process_ddp_trains_the_head_on_cached_features(two_classes, tiny_model_dir, tmp_path):
    out = tmp_path / "ddp-probe"
    proc = _torchrun("--data", str(two_classes), "--pretrained", str(tiny_model_dir), "--output", str(out),
                     "--val-split", "0.2", "--epochs", "3", "--batch-size", "4", "--freeze-backbone",
                     "--unfreeze-after", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    output = proc.stdout + proc.stderr
    assert "pooled features of 20 images" in output  # 16 + 4, split over the two ranks
    assert output.count("unfreezing the backbone") == 1 and output.count("epochs done") == 1  # rank 0 alone
    rows = _rows(out)
    assert [r["val_images"] for r in rows] == ["4", "4", "4"]


def _quiet_progress():
    from vit_finetune.progress import ProgressBar

    return ProgressBar(enabled=False)


def test_head_phase_checkpoints_at_most_once_a_minute_and_at_its_end(two_classes, tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    from vit_finetune.engine import phases

    saved = []
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda self: saved.append(self.state.epoch))
    cfg = TrainConfig(data=str(two_classes), pretrained=str(tiny_model_dir), freeze_backbone=True, val_split=0.2,
                      **dict(TINIEST, epochs=4))
    with _quiet_progress() as progress:
        Trainer(cfg, tmp_path / "a").run(progress)
    assert saved == [4]  # epochs of a second or less: only the last one is checkpointed
    saved.clear()
    monkeypatch.setattr(phases, "CHECKPOINT_INTERVAL_S", -1)  # as if each epoch took over a minute
    with _quiet_progress() as progress:
        Trainer(cfg, tmp_path / "b").run(progress)
    assert saved == [1, 2, 3, 4]

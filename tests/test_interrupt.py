"""A run's long passes besides the training steps: a signal ends any of them (decode cache, feature pass,
validation) with a checkpoint that --resume continues; --max-steps-per-epoch bounds the feature pass; off a
terminal each pass logs its progress; the head phase's defaults learn; validation is `evaluate`'s computation."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import make_images

import vit_finetune as vf
from vit_finetune import progress as progress_module
from vit_finetune.data.loaders import ImageDataset
from vit_finetune.engine import phases
from vit_finetune.engine.api import finetune
from vit_finetune.progress import ProgressBar, format_rate
from vit_finetune.run_folder import RunFolder

FAST = dict(epochs=2, batch_size=4, lr=0.02, workers=0, warmup_epochs=0, quiet=True, device="cpu", precision="fp32",
            val_split=0.2)


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory) -> Path:
    """64 px images: larger than the cache keeps for a 32 px model (41 px), so a cached decode differs."""
    return make_images(tmp_path_factory.mktemp("two"), {"buildings": 12, "forest": 12}, size=64)


def _signal_on_first_call(fn, sig=signal.SIGTERM):
    """fn(done, total) that sends `sig` to this process on its first call (after the first batch or image)."""
    calls = []

    def progress(done: int, total: int) -> None:
        if not calls:
            os.kill(os.getpid(), sig)
        calls.append((done, total))
        if fn is not None:
            fn(done, total)

    return progress, calls


def _assert_checkpoint_at_step_0_then_resume(out: Path, result) -> None:
    assert result.interrupted and result.epochs_done == 0
    state = RunFolder(out).read_checkpoint()
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (0, 0, 0)
    resumed = finetune(resume=out)
    assert resumed.epochs_done == 2 and not resumed.interrupted
    assert RunFolder(out).read_checkpoint()["global_step"] == 2 * (20 // 4)


def test_sigterm_in_the_feature_pass_stops_within_a_batch_and_resumes(two_classes, tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    extract, calls = phases.extract_features, []

    def extract_then_signal(model, loader, device, precision, views=1, progress=None, check_stop=None, *rest):
        if calls:  # one signal: a second one would give up at once (KeyboardInterrupt)
            calls.append([])
            return extract(model, loader, device, precision, views, progress, check_stop, *rest)
        signalling, seen = _signal_on_first_call(progress)
        calls.append(seen)
        return extract(model, loader, device, precision, views, signalling, check_stop, *rest)

    monkeypatch.setattr(phases, "extract_features", extract_then_signal)
    out = tmp_path / "features"
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), freeze_backbone=True,
                      **FAST)
    assert [len(seen) for seen in calls] == [1]  # one batch of the training images, then the stop
    monkeypatch.undo()
    _assert_checkpoint_at_step_0_then_resume(out, result)


def test_sigint_while_caching_the_images_stops_and_resumes(two_classes, tiny_model_dir, tmp_path, monkeypatch):
    fill, calls = ImageDataset.fill_cache, []

    def fill_then_signal(self, progress=None, should_stop=None):
        signalling, seen = _signal_on_first_call(progress, signal.SIGINT)
        calls.append(seen)
        return fill(self, signalling, should_stop)

    monkeypatch.setattr(ImageDataset, "fill_cache", fill_then_signal)
    out = tmp_path / "cache"
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), cache=True, **FAST)
    assert len(calls[0]) < 20  # abandoned: not every training image was decoded into the cache
    monkeypatch.undo()
    _assert_checkpoint_at_step_0_then_resume(out, result)


def test_sigterm_during_validation_checkpoints_the_trained_epoch(two_classes, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    image_logits = phases.image_logits

    def logits_then_signal(trainer, model):
        for i, batch in enumerate(image_logits(trainer, model)):
            if i == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    monkeypatch.setattr(phases, "image_logits", logits_then_signal)
    out = tmp_path / "validation"
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), **FAST)
    monkeypatch.undo()
    assert result.interrupted and result.epochs_done == 0
    state = RunFolder(out).read_checkpoint()
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (0, 5, 5)  # trained, not validated
    assert finetune(resume=out).epochs_done == 2
    assert RunFolder(out).read_checkpoint()["global_step"] == 10


def test_max_steps_per_epoch_bounds_the_feature_pass(two_classes, tiny_model_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="vitft")
    seen = []
    extract = phases.extract_features

    def counting(model, loader, *args, **kwargs):
        features = extract(model, loader, *args, **kwargs)
        seen.append(len(features))
        return features

    phases.extract_features = counting
    try:
        result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(tmp_path / "capped"),
                          freeze_backbone=True, max_steps_per_epoch=2, **FAST)
    finally:
        phases.extract_features = extract
    assert result.epochs_done == 2
    assert seen == [2 * 4, 4]  # the 8 training images two steps of 4 use, and every validation image
    assert "features for 8 of 20 training images (--max-steps-per-epoch 2" in caplog.text


def test_progress_off_a_terminal_logs_a_line_per_interval(caplog):
    caplog.set_level("INFO", logger="vitft")
    now = [0.0]
    bar = ProgressBar(interval=30, clock=lambda: now[0])
    with bar:
        task = bar.add_task("pooled features", total=1000, unit=" images")
        now[0] = 10
        bar.update(task, completed=50)
        assert "pooled features" not in caplog.text  # not yet 30 s
        now[0] = 40
        bar.update(task, completed=200)
        now[0] = 50
        bar.update(task, completed=250)
        bar.remove_task(task)
    lines = [r.getMessage() for r in caplog.records if "pooled features" in r.getMessage()]
    assert lines == ["pooled features: 200/1000 images, 5.0 images/s, 2m40s left"]
    assert (format_rate(0.44), format_rate(9.96), format_rate(12.3)) == ("0.4", "10.0", "12")  # one decimal under 10


def test_every_long_pass_of_a_run_reports_off_a_terminal(two_classes, tiny_model_dir, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="vitft")
    monkeypatch.setattr(progress_module, "LINE_INTERVAL_S", 0)  # a line at every update
    finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(tmp_path / "lines"), cache=True,
             freeze_backbone=True, unfreeze_after=1, **dict(FAST, quiet=False))
    text = caplog.text
    for line in ("decoding the training images (--cache): 20/20 images", "pooled features: 24/24 images",
                 "epoch 1/2: 5/5 steps", "epoch 2/2: 5/5 steps", "validation: 4/4 images"):
        assert line in text


def test_head_phase_defaults_learn_and_few_steps_are_reported(tmp_path, tiny_model_dir, caplog):
    """3 classes x 30 images, a frozen random backbone: the default head LR learns the colours; the old default
    (the fine-tuning --lr) stayed at chance. One step per epoch is reported."""
    data = make_images(tmp_path / "three", {"a": 30, "b": 30, "c": 30})
    options = dict(data=str(data), pretrained=str(tiny_model_dir), freeze_backbone=True, epochs=10, batch_size=8,
                   workers=0, quiet=True, device="cpu", precision="fp32", val_split=0.2)
    result = finetune(output=str(tmp_path / "probe"), **options)
    assert result.best_top1 > 0.8
    caplog.set_level("WARNING", logger="vitft")
    finetune(output=str(tmp_path / "few"), **dict(options, batch_size=64, epochs=2))
    assert "only 1 optimizer step per epoch (2 in all) with the backbone frozen" in caplog.text


def test_validation_with_cache_agrees_with_evaluate_exactly(two_classes, tiny_model_dir, tmp_path):
    out = tmp_path / "cached"
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), cache=True, **FAST)
    report = vf.evaluate(str(out), data=str(two_classes), output=None, device="cpu", precision="fp32")
    assert report.num_images == 4
    assert report.accuracy == result.best_top1
    best = next(row for row in result.metrics if row["epoch"] == result.best_epoch)
    assert report.loss == pytest.approx(best["val_loss"], abs=1e-5)  # val_loss is rounded to 5 decimals

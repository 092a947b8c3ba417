"""--time-budget: the plan made from the first steps and said, a schedule that ends at min_lr on its last planned
step, runs that end within the budget (+5%, from the finetune call) with a head phase, on a machine that slows
down and across a resume, --epochs as the cap, and one-line errors for budgets that cannot work."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, make_images, torchrun

from vit_finetune.engine import budget as budget_module
from vit_finetune.engine.api import finetune
from vit_finetune.engine.budget import fit
from vit_finetune.engine.trainer import Trainer
from vit_finetune.errors import VitftError
from vit_finetune.run_folder import RunFolder

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MIN_LR = 1e-5
FAST = dict(batch_size=4, lr=5e-3, workers=0, warmup_epochs=1, min_lr=MIN_LR, quiet=True, device="cpu",
            precision="fp32", val_split=0.2)


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("two"), {"buildings": 30, "forest": 30}, size=32)


def _run(tmp_path, two_classes, tiny_model_dir, **options):
    """finetune's result, its run folder's metrics rows, and the seconds from the call to its return."""
    out = tmp_path / "run"
    start = time.monotonic()
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), **{**FAST, **options})
    return result, RunFolder(out).read_metrics(), time.monotonic() - start


def _assert_schedule_complete(out: Path, rows: list[dict]) -> None:
    """The run did the steps its last plan says, and the last of them left the LR at min_lr, not before."""
    state = RunFolder(out).read_checkpoint()
    assert state["global_step"] == int(rows[-1]["planned_steps"])
    assert float(rows[-1]["lr"]) == pytest.approx(MIN_LR, rel=1e-9)
    assert float(rows[-2]["lr"]) > MIN_LR * (1 + 1e-6)  # not before it


def test_fit_fills_the_time_with_full_epochs_or_fewer_shorter_ones():
    # 10 s: full epochs of 10 steps at 0.1 s + 1 s ends take 2 s each
    assert fit(10.0, 0.1, 1.0, max_epochs=3, max_steps=10) == (3, 10)  # --epochs caps what would fit (5)
    assert fit(10.0, 0.1, 1.0, max_epochs=100, max_steps=10) == (5, 10)
    assert fit(7.0, 0.1, 1.0, max_epochs=100, max_steps=10) == (4, 7)  # 3.5 full epochs: 4 of 7 steps
    assert fit(1.5, 0.1, 1.0, max_epochs=100, max_steps=10) == (1, 5)  # less than one epoch fits
    assert fit(1.5, 0.1, 1.0, max_epochs=100, max_steps=10, done=3) == (1, 8)  # 3 steps already behind
    assert fit(0.5, 0.1, 1.0, max_epochs=100, max_steps=10) is None  # not even the epoch's end fits
    # a re-fit: whole epochs (3 of the 3.5 that fit), shorter ones only when less than one fits
    assert fit(7.0, 0.1, 1.0, max_epochs=100, max_steps=10, whole_epochs=True) == (3, 10)
    assert fit(1.5, 0.1, 1.0, max_epochs=100, max_steps=10, done=3, whole_epochs=True) == (1, 8)


def test_a_budget_plans_both_phases_says_so_and_ends_in_time(two_classes, tiny_model_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="vitft")
    budget = 0.25
    result, rows, seconds = _run(tmp_path, two_classes, tiny_model_dir, time_budget=budget, epochs=200,
                                 freeze_backbone=True, unfreeze_after=20)
    assert seconds <= budget * 60 * 1.05 and not result.interrupted
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time budget: ")]
    assert "time budget: 0.25 min from the command's start" in plans[0]
    assert [("phase 1, HeadOnFeatures" in m, "phase 2, FineTuning" in m) for m in plans[1:] if "plan (" in m] == \
        [(True, False), (False, True)]
    assert all(" img/s measured" in m and " epochs x " in m and "ending at " in m for m in plans if "plan (" in m)
    assert result.epochs_done == int(rows[-1]["planned_epochs"]) < 200
    plans = RunFolder(tmp_path / "run").read_checkpoint()["budget"]["plans"]
    assert plans["0"]["end_step"] == plans["1"]["first_step"]  # the head phase's schedule ran whole, to min_lr
    _assert_schedule_complete(tmp_path / "run", rows)
    assert all(r["planned_end"].count(":") == 2 for r in rows)


def test_epochs_cap_a_budget_that_would_allow_more(two_classes, tiny_model_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="vitft")
    result, rows, seconds = _run(tmp_path / "budget", two_classes, tiny_model_dir, time_budget=5, epochs=3)
    assert result.epochs_done == 3 and seconds < 60
    assert any("(--epochs caps it)" in r.getMessage() for r in caplog.records)
    _, plain, _ = _run(tmp_path / "plain", two_classes, tiny_model_dir, epochs=3)  # the same run, unbudgeted
    assert [float(r["lr"]) for r in rows] == pytest.approx([float(r["lr"]) for r in plain], rel=1e-9)
    steps = [RunFolder(tmp_path / run / "run").read_checkpoint()["global_step"] for run in ("budget", "plain")]
    assert steps[0] == steps[1] == int(rows[-1]["planned_steps"])


def test_a_slowed_machine_replans_and_still_ends_in_time_at_min_lr(two_classes, tiny_model_dir, tmp_path,
                                                                    monkeypatch, caplog):
    caplog.set_level("INFO", logger="vitft")
    step = Trainer.optimizer_step

    def slower_after_epoch_2(self):
        if self.state.epoch >= 2:
            time.sleep(0.04)
        return step(self)

    monkeypatch.setattr(Trainer, "optimizer_step", slower_after_epoch_2)
    budget = 0.2
    result, rows, seconds = _run(tmp_path, two_classes, tiny_model_dir, time_budget=budget, epochs=500)
    assert seconds <= budget * 60 * 1.05
    assert any("slower than planned" in r.getMessage() and "re-fitted from step" in r.getMessage()
               for r in caplog.records)
    assert int(rows[-1]["planned_steps"]) < int(rows[0]["planned_steps"])
    planned = re.search(r"plan: \d+ epochs x (\d+) steps", caplog.text)
    plan = RunFolder(tmp_path / "run").read_checkpoint()["budget"]["plans"]["0"]
    assert plan["steps_per_epoch"] == int(planned[1])  # re-fits drop whole epochs, not a step of each epoch
    _assert_schedule_complete(tmp_path / "run", rows)


def test_a_resume_keeps_the_schedule_and_the_budget_left(two_classes, tiny_model_dir, tmp_path, monkeypatch):
    end = budget_module.TimeBudget.on_epoch_end

    def signal_after_epoch_2(self, trainer, row, best):
        end(self, trainer, row, best)
        if trainer.state.epoch == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(budget_module.TimeBudget, "on_epoch_end", signal_after_epoch_2)
    budget = 0.25
    out = tmp_path / "run"
    result, _, _ = _run(tmp_path, two_classes, tiny_model_dir, time_budget=budget, epochs=500)
    monkeypatch.undo()
    assert result.interrupted and result.epochs_done == 2
    folder = RunFolder(out)
    state = folder.read_checkpoint()
    before = state["budget"]["plans"]["0"]
    state["budget"]["used_s"] += 5.0  # as if the run had spent 5 s more before it stopped
    folder.write_checkpoint(state)
    used = state["budget"]["used_s"]

    start = time.monotonic()
    resumed = finetune(resume=str(out))
    seconds = time.monotonic() - start
    assert used + seconds <= budget * 60 * 1.05 and not resumed.interrupted
    after = folder.read_checkpoint()["budget"]["plans"]["0"]
    same = ("first_step", "steps", "warmup_steps", "lr")
    assert {k: after[k] for k in same} == {k: before[k] for k in same}  # the schedule it started with
    assert after["refits"][:len(before["refits"])] == before["refits"]
    assert len(after["refits"]) > len(before["refits"]) and after["end_step"] < before["end_step"]  # re-planned
    _assert_schedule_complete(out, folder.read_metrics())


@pytest.mark.parametrize("options, message", [
    (dict(time_budget=0), "--time-budget must be a positive number of minutes"),
    (dict(time_budget=-2), "--time-budget must be a positive number of minutes"),
    (dict(time_budget=1e-4), r"--time-budget 0.0001 min is too short: [\d.e-]+ s of it were used before training "
                             "could "
                              "start; give it more minutes"),
    (dict(time_budget=1, budget_head_share=1.5), "budget_head_share must be between 0 and 1"),
])
def test_budgets_that_cannot_work_are_one_line_errors(two_classes, tiny_model_dir, tmp_path, options, message):
    with pytest.raises(VitftError, match=message):
        _run(tmp_path, two_classes, tiny_model_dir, epochs=3, **options)


def test_a_budget_spent_after_the_first_steps_says_how_much_is_needed(two_classes, tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(budget_module, "SAVE_S", 60.0)  # an epoch end that takes a minute: nothing fits
    with pytest.raises(VitftError, match=r"--time-budget 0.5 min is too short: [\d.]+ s went to setting up and the "
                                         r"first \d+ step\(s\), .* give it at least [\d.]+ min"):
        _run(tmp_path, two_classes, tiny_model_dir, epochs=3, time_budget=0.5)


def test_a_feature_pass_that_cannot_fit_stops_early_with_what_it_needs(two_classes, tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    """The head phase's one pass over the images is projected once it has run a while: a pass that would end past
    the budget stops then with a one-line error (it used to run on, 2.5x past the budget, then fail)."""
    from vit_finetune.engine.features import extract_features as slow

    monkeypatch.setattr(budget_module, "PASS_CHECK_S", 0.5)

    def slow_extract(model, loader, device, precision, views, progress, check_stop, encode=None, into=None):
        def slow_encode(images):  # a machine where the pass takes ~0.4 s an image
            time.sleep(0.4 * len(images))
            return model.pool(model.forward_features(images))
        return slow(model, loader, device, precision, views, progress, check_stop, slow_encode, into)

    monkeypatch.setattr("vit_finetune.engine.phases.extract_features", slow_extract)
    start = time.monotonic()
    with pytest.raises(VitftError, match=r"--time-budget 0.2 min is too short: the pooled features pass alone would "
                                         r"end [\d.]+ min into the run \([\d.]+ img/s for 60 images on this machine\); "
                                         r"give it at least \d+ min"):
        _run(tmp_path, two_classes, tiny_model_dir, epochs=3, time_budget=0.2, freeze_backbone=True, batch_size=2)
    assert time.monotonic() - start < 0.2 * 60  # stopped before the budget, not after overrunning it


def test_a_budget_covers_the_activation_cache_and_both_phases_of_partial_fine_tuning(two_classes, tiny_model_dir,
                                                                                    tmp_path, caplog):
    """A head phase whose share of the budget holds less than an epoch end still takes its one epoch when the
    budget holds it (it was an error saying to give more minutes than were given); the partial phase after it
    caches its activations and trains within the rest, its schedule ending at min_lr on its last step."""
    caplog.set_level("INFO", logger="vitft")
    budget = 0.25
    result, rows, seconds = _run(tmp_path, two_classes, tiny_model_dir, time_budget=budget, epochs=200,
                                 freeze_backbone=True, unfreeze_after=20, train_blocks=1, budget_head_share=0.005)
    assert seconds <= budget * 60 * 1.05 and not result.interrupted
    assert "activations of 60 images" in caplog.text  # the partial phase's cache, within the budget
    plans = RunFolder(tmp_path / "run").read_checkpoint()["budget"]["plans"]
    assert plans["0"]["epochs"] == 1 and plans["0"]["end_step"] == plans["1"]["first_step"]
    assert result.epochs_done == int(rows[-1]["planned_epochs"]) >= 2
    _assert_schedule_complete(tmp_path / "run", rows)


def test_a_budget_given_to_the_resume_of_a_run_without_one_plans_the_epochs_left(two_classes, tiny_model_dir,
                                                                                 tmp_path):
    """The plan starts at the resumed epoch: its schedule ends at min_lr on the run's last step (it planned all
    of --epochs again from there, and the run ended mid-cosine)."""
    _run(tmp_path, two_classes, tiny_model_dir, epochs=2)
    resumed = finetune(resume=str(tmp_path / "run"), epochs=5, time_budget=2)
    rows = RunFolder(tmp_path / "run").read_metrics()
    assert resumed.epochs_done == 5 and int(rows[-1]["planned_epochs"]) == 5
    _assert_schedule_complete(tmp_path / "run", rows)


def test_a_torchrun_worker_counts_the_budget_from_the_launcher_start():
    """A worker's command age is its launcher's (torchrun's), whose start-up before the workers (seconds of
    imports) is part of the command; a plain process counts from its own start."""
    worker = "import time; from vit_finetune.cli import command_age; print(command_age())"
    launcher = (f"import os, subprocess, sys, time; time.sleep(1.5); env = dict(os.environ, **{{sys.argv[1]: '1'}}); "
                f"print(subprocess.run([sys.executable, '-c', {worker!r}], env=env, capture_output=True, text=True, "
                "check=True).stdout)")
    ages = [float(subprocess.run([sys.executable, "-c", launcher, name], env=dict(os.environ, PYTHONPATH=str(REPO)),
                                 capture_output=True, text=True, timeout=120, check=True).stdout)
            for name in ("TORCHELASTIC_RUN_ID", "NOT_TORCHRUN")]
    assert ages[0] >= 1.5 > ages[1]


@pytest.mark.slow  # torchrun: seconds of start-up
def test_ddp_ranks_follow_one_budget_through_both_phases(two_classes, tiny_model_dir, tmp_path):
    """Two processes with a head phase then partial fine-tuning: rank 0 plans, rank 1 follows (a rank that
    decided alone would wait on the other for ever: the subprocess timeout ends it); the run ends within the
    budget (+ torchrun's teardown after the workers end), at min_lr."""
    out, budget = tmp_path / "run", 0.75
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data: {two_classes}\npretrained: {tiny_model_dir}\nlr: 0.005\nmin_lr: {MIN_LR}\n"
                      "val_split: 0.2\n")
    start = time.monotonic()
    proc = torchrun("--recipe", str(recipe), "--output", str(out), "--epochs", "200", "--freeze-backbone",
                    "--unfreeze-after", "20", "--train-blocks", "1", "--time-budget", str(budget), "--batch-size", "4",
                    timeout=budget * 60 * 3)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = RunFolder(out)
    state = folder.read_checkpoint()
    assert state["budget"]["used_s"] <= budget * 60  # the workers' part, torchrun's start-up included
    assert seconds <= budget * 60 * 1.05 + 10  # torchrun's teardown: seconds on a busy 2-core machine
    assert sorted(state["budget"]["plans"]) == ["0", "1"]
    _assert_schedule_complete(out, folder.read_metrics())

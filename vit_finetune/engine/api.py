"""`finetune`: the one entry point of training, for Python and the command line alike (`vitft finetune` only
parses its flags and prints the result). Everything is checked before an existing run folder is replaced."""
from __future__ import annotations

import logging
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from ..config import TrainConfig, load_recipe
from ..data.balance import check_balance, imbalance_warnings
from ..errors import VitftError
from ..progress import ProgressBar
from ..run_folder import RunFolder
from .budget import planned_epochs
from .callbacks import trackers
from .distributed import is_main_process, leave
from .loop import StopFlag
from .model_setup import check_lora, default_pretrained
from .trainer import RunResult, Trainer

log = logging.getLogger("vitft")

# options that define a run: a resume that changed them would re-split the data or ignore them
_RUN_DEFINING = ("seed", "val_split", "img_size", "pretrained", "model", "model_kwargs", "lora", "lora_targets",
                 "lora_method", "lora_alpha", "lora_dropout",  # a resume rebuilds the adapter from the checkpoint's
                 "data_config", "data_revision", "streaming")  # other data, or epochs cut from it otherwise


def finetune(config: TrainConfig | dict | None = None, resume: Optional[str | Path] = None,
             recipe: Optional[str | Path] = None, started: Optional[float] = None, **options: Any) -> RunResult:
    """Fine-tune (or train) a ViT on an image folder; returns where the run is and how it went.

    `finetune(data="./intel", pretrained="vit_b_16", epochs=5)`, `finetune(recipe="recipes/x.yaml", epochs=3)`
    (the options given override the recipe's; model_kwargs are merged key by key) or `finetune(resume="runs/x")`.
    Everything is checked (data, model, options, Hub token) before an existing run folder is replaced.
    `started`: when the command started (time.monotonic()), which a --time-budget counts from; default: now.
    """
    started = time.monotonic() if started is None else started
    if resume is not None:
        if recipe is not None:
            raise VitftError("--recipe is for new runs; with --resume, pass changed options as flags")
        folder = RunFolder(resume)
        state = folder.read_checkpoint()
        cfg = _resume_config(state, options)
        planned = planned_epochs(state)  # what a --time-budget planned, else None
        if state["epoch"] >= (planned or cfg.epochs):
            done = f"{state['epoch']} epoch{'s' if state['epoch'] != 1 else ''}"
            how = "the plan of its --time-budget is complete: start a new run to train longer" if planned else \
                "raise --epochs to train longer"
            raise VitftError(f"{folder.path} already finished {done}; {how}")
    else:
        state = None
        cfg = new_run_config(config, recipe, options)
        folder = RunFolder(cfg.output if cfg.output else default_run_dir(cfg))
        if is_main_process():  # rank 0 alone checks and replaces the folder
            folder.check_new(cfg.overwrite, cfg.data)
    check_config(cfg)
    if cfg.push_to_hub:
        from ..hub.push import resolve_token

        resolve_token()  # no token: fail now, not after hours of training
    # the signal handler and the progress bar come first: a signal while the data is scanned or cached stops the
    # run too (checkpointed at step 0), and a long cache fill shows its progress
    with StopFlag() as stop_flag, ProgressBar(enabled=not cfg.quiet and is_main_process()) as progress:
        trainer = Trainer(cfg, folder.path, state, stop_flag, progress, started)
        replaced = None
        if trainer.ddp.main:
            replaced = folder.start() if state is None else None
            folder.write_train_config(cfg.to_dict())
            for line in trainer.describe():
                log.info(line)
            for line in imbalance_warnings(trainer.splits.class_counts().get("train", {}), cfg.balance,
                                           trainer.multi_label):
                log.warning(line)
            if state is not None:
                log.info("resuming %s at epoch %d, step %d", folder.path, trainer.state.epoch + 1,
                         trainer.state.step_in_epoch)
        try:
            result = trainer.run(progress)
        except BaseException:
            if replaced is not None:
                log.warning("the run this one was replacing is kept in %s", replaced)
            raise
    if replaced is not None:
        shutil.rmtree(replaced)
    if trainer.ddp.main and not result.interrupted and cfg.push_to_hub:
        from ..hub.push import push_run

        push_run(folder.path, cfg.push_to_hub)
    leave(trainer.ddp)
    return result


def new_run_config(config: TrainConfig | dict | None, recipe: Optional[str | Path], options: dict) -> TrainConfig:
    """The options of a new run: the recipe's, then `config`'s, then `options` (model_kwargs merged key by key),
    with the default weights filled in."""
    values = load_recipe(recipe) if recipe is not None else {}
    for layer in (config.to_dict() if isinstance(config, TrainConfig) else dict(config or {}), options):
        kwargs = {**values.get("model_kwargs", {}), **layer.get("model_kwargs", {})}
        values.update(layer)
        if kwargs:
            values["model_kwargs"] = kwargs
    cfg = TrainConfig.from_dict(values)
    if not cfg.data:
        raise VitftError("no data: pass --data DIR (a folder of class folders, train/val, or the Intel layout)")
    if cfg.pretrained is None:
        cfg.pretrained = default_pretrained(cfg.model)
        if is_main_process():
            log.info("no --pretrained given: using %s, %s", cfg.pretrained,
                     f"the default weights of --model {cfg.model}" if cfg.model else "the default")
    return cfg


def default_run_dir(cfg: TrainConfig) -> Path:
    """runs/<date>-<model>, plus the overridden model args (or 'custom' when they are many): the name must not
    claim a stock architecture for a model with other depth, patch or input size."""
    name = Path((cfg.model or cfg.pretrained or "vit").replace("/", "_").replace(":", "_")).name
    overrides = {k: v for k, v in cfg.model_kwargs.items() if k != "num_classes"}
    if cfg.img_size:
        overrides["img_size"] = cfg.img_size
    if overrides:
        suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        plain = len(suffix) <= 40 and all(isinstance(v, (int, float, str)) for v in overrides.values())
        name += "-" + (suffix.replace("/", "_") if plain else "custom")
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{name}"


def _resume_config(state: dict, options: dict) -> TrainConfig:
    saved = TrainConfig.from_dict(state["config"])
    cfg = TrainConfig.from_dict({**state["config"], **options})
    changed = [k for k in _RUN_DEFINING if getattr(cfg, k) != getattr(saved, k)]
    if changed:
        was = ", ".join(f"--{k.replace('_', '-')} {getattr(saved, k)!r} (not {getattr(cfg, k)!r})" for k in changed)
        raise VitftError(f"a resumed run keeps its own {was}: drop those options, or start a new run to change them")
    return cfg


def check_config(cfg: TrainConfig) -> None:
    checks = [
        (cfg.epochs >= 1, "--epochs must be at least 1"),
        (cfg.batch_size >= 1, "--batch-size must be at least 1"),
        (cfg.accum_steps >= 1, "--accum-steps must be at least 1"),
        (cfg.lr > 0, "--lr must be positive"),
        (cfg.unfreeze_after is None or cfg.freeze_backbone, "--unfreeze-after needs --freeze-backbone"),
        (cfg.unfreeze_after is None or 0 < cfg.unfreeze_after < cfg.epochs,
         f"--unfreeze-after must be between 1 and --epochs - 1 ({cfg.epochs - 1}), got {cfg.unfreeze_after}"),
        (cfg.feature_views >= 0, "--feature-views must be 0 (no cached features) or more"),
        (cfg.train_blocks is None or cfg.train_blocks >= 0, "--train-blocks must be 0 (the head alone) or more"),
        (cfg.train_blocks is None or not cfg.freeze_backbone or cfg.unfreeze_after is not None,
         "--train-blocks with --freeze-backbone needs --unfreeze-after K: the head trains alone until epoch K, "
         "then the top blocks"),
        (cfg.train_blocks != 0 or cfg.unfreeze_after is None,
         "--train-blocks 0 trains the head alone, so nothing unfreezes; drop --unfreeze-after, or train 1 or more "
         "blocks"),
        (cfg.head_lr is None or cfg.head_lr > 0, "--head-lr must be positive"),
        (not (cfg.mixup or cfg.cutmix) or cfg.batch_size % 2 == 0, "mixup/cutmix need an even --batch-size"),
        (cfg.patience is None or cfg.patience >= 1, "--patience must be at least 1 epoch"),
        (cfg.time_budget is None or cfg.time_budget > 0, "--time-budget must be a positive number of minutes"),
        (cfg.budget_head_share is None or 0 < cfg.budget_head_share < 1,
         f"budget_head_share must be between 0 and 1 (a fraction of --time-budget), got {cfg.budget_head_share}"),
    ]
    for ok, message in checks:
        if not ok:
            raise VitftError(message)
    trackers(cfg)  # an unknown --log-with name is an error now, not at the first epoch
    check_lora(cfg)
    check_balance(cfg.balance)

"""The start-up lines of a run: where the weights came from, the data, the device and precision, the optimisation
and the head phase, said once before training starts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..weights.loading import describe_weights

if TYPE_CHECKING:
    from .trainer import Trainer


def startup_lines(trainer: Trainer) -> list[str]:
    """The start-up lines: weights, data, device, optimisation, and the head phase."""
    cfg = trainer.cfg
    counts = trainer.splits.class_counts()
    per_class = ", ".join(f"{c} {counts['train'].get(c, 0)}/{counts['val'].get(c, 0)}" for c in trainer.classes)
    weights = describe_weights(trainer.model)
    if trainer.resumed:  # the first line names the run's checkpoint, not the weights it started from
        weights[0] = (f"weights: this run's checkpoint {trainer.folder.checkpoint_file} (the run started from "
                      f"{trainer.model.pretrained_cfg.get('source')})")
    warmup = f"{trainer.warmup_epochs:.3g}" + (f" (capped from {cfg.warmup_epochs})" if trainer.warmup_epochs !=
                                            cfg.warmup_epochs else "")
    lines = [
        *weights,
        f"data: {cfg.data} [{trainer.splits.layout}]: {len(trainer.classes)} classes, "
        f"{len(trainer.splits.train)} train / {len(trainer.splits.val)} val images (train/val per class: {per_class})",
        f"device: {trainer.device}{f' x{trainer.ddp.world} processes' if trainer.ddp.enabled else ''}, "
        f"{trainer.precision_choice.describe()}{', torch.compile' if cfg.compile else ''}; "
        f"{trainer.train_loader.cpu_plan.describe()}",
        f"optimizer: {cfg.opt}, effective batch {trainer.effective_batch} = {cfg.batch_size} x {cfg.accum_steps} "
        f"accum x {trainer.ddp.world} proc; lr {trainer.lr:.3g} = {cfg.lr:g} x {trainer.effective_batch}/"
        f"{cfg.lr_base_size}; layer decay {trainer.layer_decay or 'off'}; {cfg.epochs} epoch"
        f"{'s' * (cfg.epochs != 1)} x {trainer.steps_per_epoch} steps, warmup {warmup}",
    ]
    if trainer.plan.head_epochs:
        lines.append(_head_phase_line(trainer))
    if getattr(trainer.model, "head_dist", None) is not None:
        lines.append("distilled model (DeiT): no teacher, so both heads (head, head_dist) are trained on the "
                     "labels through their mean, the model's output, as timm does")
    if trainer.budget is not None:
        lines.append(trainer.budget.describe())
    if cfg.patience:
        lines.append(f"early stopping: after {cfg.patience} epoch{'s' * (cfg.patience != 1)} without a better "
                     "val top-1")
    return lines


def _head_phase_line(trainer: Trainer) -> str:
    cfg, head_epochs = trainer.cfg, trainer.plan.head_epochs
    epochs = "every epoch" if head_epochs == cfg.epochs else f"epochs 1-{head_epochs}"
    if cfg.feature_views == 0:
        how = "the frozen backbone runs on freshly augmented images every epoch"
    else:
        views = "one un-augmented view" if cfg.feature_views == 1 else f"{cfg.feature_views} augmented views"
        how = (f"its pooled features ({views} of each image) are computed once and the head trains on them"
               + (" (mixup/cutmix start with the backbone)" if trainer.mixup is not None else ""))
    then = "" if head_epochs == cfg.epochs else "; then everything trains, with a schedule of its own"
    return f"head phase, {epochs}: backbone frozen, head lr {trainer.head_lr:.3g}; {how}{then}"

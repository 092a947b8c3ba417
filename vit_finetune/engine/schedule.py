"""The learning-rate schedule: timm's warmup + cosine, one per phase of the run, each counting its own steps."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..config import TrainConfig

log = logging.getLogger("vitft")


class PhasedSchedule:
    """timm schedulers that take turns, each counting steps from its own first one."""

    def __init__(self, phases: list[tuple[int, Any]]):
        self.phases = phases  # (first global step, scheduler), in order

    def step_update(self, step: int) -> None:
        first, scheduler = next((f, s) for f, s in reversed(self.phases) if step >= f)
        scheduler.step_update(step - first)


@dataclass
class Schedule:
    scheduler: PhasedSchedule
    head_lr: float  # the scaled LR of the head phase
    warmup_epochs: float  # as run: a fifth of the run when --warmup-epochs would cover most of it


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, lr: float, effective_batch: int,
                   head_epochs: int, steps_per_epoch: int, main: bool = True) -> Schedule:
    """timm's warmup + cosine schedule. A head phase before unfreezing gets its own (no warmup, head_lr),
    and the full fine-tuning after it starts afresh, as fastai's fine_tune does."""
    from timm.scheduler import create_scheduler_v2

    scale = effective_batch / cfg.lr_base_size
    head_lr = cfg.head_lr * scale if cfg.head_lr is not None else lr
    phases = []  # (first epoch, epochs, lr, warmup epochs)
    if 0 < head_epochs < cfg.epochs:
        phases.append((0, head_epochs, head_lr, 0))
    first = phases[0][1] if phases else 0
    epochs = cfg.epochs - first
    warmup_epochs = cfg.warmup_epochs
    if cfg.warmup_epochs * 2 > epochs:  # else the run is all warmup and ends by jumping to min_lr
        warmup_epochs = round(epochs * steps_per_epoch / 5) / steps_per_epoch
        if main:
            what = f"the {epochs} epochs after the head phase" if first else f"this {epochs}-epoch run"
            log.warning("--warmup-epochs %d would cover most of %s (ending it at min_lr, with no phase at full "
                        "LR); warming up for a fifth of it instead: %.3g epoch(s)", cfg.warmup_epochs, what,
                        warmup_epochs)
    phases.append((first, epochs, head_lr if head_epochs == cfg.epochs else lr, warmup_epochs))
    schedulers = []
    for first_epoch, epochs, phase_lr, warmup in phases:
        for group in optimizer.param_groups:
            group["initial_lr"] = phase_lr  # what a timm scheduler takes as its base LR (times the layer's lr_scale)
        scheduler, _ = create_scheduler_v2(
            optimizer, sched="cosine", num_epochs=epochs, warmup_epochs=warmup, min_lr=cfg.min_lr,
            warmup_lr=min(1e-6, phase_lr), step_on_epochs=False, updates_per_epoch=steps_per_epoch)
        schedulers.append((first_epoch * steps_per_epoch, scheduler))
    schedule = PhasedSchedule(schedulers)
    schedule.step_update(0)
    return Schedule(schedule, head_lr, warmup_epochs)

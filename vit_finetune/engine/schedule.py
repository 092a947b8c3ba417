"""The learning-rate schedule: timm's warmup + cosine, one per phase of the run, each counting its own steps."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..config import TrainConfig

log = logging.getLogger("vitft")
HEAD_LR = 2.5e-2  # per lr_base_size images: the measured starting point of a linear head on frozen features
FEW_STEPS_PER_HEAD_EPOCH, FEW_STEPS = 10, 50  # fewer optimizer steps than these: the run says it may not learn


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
    scale = effective_batch / cfg.lr_base_size
    head_lr = (cfg.head_lr if cfg.head_lr is not None else HEAD_LR) * scale
    phases = []  # (first epoch, epochs, lr, warmup epochs)
    if 0 < head_epochs < cfg.epochs:
        phases.append((0, head_epochs, head_lr, 0))
    first = phases[0][1] if phases else 0
    epochs = cfg.epochs - first
    warmup_epochs = fitted_warmup_epochs(cfg.warmup_epochs, epochs, steps_per_epoch)
    if warmup_epochs != cfg.warmup_epochs and main:
        what = f"the {epochs} epochs after the head phase" if first else f"this {epochs}-epoch run"
        log.warning("--warmup-epochs %d would cover most of %s (ending it at min_lr, with no phase at full "
                    "LR); warming up for a fifth of it instead: %s", cfg.warmup_epochs, what,
                    epochs_and_steps(warmup_epochs, steps_per_epoch))
    phases.append((first, epochs, head_lr if head_epochs == cfg.epochs else lr, warmup_epochs))
    if main:
        warn_if_few_steps(cfg, head_epochs, steps_per_epoch)
    schedule = PhasedSchedule([(first_epoch * steps_per_epoch, cosine(optimizer, phase_lr, epochs * steps_per_epoch,
                                                                      warmup * steps_per_epoch, cfg.min_lr))
                               for first_epoch, epochs, phase_lr, warmup in phases])
    schedule.step_update(0)
    return Schedule(schedule, head_lr, warmup_epochs)


def cosine(optimizer: torch.optim.Optimizer, lr: float, steps: int, warmup_steps: float, min_lr: float) -> Any:
    """timm's warmup + cosine from `lr` (times each group's lr_scale) to `min_lr` over `steps` optimizer steps:
    after the last one the LR is min_lr."""
    from timm.scheduler import create_scheduler_v2

    for group in optimizer.param_groups:
        group["initial_lr"] = lr  # what a timm scheduler takes as its base LR (times the layer's lr_scale)
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=steps, warmup_epochs=warmup_steps,
                                       min_lr=min_lr, warmup_lr=min(1e-6, lr), step_on_epochs=False,
                                       updates_per_epoch=1)
    return scheduler


def fitted_warmup_epochs(warmup_epochs: float, epochs: int, steps_per_epoch: int) -> float:
    """--warmup-epochs, or a fifth of the run where it would cover most of it (the run would be all warmup and
    end by jumping to min_lr)."""
    if warmup_epochs * 2 > epochs:
        return round(epochs * steps_per_epoch / 5) / steps_per_epoch
    return warmup_epochs


def epochs_and_steps(epochs: float, steps_per_epoch: int) -> str:
    """'0.2 epochs (3 steps)': a short run's warmup is a fraction of an epoch, not '0 epoch(s)'."""
    steps = round(epochs * steps_per_epoch)
    return f"{epochs:.3g} epoch{'s' * (epochs != 1)} ({steps} step{'s' * (steps != 1)})"


def warn_if_few_steps(cfg: TrainConfig, head_epochs: int, steps_per_epoch: int) -> None:
    """A schedule of a handful of steps learns little (a head phase at one step per epoch stays at chance): say so,
    unless --max-steps-per-epoch asked for few."""
    total = cfg.epochs * steps_per_epoch
    few_in_head = head_epochs > 0 and steps_per_epoch < FEW_STEPS_PER_HEAD_EPOCH
    if cfg.max_steps_per_epoch or not (few_in_head or total < FEW_STEPS):
        return
    log.warning("only %d optimizer step%s per epoch (%d in all)%s: too few to learn much; use a smaller "
                "--batch-size (or --accum-steps) or more --epochs", steps_per_epoch, "s" * (steps_per_epoch != 1),
                total, " with the backbone frozen" if few_in_head else "")

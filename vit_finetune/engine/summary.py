"""The start-up lines of a run: where the weights came from, the data, the device and precision, the optimisation,
the head phase and partial fine-tuning, said once before training starts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..weights.adapters import is_adapted, trainable_counts
from ..weights.loading import describe_weights
from .activations import RECOMPUTE, plan_storage, row_shape
from .phases import cached_rows, trains

if TYPE_CHECKING:
    from .trainer import Trainer


def startup_lines(trainer: Trainer) -> list[str]:
    """The start-up lines: weights, data, device, optimisation, and the head phase."""
    cfg = trainer.cfg
    counts = trainer.splits.class_counts()
    per_class = ", ".join(f"{c} {counts['train'].get(c, 0)}/{counts['val'].get(c, 0)}" for c in trainer.classes
                          ) if counts else ""
    weights = describe_weights(trainer.model)
    if trainer.resumed:  # the first line names the run's checkpoint, not the weights it started from
        weights[0] = (f"weights: this run's checkpoint {trainer.folder.checkpoint_file} (the run started from "
                      f"{trainer.model.pretrained_cfg.get('source')})")
    warmup = f"{trainer.warmup_epochs:.3g}" + (f" (capped from {cfg.warmup_epochs})" if trainer.warmup_epochs !=
                                            cfg.warmup_epochs else "")
    data = f"data: {cfg.data} [{trainer.splits.layout}]: {len(trainer.classes)} classes, " + (
        f"streamed: {trainer.steps_per_epoch} steps an epoch" if trainer.splits.streamed else
        f"{len(trainer.splits.train)} train / {len(trainer.splits.val)} val images (train/val per class: {per_class})")
    lines = [
        *weights,
        data,
        f"device: {trainer.device}{f' x{trainer.ddp.world} processes' if trainer.ddp.enabled else ''}, "
        f"{trainer.precision_choice.describe()}{', torch.compile' if cfg.compile else ''}; "
        f"{trainer.train_loader.cpu_plan.describe()}",
        f"optimizer: {cfg.opt}, effective batch {trainer.effective_batch} = {cfg.batch_size} x {cfg.accum_steps} "
        f"accum x {trainer.ddp.world} proc; lr {trainer.lr:.3g} = {cfg.lr:g} x {trainer.effective_batch}/"
        f"{cfg.lr_base_size}; layer decay {trainer.layer_decay or 'off'}; {cfg.epochs} epoch"
        f"{'s' * (cfg.epochs != 1)} x {trainer.steps_per_epoch} steps, warmup {warmup}",
    ]
    lines.append(_trainable_line(trainer))
    if trainer.plan.head_epochs:
        lines.append(_head_phase_line(trainer))
    if trainer.plan.train_blocks:
        lines.append(_partial_line(trainer))
    if getattr(trainer.model, "head_dist", None) is not None:
        lines.append("distilled model (DeiT): no teacher, so both heads (head, head_dist) are trained on the "
                     "labels through their mean, the model's output, as timm does")
    if cfg.balance != "none":
        lines.append(f"class balance: {_BALANCE_LINES[cfg.balance]} (--balance {cfg.balance})")
    if trainer.budget is not None:
        lines.append(trainer.budget.describe())
    if cfg.patience:
        lines.append(f"early stopping: after {cfg.patience} epoch{'s' * (cfg.patience != 1)} without a better "
                     "val top-1")
    return lines


def _trainable_line(trainer: Trainer) -> str:
    """How many parameters train in the phase the run starts (or resumes) in, and the LoRA adapter when there is
    one."""
    cfg = trainer.cfg
    trainable, total = trainable_counts(trainer.model)
    line = f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)"
    if trainer.state.epoch < trainer.plan.head_epochs:
        line += " in the head phase"
    if is_adapted(trainer.model):
        line += (f"; LoRA{' (DoRA)' if cfg.lora_method == 'dora' else ''} rank {cfg.lora}, alpha "
                 f"{cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora:g}, dropout {cfg.lora_dropout:g}, "
                 f"on {cfg.lora_targets}, the head trained in full; the other weights stay frozen")
    return line


_BALANCE_LINES = {"sampler": "each class drawn equally often, with replacement",
                  "loss": "cross-entropy weighted by 1/count per class", "sqrt": "cross-entropy weighted by "
                  "1/sqrt(count) per class"}


def _head_phase_line(trainer: Trainer) -> str:
    cfg, head_epochs = trainer.cfg, trainer.plan.head_epochs
    epochs = "every epoch" if head_epochs == cfg.epochs else f"epochs 1-{head_epochs}"
    if cfg.feature_views == 0:
        how = "the frozen backbone runs on freshly augmented images every epoch"
    else:
        views = "one un-augmented view" if cfg.feature_views == 1 else f"{cfg.feature_views} augmented views"
        how = (f"its pooled features ({views} of each image) are computed once and the head trains on them"
               + (" (mixup/cutmix start with the backbone)" if trainer.mixup is not None else ""))
    after = f"the top {trainer.plan.train_blocks} blocks train" if trainer.plan.train_blocks else "everything trains"
    then = "" if head_epochs == cfg.epochs else f"; then {after}, with a schedule of its own"
    return f"head phase, {epochs}: backbone frozen, head lr {trainer.head_lr:.3g}; {how}{then}"


def _partial_line(trainer: Trainer) -> str:
    """What trains under --train-blocks, and where the frozen blocks' activations are to be cached."""
    cfg, model, blocks = trainer.cfg, trainer.model, trainer.plan.train_blocks
    depth, head_epochs = len(model.blocks), trainer.plan.head_epochs
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for name, p in model.named_parameters() if trains(name, depth, blocks))
    epochs = f"epochs {head_epochs + 1}-{cfg.epochs}" if head_epochs else "every epoch"
    what = (f"partial fine-tuning, {epochs}: the top {blocks} of {depth} blocks, the final norm and the head train "
            f"({trained / 1e6:.3g}M of {total / 1e6:.3g}M parameters, {100 * trained / total:.1f}%)")
    if cfg.feature_views == 0:
        return f"{what}; the frozen blocks run at every step (--feature-views 0)"
    storage = plan_storage(cached_rows(trainer), row_shape(model), trainer.precision, trainer.folder,
                           trainer.ddp.world)
    views = "one un-augmented view" if cfg.feature_views == 1 else f"{cfg.feature_views} augmented views"
    cached = f"the frozen blocks' activations ({views} of each image, and the validation images)"
    if storage.where == RECOMPUTE:
        return f"{what}; the frozen blocks run at every step: {cached} would take {storage.size}, more than fits " \
            "in memory or on disk"
    return f"{what}; {cached} are computed once: {storage.describe()}{' per process' * trainer.ddp.enabled}"

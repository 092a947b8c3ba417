"""What a run optimises and how it chooses its best model: single-label classification (cross-entropy, top-1) or
multi-label (binary cross-entropy or ASL on sigmoid outputs, mAP, one threshold per class chosen on the
validation images for the best F1). The Trainer asks this module; the multi-label validation lives here."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import TrainConfig
from ..errors import VitftError
from ..tasks.multilabel import best_thresholds, multilabel_metrics, precision_at_1

if TYPE_CHECKING:
    from .trainer import Trainer

LOSSES = ("auto", "bce", "asl")
MULTI_LABEL_LOSSES = ("bce", "asl")


def selection_metric(multi_label: bool) -> str:
    """The validation metric that picks the best model (and early stopping watches)."""
    return "val_mAP" if multi_label else "val_top1"


def metric_name(multi_label: bool) -> str:
    return "mAP" if multi_label else "top-1"


def mark_task(model: nn.Module, multi_label: bool) -> None:
    """Say in the model's pretrained_cfg (config.json) whether it is multi-label; drop thresholds of an earlier
    task (validation sets new ones)."""
    model.pretrained_cfg.pop("thresholds", None)
    if multi_label:
        model.pretrained_cfg["multi_label"] = True
    else:
        model.pretrained_cfg.pop("multi_label", None)


def losses(cfg: TrainConfig, num_classes: int, multi_label: bool) -> tuple[Optional[nn.Module], nn.Module, nn.Module]:
    """(mixup, training loss, cached-features head loss). Mixup/CutMix mix (and smooth) the targets themselves,
    multi-hot ones included, so the training loss then takes them as they come."""
    from timm.data import Mixup
    from timm.loss import AsymmetricLossMultiLabel, BinaryCrossEntropy, SoftTargetCrossEntropy

    if cfg.loss not in LOSSES:
        raise VitftError(f"unknown --loss {cfg.loss!r}; use {', '.join(LOSSES)}")
    if cfg.loss in MULTI_LABEL_LOSSES and not multi_label:
        raise VitftError(f"--loss {cfg.loss} is a multi-label loss but every row of {cfg.data} has one label; add "
                         "--multi-label, or drop --loss")
    mixing = cfg.mixup > 0 or cfg.cutmix > 0
    mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.label_smoothing,
                  num_classes=num_classes, multi_label=multi_label) if mixing else None
    smoothing = cfg.label_smoothing
    if not multi_label:
        head = nn.CrossEntropyLoss(label_smoothing=smoothing)
        return mixup, SoftTargetCrossEntropy() if mixing else head, head
    if cfg.loss == "asl":
        head = AsymmetricLossMultiLabel(smoothing=smoothing)
        return mixup, AsymmetricLossMultiLabel() if mixing else head, head
    head = BinaryCrossEntropy(smoothing=smoothing, smooth_dense=True)
    return mixup, BinaryCrossEntropy(smoothing=0.0) if mixing else head, head


@torch.inference_mode()
def validate_multilabel(trainer: Trainer, model: nn.Module) -> dict:
    """Loss, mAP, macro F1 and precision@1 (as val_top1) on the validation images of every rank; the per-class
    thresholds with the best F1 go into the model's pretrained_cfg, so that the saved model carries them."""
    model.eval()
    probs, targets, losses_sum = [], [], 0.0
    total = len(trainer.val_set) if trainer.val_set is not None else 0
    progress = trainer.progress.counter("validation", " images") if trainer.progress is not None else None
    for logits, target in trainer.plan.at(trainer.state.epoch).logits(trainer, model):
        trainer.check_interrupt()
        logits, target = logits.float(), target.float()
        losses_sum += F.binary_cross_entropy_with_logits(logits, target, reduction="sum").item() / target.shape[1]
        probs.append(torch.sigmoid(logits).cpu())
        targets.append(target.cpu())
        if progress:
            progress(sum(len(t) for t in targets), total)
    parts = [(torch.cat(probs).numpy(), torch.cat(targets).numpy(), losses_sum)] if probs else []
    if trainer.ddp.enabled:
        gathered: list = [None] * trainer.ddp.world
        torch.distributed.all_gather_object(gathered, parts)
        parts = [part for rank in gathered for part in rank]
    if not parts:
        raise VitftError("none of the validation images could be decoded")
    prob = np.concatenate([p for p, _, _ in parts])
    target = np.concatenate([t for _, t, _ in parts])
    thresholds = best_thresholds(prob, target)
    metrics = multilabel_metrics(prob, target, thresholds, trainer.classes)
    getattr(model, "module", model).pretrained_cfg["thresholds"] = [round(t, 6) for t in thresholds]
    return {"val_loss": sum(loss for _, _, loss in parts) / len(prob), "val_top1": precision_at_1(prob, target),
            "val_top5": None, "val_images": len(prob), "val_mAP": metrics["mAP"] or 0.0,
            "val_f1_macro": metrics["f1_macro"] or 0.0}

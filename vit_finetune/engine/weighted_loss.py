"""Class-weighted cross-entropy for --balance loss and sqrt, one loss for hard labels, label smoothing and
mixup/cutmix's soft targets (timm's SoftTargetCrossEntropy takes no weights).

Each image's cross-entropy against its target distribution t (the one-hot label, smoothed; or mixup's mix) is
weighted by t's mean class weight, t . w: the label's weight for a hard label, lam * w_a + (1 - lam) * w_b for
a mix of a and b, and label smoothing's uniform share at the mean weight. The batch's loss is the plain mean
of the weighted losses (not divided by the batch's summed weights, as torch's weighted mean is): with weights
whose mean over the training images is 1 the loss keeps its scale, and DDP's average of the ranks' means is the
mean over the global batch, as one process with that batch computes it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data.balance import class_weights


class WeightedCrossEntropy(nn.Module):
    """Cross-entropy of logits against class indices or target distributions, each image weighted by t . w."""

    def __init__(self, weights: torch.Tensor, label_smoothing: float = 0.0):
        super().__init__()
        self.register_buffer("weights", weights.float())
        self.label_smoothing = label_smoothing

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits.float(), dim=-1)
        if target.dim() == 1:  # class indices: the smoothed one-hot distribution
            k, eps = logits.shape[-1], self.label_smoothing
            target = F.one_hot(target, k).float() * (1 - eps) + eps / k
        target = target.float()
        per_image = -(target * logp).sum(dim=-1)
        return (per_image * (target @ self.weights.to(logp.device))).mean()


def balanced_loss(balance: str, labels: list[int], num_classes: int, label_smoothing: float) -> nn.Module | None:
    """The weighted loss of --balance loss or sqrt, from the training labels; None for the other choices."""
    weights = class_weights(labels, num_classes, balance)
    return None if weights is None else WeightedCrossEntropy(weights, label_smoothing)

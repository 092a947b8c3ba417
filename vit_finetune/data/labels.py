"""What a sample's label is, for every source of data: a class index, or a tuple of class indices (multi-label);
and the multi-hot float target a multi-label sample trains on."""
from __future__ import annotations

import torch

Label = int | tuple[int, ...]  # a class index, or the class indices of a multi-label sample


def multi_hot(label: Label, num_classes: int) -> torch.Tensor:
    """A float vector with 1 at the label's class indices (a single index is a one-label sample)."""
    target = torch.zeros(num_classes)
    target[list(label) if isinstance(label, tuple) else label] = 1.0
    return target

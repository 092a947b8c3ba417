"""Imbalanced classes (--balance): the class-balanced sampler, inverse-frequency class weights for the loss, and
the start-up warnings about classes too small or too unequal to train well as they are.

The sampler draws every epoch's indices with replacement, each class equally often in expectation, from one
generator seeded with seed + epoch (as the plain shuffle): a resume repeats an epoch, and DDP ranks take the
interleaved shards of one global draw (as DistributedSampler does), so two ranks together draw what one process
draws. An image drawn again in an epoch comes as index + k * len(dataset) (its k-th repeat), which ImageDataset
reads as the same image with an augmentation seed of its own: oversampled images are not repeated crop for crop.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from ..errors import VitftError, did_you_mean

BALANCE_CHOICES = ("none", "sampler", "loss", "sqrt")
IMBALANCE_RATIO = 10  # largest / smallest training class beyond which the start-up lines warn
FEW_IMAGES = 10  # training images below which a class gets a warning


def check_balance(balance: str, multi_label: bool = False) -> None:
    """A one-line VitftError for an unknown --balance, or one other than none on multi-label data."""
    if balance not in BALANCE_CHOICES:
        raise VitftError(f"unknown --balance {balance!r}{did_you_mean(balance, BALANCE_CHOICES)}; use one of "
                         f"{', '.join(BALANCE_CHOICES)}")
    if balance != "none" and multi_label:
        raise VitftError(f"--balance {balance} is for single-label data, and this data is multi-label (several "
                         "labels per image); use --balance none")


def class_counts(labels: Sequence[int], num_classes: int) -> torch.Tensor:
    """Images per class, as int64 (a class without images counts 0)."""
    return torch.bincount(torch.as_tensor(list(labels), dtype=torch.long), minlength=num_classes)


def class_weights(labels: Sequence[int], num_classes: int, balance: str) -> torch.Tensor | None:
    """Per-class loss weights for --balance loss (1 / count) or sqrt (1 / sqrt(count)), scaled so that their mean
    over the training images is 1 (the loss keeps its scale, and the learning rate its meaning); None otherwise.
    A class without training images gets weight 0: no target of it is ever weighted."""
    if balance not in ("loss", "sqrt"):
        return None
    counts = class_counts(labels, num_classes).double()
    inverse = torch.where(counts > 0, counts.clamp(min=1) ** (-1.0 if balance == "loss" else -0.5), 0.0)
    return (inverse * counts.sum() / (inverse * counts).sum()).float()


def balanced_draw(labels: torch.Tensor, n: int, generator: torch.Generator, replacement: bool = True
                  ) -> torch.Tensor:
    """`n` indices of `labels`, drawn so that each class present is equally likely (with replacement; without it,
    a class whose images are all drawn leaves the next draws to the others)."""
    counts = torch.bincount(labels)
    return torch.multinomial(1.0 / counts[labels].double(), n, replacement=replacement, generator=generator)


def with_repeats_numbered(indices: torch.Tensor, size: int) -> torch.Tensor:
    """Each index plus k * size where it is the index's k-th repeat in `indices` (0 for the first)."""
    order = torch.sort(indices, stable=True)
    sorted_idx = order.values
    starts = torch.ones_like(sorted_idx, dtype=torch.bool)
    starts[1:] = sorted_idx[1:] != sorted_idx[:-1]
    position = torch.arange(len(indices))
    first = torch.cummax(torch.where(starts, position, 0), dim=0).values  # where each run of one index begins
    repeat = torch.empty_like(indices)
    repeat[order.indices] = position - first
    return indices + repeat * size


class ClassBalancedSampler(Sampler[int]):
    """Dataset indices, each class equally often in expectation, len(labels) per epoch over all ranks; this rank's
    shard is every `world`-th of the global draw, padded from its start to a multiple of `world` (as
    DistributedSampler pads). Call set_epoch(epoch) before each epoch."""

    def __init__(self, labels: Sequence[int], seed: int = 0, rank: int = 0, world: int = 1):
        self.labels = torch.as_tensor(list(labels), dtype=torch.long)
        self.seed, self.rank, self.world, self.epoch = seed, rank, world, 0
        self.num_samples = math.ceil(len(self.labels) / world)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_draw(self) -> torch.Tensor:
        """This epoch's draw over all ranks, repeats numbered (with_repeats_numbered)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        drawn = with_repeats_numbered(balanced_draw(self.labels, len(self.labels), generator), len(self.labels))
        padding = self.num_samples * self.world - len(drawn)
        return torch.cat([drawn, drawn[:padding]])

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_draw()[self.rank::self.world].tolist())

    def __len__(self) -> int:
        return self.num_samples


def imbalance_warnings(train_counts: dict[str, int], balance: str, multi_label: bool = False) -> list[str]:
    """Warnings about the training classes: one far larger than another (IMBALANCE_RATIO), classes without images,
    and classes with fewer than FEW_IMAGES images; each says what to do (never --balance, which multi-label data
    refuses, for multi-label data)."""
    present = {c: n for c, n in train_counts.items() if n > 0}
    warnings = []
    if present:
        largest, smallest = max(present, key=present.get), min(present, key=present.get)
        ratio = present[largest] / present[smallest]
        if ratio > IMBALANCE_RATIO and balance == "none":
            fix = "read per-class AP and macro F1, not mAP alone" if multi_label else \
                "try --balance sampler (or loss, sqrt), and read balanced accuracy and macro F1, not top-1"
            warnings.append(f"imbalanced classes: {largest} has {present[largest]} training images, {ratio:.0f}x "
                            f"{smallest}'s {present[smallest]}; the model will favour the large classes: {fix}")
    empty = [c for c, n in train_counts.items() if n == 0]
    if empty:  # no sampler or weight can give a class without images a share: the model never predicts it
        warnings.append(f"class(es) with no training images: {', '.join(empty)}; the model cannot learn to predict "
                        "them, and every validation image of them counts as a mistake: add training images, or "
                        "remove them from the data")
    few = [f"{c} ({n})" for c, n in train_counts.items() if 0 < n < FEW_IMAGES]
    if few:
        fix = "--balance sampler or loss gives them their share of the training" if balance == "none" else \
            f"--balance {balance} gives them their share, but cannot add variety"
        fix = "rare labels are learnt least well" if multi_label else fix
        warnings.append(f"class(es) with fewer than {FEW_IMAGES} training images: {', '.join(few)}; add images if "
                        f"you can; {fix}")
    return warnings

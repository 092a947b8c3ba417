"""Pooled features of a frozen backbone, computed once: a linear probe trains in seconds, not hours.

While the backbone is frozen, every epoch would push the same images through the same weights. Instead,
`extract_features` runs the backbone once over a loader (under the run's autocast) and keeps the pooled
features, what `VisionTransformer.classify` reads, in memory; `FeatureSet.batches` then serves them shuffled,
as a DataLoader serves images. Memory is small next to the images: 384 floats (1.5 kB) per image for a ViT-S.
Partial fine-tuning keeps the token activations of the frozen lower blocks the same way (`encode`), in a buffer
it allocates (`into`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from ..data.balance import balanced_draw
from ..data.loaders import requested_batches
from ..runtime import compute_context

ProgressFn = Callable[[int, int], None]  # (images done, total)


@dataclass
class FeatureSet:
    """Pooled features and their labels; the rows of each augmented view of the data follow one another."""

    features: torch.Tensor  # (rows, dim), (rows, 2, dim) for a distilled model's two tokens, or (rows, tokens, dim)
    labels: torch.Tensor  # (rows,) int64, or (rows, classes) multi-hot float32
    view_sizes: list[int] = field(default_factory=list)  # rows per view; [] = one view

    def __len__(self) -> int:
        return len(self.labels)

    def view(self, index: int) -> FeatureSet:
        """The rows of view `index` (modulo the number of views): an epoch sees one view of each image."""
        sizes = self.view_sizes or [len(self)]
        i = index % len(sizes)
        start = sum(sizes[:i])
        return FeatureSet(self.features[start:start + sizes[i]], self.labels[start:start + sizes[i]])

    def batches(self, batch_size: int, generator: Optional[torch.Generator] = None,
                steps: Optional[int] = None, balanced: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """All rows in batches, in order (generator None) or shuffled; or exactly `steps` full batches in a
        random order that starts over when the rows run out, as a training epoch takes them; or, balanced (with
        `steps`), drawn with replacement, each class equally often in expectation (--balance sampler; under DDP
        each rank draws from its own rows)."""
        n = len(self)
        if balanced and steps is not None:
            order = balanced_draw(self.labels, steps * batch_size, generator)
        elif steps is None:
            order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
            steps = math.ceil(n / batch_size)
        else:
            order = torch.cat([torch.randperm(n, generator=generator)
                               for _ in range(math.ceil(steps * batch_size / n))])
        for step in range(steps):
            index = order[step * batch_size:(step + 1) * batch_size]
            yield self.features[index], self.labels[index]


@torch.inference_mode()
def extract_features(model: nn.Module, loader, device: torch.device, precision: str, views: int = 1,
                     progress: Optional[ProgressFn] = None, check_stop: Optional[Callable[[], None]] = None,
                     encode: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                     into: Optional[torch.Tensor] = None) -> FeatureSet:
    """Pool the backbone's output for every image of `loader`, `views` passes over it. `check_stop` is called
    between batches and raises to end the pass (a signal: the run checkpoints and stops). `encode` replaces the
    pooled output (images -> rows); `into`, a buffer of at least `views` x len(loader.sampler) rows, receives the
    rows in its own dtype (else they are kept in float32).

    `loader` must not shuffle. It yields (images, labels) or, from an ImageDataset with return_index,
    (images, labels, used): an image that failed to decode was replaced by another (used is not the index
    its sampler asked for), and such rows are dropped, so no image is counted twice.
    """
    was_training = model.training
    model.eval()
    encode = encode or (lambda images: model.pool(model.forward_features(images)))
    feats, labels, view_sizes, filled = [], [], [], 0
    total, done = views * len(loader.sampler), 0
    try:
        for _ in range(views):
            rows = 0
            for images, targets, _, keep in requested_batches(loader):
                if check_stop:
                    check_stop()
                with compute_context(device, precision):
                    rows_out = encode(images.to(device, non_blocking=True))
                if into is None:
                    feats.append(rows_out.float().cpu()[keep])
                else:
                    kept = rows_out[keep.to(rows_out.device)]
                    into[filled:filled + len(kept)] = kept.to(into.dtype).cpu()
                    filled += len(kept)
                labels.append(targets[keep])
                rows += int(keep.sum())
                done += len(targets)
                if progress:
                    progress(done, total)
            view_sizes.append(rows)
    finally:
        model.train(was_training)
    targets = torch.cat(labels)  # class indices, or multi-hot float vectors (multi-label)
    return FeatureSet(torch.cat(feats) if into is None else into[:filled],
                      targets if targets.is_floating_point() else targets.long(), view_sizes)

"""Streamed data: images read once in order from a source too big to list (a Hugging Face dataset with
--streaming, WebDataset tar shards), split across DDP ranks and DataLoader workers so that a pass over the
source reads each image once, in one worker of one rank.

A source (hf.HubStream, shards.ShardStream) yields (key, image, label) records for one rank; it splits its
records between the DataLoader workers itself (by shard: no worker reads another's). StreamDataset decodes and
augments them as ImageDataset does (the same per-image seeds, bad images counted and reported, not fatal), and
stream_batches cuts an epoch of exactly --steps-per-epoch batches out of one pass or more.
"""
from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Optional, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ..errors import VitftError
from .images import ImageLike, load_rgb
from .labels import Label, multi_hot

log = logging.getLogger("vitft")

Record = tuple[str, ImageLike, Label]  # (key that names the image, the image, its label)


class RecordSource(Protocol):
    """A split that is read as a stream."""

    name: str  # what warnings call it
    length: Optional[int]  # records in one pass over all ranks, when the source says

    def records(self, rank: int, world: int, shuffle_seed: Optional[int]) -> Iterator[Record]:
        """This rank's records (of `world`), split between the DataLoader workers; shuffled with the seed."""


@dataclass(frozen=True)
class EncodedImage:
    """An image of a stream kept encoded in memory (an images.ImageSource) under the key that names it."""

    name: str
    data: bytes = field(repr=False)

    def read_bytes(self) -> bytes:
        return self.data

    def __str__(self) -> str:
        return self.name


def read_whole(source: RecordSource) -> list[tuple[EncodedImage, Label]]:
    """Every record of a stream, in order, as a list (an evaluation set: small enough to hold encoded)."""
    return [(EncodedImage(key, image if isinstance(image, bytes) else image.read_bytes()), label)
            for key, image, label in source.records(0, 1, None)]


def shuffle_seed(seed: int, epoch: int, pass_index: int) -> int:
    """The seed of pass `pass_index` of `epoch`: the same on every rank and worker, and after a resume."""
    return int(np.random.SeedSequence([seed % 2**32, epoch, pass_index]).generate_state(1)[0])


class StreamDataset(IterableDataset):
    """Decoded, transformed (image, label) pairs of a RecordSource for one rank (an IterableDataset).

    set_epoch(seed, epoch, pass_index) shuffles the next pass and seeds each image's augmentation from
    (seed, epoch, its key), as ImageDataset.set_epoch does by index; without it a pass is in the source's order.
    An image that cannot be decoded is skipped and counted (report_skipped warns), never fatal.
    """

    def __init__(self, source: RecordSource, transform: Callable[..., dict], rank: int = 0, world: int = 1,
                 name: str = "images", num_classes: Optional[int] = None):
        """num_classes (multi-label): labels come out as multi-hot float vectors of that length, as ImageDataset's."""
        self.source, self.transform, self.rank, self.world, self.name = source, transform, rank, world, name
        self.num_classes = num_classes
        self._epoch = torch.tensor([0, -1, 0]).share_memory_()  # (seed, epoch, pass), shared with the workers
        self._failed = torch.zeros(1, dtype=torch.long).share_memory_()  # images skipped, counted by any worker
        self._reported = 0

    def __len__(self) -> int:
        """Images in one pass over every rank (0 when the source does not say): for progress totals only."""
        return self.source.length or 0

    def set_epoch(self, seed: int, epoch: int, pass_index: int = 0) -> None:
        """Shuffle and augment the next pass as (seed, epoch, pass_index) say; call before its iterator is made."""
        self._epoch.copy_(torch.tensor([seed, epoch, pass_index]))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, Label]]:
        seed, epoch, pass_index = self._epoch.tolist()
        order = shuffle_seed(seed, epoch, pass_index) if epoch >= 0 else None
        for key, image, label in self.source.records(self.rank, self.world, order):
            try:
                array = load_rgb(image)
            except Exception as e:
                self._failed += 1
                log.debug("%s: could not decode %s: %s", self.name, key, e)
                continue
            if epoch >= 0 and hasattr(self.transform, "set_random_seed"):
                self.transform.set_random_seed(shuffle_seed(seed, epoch, zlib.crc32(key.encode())))
            yield self.transform(image=array)["image"], label if self.num_classes is None else \
                multi_hot(label, self.num_classes)

    def report_skipped(self) -> None:
        """Warn about images that could not be decoded since the last report."""
        failed = int(self._failed.item())
        if failed > self._reported:
            log.warning("%s: %d image(s) could not be decoded and were skipped", self.name, failed)
            self._reported = failed


def stream_batches(loader: DataLoader, seed: int, epoch: int, count: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """`count` batches of exactly loader.batch_size images for one epoch: pass 0 of the epoch's shuffle, then as
    many more passes as it takes. A pass's last images that make no full batch start the next pass's first batch,
    so an epoch of images // (batch x processes) steps reads each image once. The loader's workers hand over
    partial batches at the end of their share; they are joined here."""
    dataset, size = loader.dataset, loader.batch_size
    images: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    done, pass_index = 0, 0
    while done < count:
        dataset.set_epoch(seed, epoch, pass_index)
        yielded = False
        for batch_images, batch_labels in loader:
            yielded = True
            images.append(batch_images)
            labels.append(torch.as_tensor(batch_labels))
            while done < count and sum(len(x) for x in images) >= size:
                joined_images, joined_labels = torch.cat(images), torch.cat(labels)
                images, labels = [joined_images[size:]], [joined_labels[size:]]
                done += 1
                yield joined_images[:size], joined_labels[:size]
            if done == count:
                return
        if not yielded:
            raise VitftError(f"{dataset.name}: a pass over the data gave no readable image on this process; "
                             "check the data, or use fewer processes than it has shards")
        pass_index += 1

"""Batching: ImageDataset (decodes through a transform, replaces images that fail to decode, an optional shared
decode cache) and build_loader (seeded, distributed-aware DataLoaders sized to the CPU), and requested_batches,
the one place that tells a batch's replaced images from the ones its sampler asked for."""
from __future__ import annotations

import copy
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from timm.data.constants import DEFAULT_CROP_PCT
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, get_worker_info

from ..errors import VitftError
from ..models.pos_embed import to_int_pair
from ..runtime import CpuPlan, fit_cpu_threads, torch_threads
from .balance import ClassBalancedSampler
from .datasets import Sample
from .images import ImageLike, few, load_rgb, probe, shrunk
from .labels import multi_hot

log = logging.getLogger("vitft")


def _image(image: ImageLike) -> ImageLike:
    """A file as a Path; an images.ImageSource (a row of an arrow table, hf.py) as it is."""
    return Path(image) if isinstance(image, (str, os.PathLike)) else image


class ImageDataset(Dataset):
    """(image, label) samples, or bare images (label -1), as (CHW float tensor, label[, index]) through `transform`.

    An image is a file (path) or an images.ImageSource (a row of an arrow table: hf.py's ArrowImage), decoded alike.

    cache=True keeps every decoded image in one uint8 buffer that all workers share (see fill_cache), shrunk so the
    shorter side is at most 1.15 * max(img_size / crop_pct, img_size): eval resizes to img_size / crop_pct anyway, while
    train crops lose a little detail, and RAM drops a lot for photos larger than that (full size if img_size is None).
    return_index=True adds the index of the image actually returned (a bad image's replacement, for predict).
    num_classes (multi-label): labels, a class index or a tuple of them, come out as multi-hot float vectors of
    that length, which batch into a (batch, num_classes) target as they are.
    """

    def __init__(
        self,
        samples: Sequence[Sample] | Sequence[Path],
        transform: Callable[..., dict],
        cache: bool = False,
        img_size: int | tuple[int, int] | None = None,
        crop_pct: float = DEFAULT_CROP_PCT,
        return_index: bool = False,
        name: str = "images",
        num_classes: int | None = None,
    ):
        pairs = [(_image(s[0]), _label(s[1])) if isinstance(s, (tuple, list)) else (_image(s), -1)
                 for s in samples]
        with ThreadPoolExecutor(8) as pool:  # header reads only; threads hide the latency of network file systems
            probes = list(pool.map(probe, [p for p, _ in pairs]))
        bad = [f"{p} ({why})" for (p, _), why in zip(pairs, probes) if isinstance(why, str)]
        if bad:
            log.warning("%s: skipped %d of %d files that are not readable images: %s", name, len(bad), len(pairs),
                        few(bad))
        if len(bad) == len(pairs):
            raise VitftError(f"{name}: no readable images among {len(pairs)} files" + (f": {few(bad)}" if bad else ""))
        self.unreadable = [p for (p, _), why in zip(pairs, probes) if isinstance(why, str)]
        good = [(p, label, size) for (p, label), size in zip(pairs, probes) if not isinstance(size, str)]
        self.paths, self.labels, self.sizes = (list(column) for column in zip(*good))
        self.failed = torch.zeros(len(self.paths), dtype=torch.bool).share_memory_()  # set by any worker
        self.transform, self.return_index, self.name, self.cache = transform, return_index, name, cache
        self.num_classes = num_classes
        self.img_size = img_size
        side = max(to_int_pair(img_size)) if img_size else None
        self.cache_side = math.ceil(1.15 * max(side / crop_pct, side)) if cache and side else None
        self._cache: torch.Tensor | None = None
        self._reported = 0
        # (seed, epoch) of per-image augmentation (set_epoch), shared with the workers; epoch -1: one running stream
        self._augment_seed = torch.tensor([0, -1]).share_memory_()

    def __len__(self) -> int:
        return len(self.paths)

    def with_transform(self, transform: Callable[..., dict], return_index: bool | None = None) -> ImageDataset:
        """The same images, decode cache and failure flags, through another transform (no second decode)."""
        other = copy.copy(self)
        other.transform = transform
        other.return_index = self.return_index if return_index is None else return_index
        other._augment_seed = torch.tensor([0, -1]).share_memory_()  # its own passes: not the training epochs'
        return other

    def set_epoch(self, seed: int, epoch: int) -> None:
        """Augment image i of this epoch from a seed of its own, (seed, epoch, i): the same crop and flip
        whichever worker or process loads it, and after a resume mid-epoch, so that DDP ranks and resumed runs
        repeat what one uninterrupted process does. Call it before the epoch's loader iterator is made."""
        self._augment_seed.copy_(torch.tensor([seed, epoch]))

    def __getitem__(self, index: int) -> tuple:
        i = index % len(self)  # a ClassBalancedSampler's k-th repeat of image i: i + k * len, its own augmentation
        for _ in range(len(self)):  # a bad image is replaced by the next good one, so training never stops
            if not self.failed[i]:
                try:
                    image = self._load(i)
                    break
                except Exception as e:
                    self._fail(i, e)
            i = (i + 1) % len(self)
        else:
            raise VitftError(f"{self.name}: none of the {len(self)} images can be decoded, e.g. {few(self.paths)}")
        seed, epoch = self._augment_seed.tolist()
        if epoch >= 0:
            _seed_transform(self, int(np.random.SeedSequence([seed % 2**32, epoch, index]).generate_state(1)[0]))
        x = self.transform(image=image)["image"]
        target = self.labels[i] if self.num_classes is None else multi_hot(self.labels[i], self.num_classes)
        return (x, target, i) if self.return_index else (x, target)

    def _load(self, i: int) -> np.ndarray:
        if self._cache is None:
            return load_rgb(self.paths[i], self.cache_side)
        image = self._cache[self._offsets[i] : self._offsets[i + 1]].numpy().reshape(self._shapes[i])
        image.flags.writeable = False  # shared by all workers: an in-place transform must fail, not corrupt it
        return image

    def _fail(self, i: int, error: Exception) -> None:
        self.failed[i] = True
        log.debug("could not decode %s: %s", self.paths[i], error)

    def fill_cache(self, progress: Callable[[int, int], None] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> None:
        """Decode every image once into one buffer (threads; progress(done, total)).

        Call it before DataLoader workers start (build_loader does): forked workers then share the buffer
        copy-on-write (it is only read), and torch moves it to shared memory for spawned ones, so RAM holds one copy.
        When should_stop() turns true (a signal: the run is ending) the fill is abandoned and the images are
        decoded from their files for what is left of the run.
        """
        if not self.cache or self._cache is not None:
            return
        nbytes = [3 * math.prod(shrunk(w, h, self.cache_side)) for w, h in self.sizes]
        offsets = np.cumsum([0, *nbytes])
        cache = torch.empty(int(offsets[-1]), dtype=torch.uint8)
        flat, shapes = cache.numpy(), np.zeros((len(self), 3), dtype=np.int64)

        def fill(i: int) -> None:
            try:
                image = load_rgb(self.paths[i], self.cache_side)
                flat[offsets[i] : offsets[i + 1]] = image.reshape(-1)
                shapes[i] = image.shape
            except Exception as e:
                self._fail(i, e)

        with ThreadPoolExecutor(os.cpu_count()) as pool:
            for done, _ in enumerate(pool.map(fill, range(len(self))), 1):
                if should_stop is not None and should_stop():
                    pool.shutdown(cancel_futures=True)  # the images being decoded finish; the rest are dropped
                    self.cache = False
                    return
                if progress:
                    progress(done, len(self))
        self._cache, self._offsets, self._shapes = cache, offsets, shapes

    def failed_paths(self) -> list[Path]:
        """Images that failed to decode so far, in any worker (they flag them in shared memory)."""
        return [self.paths[i] for i in self.failed.nonzero().flatten().tolist()]

    def skipped(self) -> list[Path]:
        """Every file left out so far: unreadable when the dataset was built, or failed to decode since."""
        return self.unreadable + self.failed_paths()

    def report_skipped(self) -> None:
        """Warn about images that failed to decode since the last report; build_loader's loaders call it per pass."""
        failed = self.failed_paths()
        if len(failed) > self._reported:
            log.warning(
                "%s: %d image(s) could not be decoded and were replaced by others (%d file(s) skipped in total): %s",
                self.name, len(failed), len(failed) + len(self.unreadable), few(failed),
            )
            self._reported = len(failed)


def _label(label) -> int | tuple[int, ...]:
    return tuple(int(i) for i in label) if isinstance(label, (tuple, list)) else int(label)


class _Loader(DataLoader):
    """A DataLoader that runs torch with its plan's threads while iterated (restored after), and reports the
    images its ImageDataset skipped at the end of every pass."""

    cpu_plan: CpuPlan | None = None

    def __iter__(self):
        with torch_threads(self.cpu_plan.threads if self.cpu_plan else None):
            yield from super().__iter__()
        if hasattr(self.dataset, "report_skipped"):  # an ImageDataset, a streams.StreamDataset
            self.dataset.report_skipped()


# Single-core milliseconds per pixel (measured: see the README's performance notes): decoding a JPEG, per file
# pixel; augmenting, per output pixel; a ViT-Ti training step, per input pixel (inference: a third of it).
_DECODE_MS_PER_PIXEL, _AUGMENT_MS_PER_PIXEL, _STEP_MS_PER_PIXEL = 18e-6, 10e-6, 4e-3


def _work_per_image(dataset: Dataset, train: bool) -> tuple[float, float]:
    """(data, model) single-core milliseconds per image: what fit_cpu_threads divides the cores by."""
    h, w = to_int_pair(getattr(dataset, "img_size", None) or 224)
    data_ms = _AUGMENT_MS_PER_PIXEL * h * w
    sizes = getattr(dataset, "sizes", None)
    if sizes and not getattr(dataset, "cache", False):  # cached images are decoded once, not at every step
        sample = sizes[:: max(1, len(sizes) // 256)]
        data_ms += _DECODE_MS_PER_PIXEL * sum(sw * sh for sw, sh in sample) / len(sample)
    return data_ms, _STEP_MS_PER_PIXEL * h * w / (1 if train else 3)


def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    train: bool,
    workers: int | None = None,
    threads: int | None = None,
    device_type: str = "cpu",
    distributed: bool = False,
    seed: int = 0,
    drop_last: bool | None = None,
    indices: Sequence[int] | None = None,
    balanced: bool = False,
) -> DataLoader:
    """Batches for training (shuffled, seeded, full batches only) or evaluation (in order, all samples).

    With distributed=True (torch.distributed initialised) each rank gets its shard from a DistributedSampler;
    call loader.sampler.set_epoch(epoch) every epoch to reshuffle. workers=None chooses the workers with torch's
    threads (runtime.fit_cpu_threads; `threads`, --threads, fixes torch's); `loader.cpu_plan` says what was chosen.
    torch runs with the plan's threads only while the loader is iterated: its previous count comes back after.
    `indices` (evaluation, one process): only those images, in that order. balanced=True (training, an
    ImageDataset): a ClassBalancedSampler (--balance sampler), distributed or not; set_epoch(epoch) every epoch.
    """
    processes = torch.distributed.get_world_size() if distributed else 1
    plan = fit_cpu_threads(torch.device(device_type), workers, processes, *_work_per_image(dataset, train),
                           threads=threads)
    workers = plan.workers
    if isinstance(dataset, ImageDataset):
        dataset.fill_cache()  # before the workers fork, so they share it
    _seed_transform(dataset, seed)  # workers reseed their copy in _init_worker
    streamed = isinstance(dataset, IterableDataset)  # a stream splits itself (streams.py): no sampler
    if streamed:
        sampler, drop_last = None, False  # stream_batches joins the workers' last partial batches
    elif indices is not None:
        if train or distributed:
            raise ValueError("indices are for an evaluation loader in one process")
        sampler = list(indices)
    elif balanced and train:
        rank, world = (torch.distributed.get_rank(), processes) if distributed else (0, 1)
        sampler = ClassBalancedSampler(dataset.labels, seed, rank, world)
    elif distributed:
        sampler = DistributedSampler(dataset, shuffle=train, seed=seed)
    else:  # the shuffle gets its own generator, so an epoch's order depends on the epoch's seed alone (resume)
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)) if train else None
    rank = torch.distributed.get_rank() if distributed else 0  # ranks augment with different random streams
    loader = _Loader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=device_type == "cuda",
        drop_last=train if drop_last is None else drop_last,
        persistent_workers=workers > 0,
        worker_init_fn=_init_worker,
        generator=torch.Generator().manual_seed(seed + rank),
    )
    loader.cpu_plan = plan
    return loader


def _seed_transform(dataset: Dataset, seed: int) -> None:
    """albumentations draws from its own RNG, which torch's seeding does not touch and fork would copy."""
    transform = getattr(dataset, "transform", None)
    if hasattr(transform, "set_random_seed"):
        transform.set_random_seed(seed)


def _init_worker(worker_id: int) -> None:
    """Give each worker its own random streams, derived from the loader's seeded generator."""
    info = get_worker_info()
    seed = info.seed % 2**32
    random.seed(seed)
    np.random.seed(seed)
    _seed_transform(info.dataset, seed)


def requested_batches(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(images, labels, requested, decoded) per batch of an unshuffled loader: `requested` are the dataset indices
    its sampler asked for, and `decoded` is False where that image failed to decode and another one stands in
    for it (an ImageDataset with return_index=True says which it used). Callers drop those rows, so no image is
    counted twice. A VitftError raised in a worker is raised again with its own message. A stream
    (IterableDataset) has no sampler: `requested` is -1 and every image is kept.
    """
    if isinstance(loader.dataset, IterableDataset):  # a stream skips the images it cannot decode: all are kept
        for images, labels in _worker_errors_unwrapped(loader):
            labels = torch.as_tensor(labels)
            yield images, labels, torch.full((len(labels),), -1), torch.ones(len(labels), dtype=torch.bool)
        return
    order = iter(loader.sampler)
    for batch in _worker_errors_unwrapped(loader):
        images, labels = batch[0], torch.as_tensor(batch[1])
        requested = torch.as_tensor(list(islice(order, len(labels))), dtype=torch.long)
        decoded = batch[2] == requested if len(batch) == 3 else torch.ones(len(labels), dtype=torch.bool)
        yield images, labels, requested, decoded


def _worker_errors_unwrapped(loader: Iterable) -> Iterator:
    """The loader's batches; a VitftError raised in a DataLoader worker is raised again with its own message.

    torch re-raises a worker's exception as "Caught VitftError in DataLoader worker process 0.\nOriginal
    Traceback ..."; the message that says what is wrong is the traceback's last line.
    """
    try:
        yield from loader
    except VitftError as err:
        text = str(err)
        if not text.startswith("Caught VitftError"):
            raise
        last = text.strip().splitlines()[-1]
        raise VitftError(last.removeprefix(f"{VitftError.__module__}.{VitftError.__name__}: ")) from err

"""Data: find the images in a folder, decode them robustly, augment them and batch them.

Bad files never stop a run: files that are not images are dropped (with a warning) when a dataset is built,
by reading only their headers, and files that fail later at full decode (truncated JPEGs) are replaced by the
next good image, flagged in shared memory so that DataLoader workers report back, and summed up once per pass.
"""

from __future__ import annotations

import copy
import glob
import logging
import math
import os
import random
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import cv2
import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from timm.data.constants import DEFAULT_CROP_PCT
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, get_worker_info

from vit_finetune.errors import VitftError
from vit_finetune.models.pos_embed import to_int_pair
from vit_finetune.runtime import CpuPlan, fit_cpu_threads, torch_threads
from vit_finetune.weights.preprocessing import preprocessing

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations would otherwise ask PyPI on every import
import albumentations as A  # noqa: E402
from albumentations.pytorch import ToTensorV2  # noqa: E402

log = logging.getLogger("vitft")

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
VAL_NAMES = ("val", "valid", "validation")
LAYOUTS = (
    "root/train/<class>/ with root/val|valid|validation|test/<class>/, "
    "the Kaggle Intel layout root/seg_train/ (+ seg_test/, seg_pred/), or root/<class>/ split by val_split"
)
INTERPOLATIONS = {
    "bicubic": cv2.INTER_CUBIC,
    "bilinear": cv2.INTER_LINEAR,
    "nearest": cv2.INTER_NEAREST,
    "lanczos": cv2.INTER_LANCZOS4,
    "area": cv2.INTER_AREA,
}
# the same names for PIL, which the eval transform resizes with, as timm does ('area' is PIL's box filter)
PIL_INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
    "area": Image.Resampling.BOX,
}
Sample = tuple[Path, int]

# ----------------------------------------------------------------------------- finding the images


@dataclass
class DatasetSplits:
    """Labelled splits found under a dataset root; labels index `classes`."""

    classes: list[str]
    train: list[Sample]
    val: list[Sample]
    test: list[Sample] | None
    unlabelled: list[Path]
    layout: str

    def class_counts(self) -> dict[str, dict[str, int]]:
        """{split: {class: number of images}} for train, val and (if present) test."""
        splits = {"train": self.train, "val": self.val, "test": self.test}
        counts = {}
        for split, samples in splits.items():
            if samples is not None:
                labels = [label for _, label in samples]
                counts[split] = {c: labels.count(i) for i, c in enumerate(self.classes)}
        return counts


def find_dataset(root: str | Path, val_split: float = 0.1, seed: int = 0) -> DatasetSplits:
    """Detect the folder layout and list labelled samples; fails early, with a fix, on layouts training can't use."""
    root = _unwrap(Path(root).expanduser())
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise VitftError(f"dataset folder {root} {what}; pass the folder that holds your images ({LAYOUTS})")
    sub = {d.name.lower(): d for d in root.iterdir() if d.is_dir()}
    test_dir = pred_dir = None
    if "seg_train" in sub:  # Kaggle Intel: seg_test is its only held-out labelled split, so it validates
        train_dir, val_dir, pred_dir = sub["seg_train"], sub.get("seg_test"), sub.get("seg_pred")
        layout = "Intel (" + "/".join(n for n in ("seg_train", "seg_test", "seg_pred") if n in sub) + ")"
    elif "train" in sub:
        val_dir = next((sub[n] for n in VAL_NAMES if n in sub), None)
        train_dir, test_dir = sub["train"], sub.get("test")
        if val_dir is None:  # train/ + test/: the test folder is all there is to validate on
            val_dir, test_dir = test_dir, None
        layout = " + ".join(f"{d.name}/" for d in (train_dir, val_dir, test_dir) if d)
    else:
        train_dir, val_dir, layout = root, None, "single folder"
    train_dir = _unwrap(train_dir)
    classes = list(_class_dirs(train_dir))
    train = _labelled(train_dir, classes)
    if val_dir:
        val = _labelled(_unwrap(val_dir), classes)
    else:
        train, val = _split(train, val_split, seed)
        layout += f" split {round(100 * (1 - val_split))}/{round(100 * val_split)} (seed {seed})"
    test = _labelled(_unwrap(test_dir), classes) if test_dir else None
    unlabelled = _images_under(_unwrap(pred_dir)) if pred_dir else []
    return DatasetSplits(classes, train, val, test, unlabelled, layout)


def list_images(path_or_paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Image files named by files, folders (searched recursively) or glob patterns, sorted and deduplicated."""
    items = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    found: set[Path] = set()
    for item in items:
        path = Path(item).expanduser()
        matches = [path] if path.exists() else [Path(m) for m in glob.glob(str(path), recursive=True)]
        if not matches:
            raise VitftError(f"{item} matches no file or folder; give image files, folders or globs like 'a/*.jpg'")
        for m in matches:
            if m.is_dir():
                found.update(_images_under(m))
            elif m == path or _is_image(m.name):  # a file named explicitly is taken whatever its suffix
                found.add(m)
    if not found:
        raise VitftError(f"no images ({' '.join(IMAGE_SUFFIXES)}) found in {', '.join(map(str, items))}")
    return sorted(found)


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith(".")


def _images_under(folder: Path) -> list[Path]:
    """Image files below folder, following symlinks and skipping hidden files and folders (e.g. macOS '._x.jpg').

    Each real folder is walked once: a symlink back up the tree (a cycle) or a second link to a folder already
    seen is skipped, so the walk always ends and lists no image twice.
    """
    found = []
    seen = {os.path.realpath(folder)}
    for parent, dirs, files in os.walk(folder, followlinks=True):
        kept = []
        for d in sorted(dirs):  # sorted: which of two links to one folder is kept does not depend on the disk
            real = os.path.realpath(os.path.join(parent, d))
            if not d.startswith(".") and real not in seen:
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        found += [Path(parent) / f for f in files if _is_image(f)]
    return sorted(found)


def _unwrap(folder: Path | None) -> Path | None:
    """Step into a doubled level such as Kaggle's seg_train/seg_train/."""
    if folder is None or not folder.is_dir():
        return folder
    entries = [e for e in folder.iterdir() if not e.name.startswith(".")]
    only = entries[0] if len(entries) == 1 else None
    return only if only is not None and only.is_dir() and only.name == folder.name else folder


def _class_dirs(folder: Path) -> dict[str, Path]:
    dirs = {d.name: d for d in sorted(folder.iterdir()) if d.is_dir() and not d.name.startswith(".")}
    if not dirs:
        what = "has images but no class folders" if _images_under(folder) else "has no images"
        raise VitftError(f"{folder} {what}; accepted layouts: {LAYOUTS}")
    return dirs


def _labelled(folder: Path, classes: list[str]) -> list[Sample]:
    dirs = _class_dirs(folder)
    unknown = [c for c in dirs if c not in classes]
    if unknown:
        raise VitftError(
            f"class folder(s) {', '.join(unknown)} in {folder} are not in the training folder; "
            f"add training images for them or remove them (training classes: {', '.join(classes)})"
        )
    samples = []
    for name, d in dirs.items():
        images = _images_under(d)
        if not images:
            raise VitftError(f"class folder {d} has no images ({' '.join(IMAGE_SUFFIXES)}); add images or remove it")
        samples += [(p, classes.index(name)) for p in images]
    return samples


def _split(samples: list[Sample], val_split: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Seeded split that keeps each class's share in val (at least one image per class with two or more)."""
    if not 0 < val_split < 1:
        raise VitftError(f"val_split must be between 0 and 1 to split off validation images, got {val_split}")
    rng = random.Random(seed)
    train, val = [], []
    for _, group in groupby(sorted(samples, key=lambda s: s[1]), key=lambda s: s[1]):
        items = list(group)
        rng.shuffle(items)
        n_val = min(len(items) - 1, max(1, round(len(items) * val_split)))
        val += items[:n_val]
        train += items[n_val:]
    return sorted(train), sorted(val)


# ----------------------------------------------------------------------------- decoding


def load_rgb(path: str | Path, max_short_side: int | None = None) -> np.ndarray:
    """Decode an image file to (H, W, 3) uint8 RGB, turned upright per EXIF; raises if it cannot be decoded.

    Transparent pixels are composited on white (a transparent background means "nothing here", and the colour
    hidden under it is arbitrary); 16-bit greyscale is scaled to 8 bits. With max_short_side, larger images are
    shrunk so their shorter side is that long (JPEGs decode at 1/2..1/8 scale directly, which is much faster).
    """
    with Image.open(path) as im:
        w, h = im.size
        short, long = _shrunk(w, h, max_short_side)
        size = (short, long) if w <= h else (long, short)  # (width, height) as stored in the file
        if size != (w, h):
            im.draft(None, size)
        ImageOps.exif_transpose(im, in_place=True)
        image = _to_rgb(im)
    if size != (w, h):
        upright = (image.shape[1] >= image.shape[0]) == (w >= h)
        image = cv2.resize(image, size if upright else size[::-1], interpolation=cv2.INTER_AREA)
    return image


def _to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode.startswith("I"):  # 16-bit greyscale ("I;16", "I;16B", or "I" holding 16-bit values)
        grey = (np.asarray(im) / 257).round().clip(0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=2)
    if im.has_transparency_data:  # RGBA, LA, PA, palette or RGB with a transparent colour
        im = Image.alpha_composite(Image.new("RGBA", im.size, "white"), im.convert("RGBA"))
    return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))  # greyscale, palette, CMYK, ...


def _shrunk(w: int, h: int, max_short_side: int | None) -> tuple[int, int]:
    """(short, long) side lengths once the shorter side is at most max_short_side; never enlarges."""
    short, long = min(w, h), max(w, h)
    if max_short_side is None or short <= max_short_side:
        return short, long
    return max_short_side, max(1, round(long * max_short_side / short))


def _probe(path: Path) -> tuple[int, int] | str:
    """(width, height) from the file header alone, or why the file is not a readable image."""
    try:
        with Image.open(path) as im:
            return im.size
    except UnidentifiedImageError:
        return "empty file" if path.stat().st_size == 0 else "not an image"
    except Exception as e:  # unreadable for any other reason: permissions, a broken symlink, a decompression bomb...
        return f"unreadable ({type(e).__name__}: {e})"


def unreadable_reason(path: Path) -> str:
    """Why `path` is not a readable image (for a file left out of a dataset)."""
    probe = _probe(path)
    return probe if isinstance(probe, str) else "not a readable image"


def _few(items: Sequence, k: int = 3) -> str:
    return ", ".join(map(str, items[:k])) + (f" and {len(items) - k} more" if len(items) > k else "")


# ----------------------------------------------------------------------------- transforms


def build_transforms(
    pretrained_cfg: dict,
    img_size: int | tuple[int, int],
    *,
    train: bool,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    color_jitter: float = 0.0,
    strong: bool = False,
) -> Callable[..., dict]:
    """timm-equivalent train/eval preprocessing: `transform(image=HWC uint8)["image"]` is a CHW float tensor.

    Training uses albumentations (cv2 is faster than PIL); evaluation is timm's own eval transform (EvalTransform).
    """
    h, w = to_int_pair(img_size)
    pre = preprocessing(pretrained_cfg)
    name, mean, std = pre.interpolation, pre.mean, pre.std
    if name not in INTERPOLATIONS:
        raise VitftError(f"unknown interpolation {name!r} in pretrained_cfg; use one of {', '.join(INTERPOLATIONS)}")
    if not train:
        return EvalTransform((h, w), pre.crop_pct, name, mean, std)
    interpolation = INTERPOLATIONS[name]
    ops = [
        A.RandomResizedCrop((h, w), scale, ratio, interpolation=interpolation, area_for_downscale="image"),
        A.HorizontalFlip(p=hflip),
    ]
    if color_jitter:
        ops.append(A.ColorJitter(color_jitter, color_jitter, color_jitter, hue=0, p=1.0))
    if strong:
        ops += _strong_ops()
    return A.Compose([*ops, A.Normalize(mean, std, max_pixel_value=255.0), ToTensorV2()])


class EvalTransform:
    """timm's eval transform, step for step, so a model predicts the same in vitft and in timm's pipeline.

    As `timm.data.create_transform(**resolve_data_config(...), is_training=False)` (crop_mode 'center'):
    the shorter side is resized to floor(size / crop_pct) with PIL (whose downscaling filters antialias;
    cv2's do not, which moved probabilities by several points at 64 px), a non-square size keeps the aspect
    ratio with both sides at least floor(side / crop_pct), then a centre crop (zero-padded if too small),
    [0, 1] scaling and normalisation, with torchvision's rounding.
    """

    def __init__(self, size: tuple[int, int], crop_pct: float, interpolation: str, mean: Sequence[float],
                 std: Sequence[float]):
        self.size = size
        self.scale_size = tuple(math.floor(s / crop_pct) for s in size)
        self.resample = PIL_INTERPOLATIONS[interpolation]
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)

    def _resized_hw(self, h: int, w: int) -> tuple[int, int]:
        sh, sw = self.scale_size
        if sh == sw:  # torchvision Resize(int): the shorter side to sh, the longer one truncated
            return (sh, int(sh * w / h)) if h <= w else (int(sh * h / w), sh)
        ratio = min(h / sh, w / sw)  # timm's ResizeKeepRatio
        return round(h / ratio), round(w / ratio)

    def __call__(self, *, image: np.ndarray, **_) -> dict:
        h, w = image.shape[:2]
        rh, rw = self._resized_hw(h, w)
        if (rh, rw) != (h, w):
            image = np.asarray(Image.fromarray(image).resize((rw, rh), self.resample))
        ch, cw = self.size
        if ch > rh or cw > rw:  # torchvision's center_crop pads with zeros first
            top, left = max(0, (ch - rh) // 2), max(0, (cw - rw) // 2)
            image = np.pad(image, ((top, max(0, ch - rh) - top), (left, max(0, cw - rw) - left), (0, 0)))
            rh, rw = image.shape[:2]
        top, left = int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))
        crop = image[top:top + ch, left:left + cw]
        x = (crop.astype(np.float32) / np.float32(255) - self.mean) / self.std
        return {"image": torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))}


def _strong_ops() -> list[A.BasicTransform]:
    """TrivialAugment-like: one randomly chosen photometric or geometric op per image, then random erasing."""
    return [
        A.OneOf(
            [
                A.Affine(rotate=(-30, 30), p=1),
                A.Affine(shear=(-15, 15), p=1),
                A.Affine(translate_percent=(-0.2, 0.2), p=1),
                A.RandomBrightnessContrast(0.4, 0.4, p=1),
                A.HueSaturationValue(p=1),
                A.Sharpen(p=1),
                A.Posterize((4, 7), p=1),
                A.Solarize(threshold_range=(0.5, 1.0), p=1),
                A.Equalize(p=1),
                A.AutoContrast(p=1),
                A.ToGray(p=1),
            ],
            p=0.9,  # the remaining 10% is TrivialAugment's identity op
        ),
        A.CoarseDropout(num_holes_range=(1, 1), hole_height_range=(0.1, 0.4), hole_width_range=(0.1, 0.4), p=0.25),
    ]


# ----------------------------------------------------------------------------- dataset and loader


class ImageDataset(Dataset):
    """(path, label) samples, or bare paths (label -1), as (CHW float tensor, label[, index]) through `transform`.

    cache=True keeps every decoded image in one uint8 buffer that all workers share (see fill_cache), shrunk so the
    shorter side is at most 1.15 * max(img_size / crop_pct, img_size): eval resizes to img_size / crop_pct anyway, while
    train crops lose a little detail, and RAM drops a lot for photos larger than that (full size if img_size is None).
    return_index=True adds the index of the image actually returned (a bad image's replacement, for predict).
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
    ):
        pairs = [(Path(s[0]), int(s[1])) if isinstance(s, (tuple, list)) else (Path(s), -1) for s in samples]
        with ThreadPoolExecutor(8) as pool:  # header reads only; threads hide the latency of network file systems
            probes = list(pool.map(_probe, [p for p, _ in pairs]))
        bad = [f"{p} ({why})" for (p, _), why in zip(pairs, probes) if isinstance(why, str)]
        if bad:
            log.warning("%s: skipped %d of %d files that are not readable images: %s", name, len(bad), len(pairs),
                        _few(bad))
        if len(bad) == len(pairs):
            raise VitftError(f"{name}: no readable images among {len(pairs)} files" + (f": {_few(bad)}" if bad else ""))
        self.unreadable = [p for (p, _), why in zip(pairs, probes) if isinstance(why, str)]
        good = [(p, label, size) for (p, label), size in zip(pairs, probes) if not isinstance(size, str)]
        self.paths, self.labels, self.sizes = (list(column) for column in zip(*good))
        self.failed = torch.zeros(len(self.paths), dtype=torch.bool).share_memory_()  # set by any worker
        self.transform, self.return_index, self.name, self.cache = transform, return_index, name, cache
        self.img_size = img_size
        side = max(to_int_pair(img_size)) if img_size else None
        self.cache_side = math.ceil(1.15 * max(side / crop_pct, side)) if cache and side else None
        self._cache: torch.Tensor | None = None
        self._reported = 0

    def __len__(self) -> int:
        return len(self.paths)

    def with_transform(self, transform: Callable[..., dict], return_index: bool | None = None) -> ImageDataset:
        """The same images, decode cache and failure flags, through another transform (no second decode)."""
        other = copy.copy(self)
        other.transform = transform
        other.return_index = self.return_index if return_index is None else return_index
        return other

    def __getitem__(self, index: int) -> tuple:
        i = index
        for _ in range(len(self)):  # a bad image is replaced by the next good one, so training never stops
            if not self.failed[i]:
                try:
                    image = self._load(i)
                    break
                except Exception as e:
                    self._fail(i, e)
            i = (i + 1) % len(self)
        else:
            raise VitftError(f"{self.name}: none of the {len(self)} images can be decoded, e.g. {_few(self.paths)}")
        x = self.transform(image=image)["image"]
        return (x, self.labels[i], i) if self.return_index else (x, self.labels[i])

    def _load(self, i: int) -> np.ndarray:
        if self._cache is None:
            return load_rgb(self.paths[i], self.cache_side)
        image = self._cache[self._offsets[i] : self._offsets[i + 1]].numpy().reshape(self._shapes[i])
        image.flags.writeable = False  # shared by all workers: an in-place transform must fail, not corrupt it
        return image

    def _fail(self, i: int, error: Exception) -> None:
        self.failed[i] = True
        log.debug("could not decode %s: %s", self.paths[i], error)

    def fill_cache(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Decode every image once into one buffer (threads; progress(done, total)).

        Call it before DataLoader workers start (build_loader does): forked workers then share the buffer
        copy-on-write (it is only read), and torch moves it to shared memory for spawned ones, so RAM holds one copy.
        """
        if not self.cache or self._cache is not None:
            return
        nbytes = [3 * math.prod(_shrunk(w, h, self.cache_side)) for w, h in self.sizes]
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
                self.name, len(failed), len(failed) + len(self.unreadable), _few(failed),
            )
            self._reported = len(failed)


class _Loader(DataLoader):
    """A DataLoader that runs torch with its plan's threads while iterated (restored after), and reports the
    images its ImageDataset skipped at the end of every pass."""

    cpu_plan: CpuPlan | None = None

    def __iter__(self):
        with torch_threads(self.cpu_plan.threads if self.cpu_plan else None):
            yield from super().__iter__()
        if isinstance(self.dataset, ImageDataset):
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
    device_type: str = "cpu",
    distributed: bool = False,
    seed: int = 0,
    drop_last: bool | None = None,
) -> DataLoader:
    """Batches for training (shuffled, seeded, full batches only) or evaluation (in order, all samples).

    With distributed=True (torch.distributed initialised) each rank gets its shard from a DistributedSampler;
    call loader.sampler.set_epoch(epoch) every epoch to reshuffle. workers=None chooses the workers with torch's
    threads (runtime.fit_cpu_threads); `loader.cpu_plan` says what was chosen. torch runs with the plan's threads
    only while the loader is iterated: its previous count comes back after.
    """
    processes = torch.distributed.get_world_size() if distributed else 1
    plan = fit_cpu_threads(torch.device(device_type), workers, processes, *_work_per_image(dataset, train))
    workers = plan.workers
    if isinstance(dataset, ImageDataset):
        dataset.fill_cache()  # before the workers fork, so they share it
    _seed_transform(dataset, seed)  # workers reseed their copy in _init_worker
    if distributed:
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

"""Finding the images: the folder layouts a dataset may have, label files (label_files.py), their train/val/test
splits, and image files named by files, folders or globs. Reads folder listings and image headers only.
find_dataset is the one entry point for --data: it also hands Hugging Face datasets to hf.py and tar shards to
shards.py, and chooses their splits."""
from __future__ import annotations

import glob
import os
import random
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any, Optional

from ..errors import VitftError
from .label_files import is_label_file, read_label_file
from .labels import Label

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
VAL_NAMES = ("val", "valid", "validation")
LAYOUTS = (
    "root/train/<class>/ with root/val|valid|validation|test/<class>/, "
    "the Kaggle Intel layout root/seg_train/ (+ seg_test/, seg_pred/), or root/<class>/ split by val_split"
)
Sample = tuple[Any, Label]  # (a Path or images.ImageSource, its label)


@dataclass
class DatasetSplits:
    """Labelled splits found under a dataset root; labels index `classes`."""

    classes: list[str]
    train: list[Sample]  # or, streamed (--streaming, tar shards), a streams.RecordSource
    val: list[Sample]
    test: list[Sample] | None
    layout: str
    multi_label: bool = False  # labels are tuples of class indices

    @property
    def streamed(self) -> bool:
        """Whether the splits are streams, read in passes (no list of images, no length)."""
        return not isinstance(self.train, list)

    def class_counts(self) -> dict[str, dict[str, int]]:
        """{split: {class: number of images}} for train, val and (if present) test; {} for streams."""
        splits = {"train": self.train, "val": self.val, "test": self.test}
        if self.streamed:
            return {}
        counts = {}
        for split, samples in splits.items():
            if samples is not None:
                labels = [label if isinstance(label, tuple) else (label,) for _, label in samples]
                counts[split] = {c: sum(i in label for label in labels) for i, c in enumerate(self.classes)}
        return counts


def find_dataset(root: str | Path, val_split: float = 0.1, seed: int = 0, *, config: Optional[str] = None,
                 revision: Optional[str] = None, streaming: bool = False, val_data: Optional[str] = None,
                 label_names: Optional[str | list[str]] = None, image_column: Optional[str] = None,
                 label_column: Optional[str] = None) -> DatasetSplits:
    """Detect what --data is and list labelled samples; fails early, with a fix, on data training can't use.

    A folder of images (LAYOUTS); a Hugging Face dataset (hf:NAME with `config` and `revision`, a save_to_disk
    folder, parquet: hf.py), streamed with `streaming`; or tar shards (shards.py), with `val_data` shards to
    validate on. `label_names` (a list, or comma-separated) name the classes of integer labels without names.
    A label file (.csv, .tsv, .jsonl: label_files.py), its columns named by `image_column` and `label_column`.
    """
    if is_label_file(root):
        if streaming:
            raise VitftError(f"--streaming reads a Hugging Face dataset (hf:NAME or parquet); {root} is a label file")
        return _label_file_splits(Path(root), val_split, seed, image_column, label_column)
    if isinstance(label_names, str):
        label_names = [name.strip() for name in label_names.split(",") if name.strip()]
    from .hf import is_hf_source, load_hf_splits
    from .shards import is_shards, load_shard_splits

    data = str(root)
    if is_hf_source(data):
        classes, found, layout, multi = load_hf_splits(data, config, revision, streaming, label_names)
        return _chosen_splits(data, classes, found, layout, val_split, seed, multi)
    if is_shards(data):
        classes, found, layout, multi = load_shard_splits(data, val_data, label_names)
        return _chosen_splits(data, classes, found, layout, val_split, seed, multi)
    if streaming:
        raise VitftError(f"--streaming reads a Hugging Face dataset (hf:NAME or parquet); {data} is neither")
    root = _unwrap(Path(root).expanduser())
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise VitftError(f"dataset folder {root} {what}; pass the folder that holds your images ({LAYOUTS})")
    sub = {d.name.lower(): d for d in root.iterdir() if d.is_dir()}
    test_dir = None
    if "seg_train" in sub:  # Kaggle Intel: seg_test is its only held-out labelled split, so it validates
        train_dir, val_dir = sub["seg_train"], sub.get("seg_test")  # seg_pred is unlabelled: not a split
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
    return DatasetSplits(classes, train, val, test, layout)


def _chosen_splits(data: str, classes: list[str], found: dict[str, Any], layout: str, val_split: float,
                   seed: int, multi_label: bool) -> DatasetSplits:
    """train, val and test among a dataset's named splits, as for folders: validation/valid/val validates (else
    test, else a --val-split share of train; streams need a split of their own)."""
    if "train" not in found:
        raise VitftError(f"{data} has no train split (its splits: {', '.join(found)}); name one 'train'")
    train, test = found["train"], found.get("test")
    val = next((found[n] for n in ("validation", "valid", "val") if n in found), None)
    if val is None and test is not None:
        val, test = test, None
    streamed = not isinstance(train, list)
    if val is None and streamed:
        raise VitftError(f"{data} has no validation split to stream; give one (--val-data for shards, a "
                         "'validation' split for a dataset), or read the dataset without --streaming")
    if val is None:
        train, val = _split(train, val_split, seed)
        layout += f" split {round(100 * (1 - val_split))}/{round(100 * val_split)} (seed {seed})"
    multi_label = multi_label or any(isinstance(label, tuple) for _, label in ([] if streamed else train))
    return DatasetSplits(classes, train, val, test, layout, multi_label)


def _label_file_splits(path: Path, val_split: float, seed: int, image_column: str | None,
                       label_column: str | None) -> DatasetSplits:
    """A label file's rows by their split column, else split by val_split as a single folder is."""
    classes, rows, multi_label = read_label_file(path, image_column, label_column)
    index = {name: i for i, name in enumerate(classes)}
    by_split: dict[str, list[Sample]] = {"train": [], "val": [], "test": []}
    for _, file, names, split in rows:
        ids = tuple(index[n] for n in names)
        by_split[split or "train"].append((file, ids if multi_label else ids[0]))
    train, val, test = by_split["train"], by_split["val"], by_split["test"] or None
    layout = f"label file {path.name}"
    if any(split for *_, split in rows):
        layout += ", train/val/test by row"
    if not val:  # no val rows: split the train rows, and keep the test rows for `evaluate`
        train, val = _split(train, val_split, seed)
        layout += f" split {round(100 * (1 - val_split))}/{round(100 * val_split)} (seed {seed})"
    return DatasetSplits(classes, train, val, test, layout, multi_label)


def list_images(path_or_paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """Image files named by files, folders (searched recursively) or glob patterns, sorted and deduplicated."""
    items = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    if not items:
        raise VitftError("give at least one image file, folder or glob")
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

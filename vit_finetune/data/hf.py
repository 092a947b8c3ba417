"""Hugging Face `datasets` as --data: `hf:NAME` from the Hub (through its cache, honouring HF_HOME and
HF_DATASETS_OFFLINE/HF_HUB_OFFLINE), a `save_to_disk` folder, a parquet file or a folder of parquet files.

The image column (an `Image` feature) and the label column (`ClassLabel`, or a list of `ClassLabel` for multi-label)
are found by type; the ClassLabel's names are the classes. Rows are read from the memory-mapped arrow table one at
a time (ArrowImage), never decoded by `datasets`; with --streaming the dataset is never downloaded or loaded whole:
HubStream reads it as a stream (streams.py). The splits found are handed to datasets.find_dataset, which
chooses train/validation/test as it does for folders.
"""
from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import VitftError
from .labels import Label
from .streams import Record

log = logging.getLogger("vitft")

EXTRA = "pip install 'vit-finetune[datasets]'"
IMAGE_COLUMNS = ("image", "img", "path", "file", "filename", "image_path")  # a plain parquet's image column
LABEL_COLUMNS = ("label", "labels", "class", "category")  # where a label column of names or numbers is looked for
SHUFFLE_BUFFER = 1000  # images a stream's shuffle draws from (datasets' IterableDataset.shuffle)


def is_hf_source(data: str) -> bool:
    """Whether --data names a Hugging Face dataset: hf:NAME, a save_to_disk folder or parquet file(s)."""
    if data.startswith("hf:"):
        return True
    path = Path(data).expanduser()
    if path.is_file():
        return path.suffix == ".parquet"
    if not path.is_dir():
        return False
    saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    return saved or any(path.glob("*.parquet")) or any(path.glob("*/*.parquet"))


def load_hf_splits(data: str, config: Optional[str], revision: Optional[str], streaming: bool,
                   label_names: Optional[list[str]]) -> tuple[list[str], dict[str, Any], str, bool]:
    """(classes, {split name: samples or HubStream}, layout, multi_label) of a Hugging Face dataset."""
    splits = _load(data, config, revision, streaming)
    first = next(iter(splits.values()))
    features = first.features
    if features is None:
        raise VitftError(f"{data} declares no features, so its image and label columns cannot be told apart; "
                         "save it with Image and ClassLabel features")
    image_column, label_column, classes, multi_label = _columns(data, features, label_names)
    if classes is None:  # labels as text: their sorted names are the classes
        if streaming:
            raise VitftError(f"{data}'s label column {label_column!r} holds names, which a stream cannot list "
                             "before it is read; give them with --label-names a,b,c (in class order)")
        classes = sorted(set().union(*(split.unique(label_column) for split in splits.values())) - {None, ""})
    class_index = {name: i for i, name in enumerate(classes)}
    local = None if data.startswith("hf:") else Path(data).expanduser()
    folder = None if local is None else local if local.is_dir() else local.parent
    found: dict[str, Any] = {}
    for name, split in splits.items():
        if streaming:
            length = split.info.splits[name].num_examples if split.info.splits and name in split.info.splits else None
            found[name] = HubStream(split, image_column, label_column, f"{data} [{name}]", length, class_index, folder)
        else:
            found[name] = _samples(split, image_column, label_column, f"{data} [{name}]", class_index, folder)
    layout = (f"Hugging Face dataset{' (streamed)' if streaming else ''}, image column {image_column!r}, "
              f"label column {label_column!r}, splits {'/'.join(splits)}")
    return classes, found, layout, multi_label


def _datasets():
    try:
        import datasets
    except ImportError:
        raise VitftError(f"reading a Hugging Face dataset needs the datasets package: {EXTRA}") from None
    return datasets


def _load(data: str, config: Optional[str], revision: Optional[str], streaming: bool) -> dict:
    """{split name: Dataset or IterableDataset}."""
    datasets = _datasets()
    try:
        if data.startswith("hf:"):
            _check_hub(data)
            loaded = datasets.load_dataset(data[3:], config, revision=revision, streaming=streaming)
        else:
            path = Path(data).expanduser()
            if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
                if streaming:
                    raise VitftError(f"{data} is a save_to_disk folder, already on this disk: drop --streaming")
                loaded = datasets.load_from_disk(str(path))
            elif path.is_file():
                loaded = datasets.load_dataset("parquet", data_files={"train": str(path)}, streaming=streaming)
            else:
                loaded = datasets.load_dataset(str(path), streaming=streaming)
    except VitftError:
        raise
    except Exception as err:  # not found, no such config or revision, a malformed file...
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise VitftError(f"cannot load the Hugging Face dataset {data}: {why}") from err
    if isinstance(loaded, (datasets.Dataset, datasets.IterableDataset)):
        return {"train": loaded}
    return dict(loaded)


def _check_hub(data: str) -> None:
    """Fail at once when the Hub cannot be reached and no offline mode says to use the cache."""
    from ..weights.download import hub_unreachable

    offline = any(os.environ.get(v, "0").lower() in ("1", "true", "yes")
                  for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    why = None if offline else hub_unreachable()
    if why:
        raise VitftError(f"the Hub cannot be reached ({why}) to load {data}; set HF_DATASETS_OFFLINE=1 to use "
                         "your local cache, or pass a local save_to_disk or parquet folder as --data")


def _columns(data: str, features: dict, label_names: Optional[list[str]]
             ) -> tuple[str, str, Optional[list[str]], bool]:
    """(image column, label column, classes, multi_label) found by feature type; classes None: a column of names
    (strings) without --label-names, whose classes are the names it holds."""
    datasets = _datasets()
    image = next((k for k, f in features.items() if isinstance(f, datasets.Image)), None)
    image = image or next((k for k in IMAGE_COLUMNS if k in features and _holds_images(features[k])), None)
    if image is None:
        raise VitftError(f"{data} has no image column (an Image feature, or paths or {{bytes, path}} in a column "
                         f"called {'/'.join(IMAGE_COLUMNS)}) among {', '.join(features)}; cast the column that "
                         "holds the images with cast_column(name, datasets.Image())")
    for name, feature in features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, datasets.ClassLabel) or isinstance(inner, datasets.ClassLabel):
            names = list((feature if isinstance(feature, datasets.ClassLabel) else inner).names)
            return image, name, names, not isinstance(feature, datasets.ClassLabel)
    numbers = next((k for k in LABEL_COLUMNS if k in features and getattr(features[k], "dtype", "")
                    .startswith("int")), None)
    text = next((k for k in LABEL_COLUMNS if k in features and getattr(features[k], "dtype", "") == "string"), None)
    if text is not None:
        return image, text, list(label_names) if label_names else None, False
    if numbers is not None and label_names:
        return image, numbers, list(label_names), False
    if numbers is not None:
        raise VitftError(f"{data}'s label column {numbers!r} holds numbers without names; give them with "
                         "--label-names a,b,c (in class order) or cast it to a ClassLabel")
    raise VitftError(f"{data} has no label column (a ClassLabel feature, or names in a column called "
                     f"{'/'.join(LABEL_COLUMNS)}) among {', '.join(features)}")


def _holds_images(feature: Any) -> bool:
    """Whether a column of parquet written without datasets' features holds images: paths, or {bytes, path}."""
    if isinstance(feature, dict):
        return getattr(feature.get("bytes"), "dtype", "") == "binary" and "path" in feature
    return getattr(feature, "dtype", "") == "string"


def _image(cell: dict, folder: Optional[Path]) -> bytes | Path:
    """An image column's cell: its encoded bytes, or the file at its path (relative: to `folder`, the local
    dataset's), read later so that a missing file is counted as images that cannot be read are."""
    if cell["bytes"] is not None:
        return cell["bytes"]
    path = Path(cell["path"]).expanduser()
    return folder / path if folder is not None and not path.is_absolute() else path


class ArrowImages:
    """The image column of a datasets.Dataset, read one row at a time as the encoded image (not decoded)."""

    def __init__(self, dataset: Any, column: str, name: str, folder: Optional[Path]):
        from datasets import Image

        self.rows = dataset.select_columns([column]).cast_column(column, Image(decode=False))
        self.column, self.name, self.folder = column, name, folder

    def read(self, index: int) -> bytes:
        image = _image(self.rows[index][self.column], self.folder)
        return image if isinstance(image, bytes) else image.read_bytes()


@dataclass(frozen=True, order=True)
class ArrowImage:
    """One row's image of an arrow table (an images.ImageSource): ImageDataset reads it as it reads a file."""

    index: int
    images: ArrowImages = field(compare=False, repr=False)

    def read_bytes(self) -> bytes:
        return self.images.read(self.index)

    def __str__(self) -> str:
        return f"{self.images.name}#{self.index}"


def _samples(dataset: Any, image_column: str, label_column: str, name: str,
             class_index: dict[str, int], folder: Optional[Path]) -> list[tuple[ArrowImage, Label]]:
    """(image, label) of every row with a label; rows without one are counted and left out."""
    images = ArrowImages(dataset, image_column, name, folder)
    samples, unlabelled = [], 0
    for index, value in enumerate(dataset.select_columns([label_column])[label_column]):
        label = _label(value, class_index)
        if label is None:
            unlabelled += 1
        else:
            samples.append((ArrowImage(index, images), label))
    if unlabelled:
        log.warning("%s: left out %d row(s) without a label", name, unlabelled)
    return samples


def _label(value: Any, class_index: dict[str, int]) -> Optional[Label]:
    """A ClassLabel's index (-1: none), a class name's (its class_index; an unknown name: none), or
    a list of indices as a sorted tuple (empty: none)."""
    if isinstance(value, str):
        return class_index.get(value)
    if isinstance(value, (list, tuple)):
        return tuple(sorted(set(int(v) for v in value if v is not None and v >= 0))) or None
    return None if value is None or value < 0 else int(value)


class HubStream:
    """A split of a streamed Hugging Face dataset as a streams.RecordSource: split between the ranks with
    datasets.distributed.split_dataset_by_node, and between each rank's DataLoader workers by datasets itself
    (by shard: files), shuffled with datasets' buffer shuffle."""

    def __init__(self, dataset: Any, image_column: str, label_column: str, name: str, length: Optional[int],
                 class_index: dict[str, int], folder: Optional[Path]):
        from datasets import Image

        self.dataset = dataset.select_columns([image_column, label_column]).cast_column(image_column,
                                                                                        Image(decode=False))
        self.image_column, self.label_column, self.name, self.length = image_column, label_column, name, length
        self.class_index = class_index  # class name -> index, for a label column of names
        self.folder = folder  # what relative image paths are relative to

    def records(self, rank: int, world: int, shuffle_seed: Optional[int]) -> Iterator[Record]:
        from datasets.distributed import split_dataset_by_node

        dataset = split_dataset_by_node(self.dataset, rank, world) if world > 1 else self.dataset
        if shuffle_seed is not None:
            dataset = dataset.shuffle(seed=shuffle_seed, buffer_size=SHUFFLE_BUFFER)
        for row in dataset:
            label, cell = _label(row[self.label_column], self.class_index), row[self.image_column]
            if label is None:
                continue
            image = _image(cell, self.folder)
            yield cell.get("path") or f"{self.name}#crc{zlib.crc32(image)}", image, label

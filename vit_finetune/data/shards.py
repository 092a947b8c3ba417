"""WebDataset tar shards as --data, and write_shards, which moves any dataset --data accepts into them.

`--data 'shards/train-{000000..000099}.tar'`: brace patterns, local paths or any URL webdataset opens. A sample is
the tar members that share a key: the image (jpg, jpeg, png or webp) and its label, `cls` (a class index) or
`json` ({"label": index or name} or {"labels": [...]}, a list making the task multi-label), as timm's `wds`
reader reads them. The class names come from classes.json or classes.txt beside the shards, or --label-names.
Shards are split between DataLoader workers, and their samples between DDP ranks (ShardStream), so that a pass
reads each image once.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import tarfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..errors import VitftError
from ..files import atomic_write
from .images import few, open_image
from .labels import Label
from .streams import Record

if TYPE_CHECKING:
    from .datasets import DatasetSplits

log = logging.getLogger("vitft")

EXTRA = "pip install 'vit-finetune[webdataset]'"
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")
CLASS_FILES = ("classes.json", "classes.txt")
SHUFFLE_BUFFER = 1000  # samples a shuffled pass draws from, across the shards one worker reads


def is_shards(data: str) -> bool:
    """Whether --data names tar shards: a .tar path or URL, with or without a brace pattern."""
    return data.split("?")[0].rstrip("}").endswith((".tar", ".tar.gz", ".tgz")) or (".tar" in data and "{" in data)


def shard_urls(pattern: str) -> list[str]:
    """The shards a brace pattern names, in order; local ones must exist."""
    from braceexpand import braceexpand

    urls = list(braceexpand(pattern))
    missing = [u for u in urls if "://" not in u and not u.startswith("pipe:") and not Path(u).expanduser().exists()]
    if missing:
        raise VitftError(f"{len(missing)} of the {len(urls)} shards of {pattern} do not exist: {few(missing)}")
    return [str(Path(u).expanduser()) if "://" not in u and not u.startswith("pipe:") else u for u in urls]


def load_shard_splits(data: str, val_data: Optional[str], label_names: Optional[list[str]]
                      ) -> tuple[list[str], dict[str, Any], str, bool]:
    """(classes, {"train": ShardStream[, "val": ShardStream]}, layout, multi_label) of --data (and --val-data)
    shards; multi_label when the first sample's label is a list."""
    _webdataset()
    found = {"train": ShardStream(shard_urls(data), data)}
    if val_data:
        found["val"] = ShardStream(shard_urls(val_data), val_data)
    classes = list(label_names) if label_names else _class_file(found["train"].urls[0])
    if not classes:
        raise VitftError(f"no class names for {data}: write classes.json or classes.txt (one name a line, in "
                         "class-index order) beside the shards, or pass --label-names a,b,c")
    for stream in found.values():
        stream.classes = classes
    shards = " + ".join(f"{len(s.urls)} {name} shard{'s' * (len(s.urls) != 1)}" for name, s in found.items())
    first = next(found["train"].records(0, 1, None), None)
    return classes, found, f"WebDataset, {shards}", first is not None and isinstance(first[2], tuple)


def _webdataset():
    try:
        import webdataset
    except ImportError:
        raise VitftError(f"reading WebDataset shards needs the webdataset package: {EXTRA}") from None
    return webdataset


def _class_file(first_shard: str) -> Optional[list[str]]:
    """The class names in classes.json (a list) or classes.txt beside a local shard."""
    folder = Path(first_shard).parent
    for name in CLASS_FILES:
        path = folder / name
        if "://" not in first_shard and path.exists():
            text = path.read_text(encoding="utf-8")
            names = json.loads(text) if name.endswith(".json") else [line.strip() for line in text.splitlines()]
            return [str(n) for n in names if str(n)]
    return None


class ShardStream:
    """Tar shards as a streams.RecordSource. A rank's DataLoader workers take whole shards (shard i of the pass's
    order goes to worker i mod workers); the ranks split each shard's samples (sample j of shard s goes to rank
    (j + s) mod processes), so their shares differ by an image at most whatever the shards' sizes, and one epoch
    of images // (batch x processes) steps reads each image once. Every rank reads every shard (decoding only its
    own samples). A shuffled pass reorders the shards and draws samples from a buffer."""

    def __init__(self, urls: list[str], name: str):
        self.urls, self.name, self.length = urls, name, None
        self.classes: list[str] = []

    def records(self, rank: int, world: int, shuffle_seed: Optional[int]) -> Iterator[Record]:
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        shards = list(enumerate(self.urls))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(shards)
        records = self._read(shards[worker_id::workers], rank, world)
        return _buffer_shuffled(records, shuffle_seed) if shuffle_seed is not None else records

    def _read(self, shards: list[tuple[int, str]], rank: int, world: int) -> Iterator[Record]:
        from webdataset.tariterators import tarfile_samples

        def skip(error: Exception) -> bool:  # an empty or broken shard is skipped, with a warning
            log.warning("%s: skipped a shard that cannot be read (%s)", self.name, error)
            return True

        for index, url in shards:
            unusable = []
            for j, sample in enumerate(_samples(tarfile_samples([{"url": url}], handler=skip))):
                if (j + index) % world != rank:
                    continue
                image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
                label = self._label(sample)
                if image is None or label is None:
                    unusable.append(sample["__key__"])
                    continue
                yield f"{url}/{sample['__key__']}", image, label
            if unusable:
                log.warning("%s: left out %d sample(s) without an image (%s) or a label (cls, json) in %s: %s",
                            self.name, len(unusable), ", ".join(IMAGE_KEYS), url, few(unusable))

    def _label(self, sample: dict) -> Optional[Label]:
        if "cls" in sample:
            value: Any = int(sample["cls"].decode().strip())
        elif "json" in sample:
            meta = json.loads(sample["json"])
            value = meta.get("labels", meta.get("label")) if isinstance(meta, dict) else meta
        else:
            return None
        values = value if isinstance(value, list) else [value]
        indices = [self.classes.index(v) if isinstance(v, str) and v in self.classes else v for v in values]
        if not all(isinstance(i, int) and 0 <= i < len(self.classes) for i in indices):
            return None
        return tuple(sorted(set(indices))) if isinstance(value, list) else indices[0]


def _samples(grouped: Iterable[dict]) -> Iterator[dict]:
    """webdataset's samples split by the whole name before the extension: it keys a member by its name up to the
    first dot, so 'a.b.jpg' and 'a.b.cls' are fields 'b.jpg' and 'b.cls' of sample 'a' (with 'a.jpg' too if it is
    beside them); here they are sample 'a.b', with fields 'jpg' and 'cls'."""
    for sample in grouped:
        split: dict[str, dict] = {}
        for field, value in sample.items():
            if not field.startswith("__"):
                stem, _, ext = field.rpartition(".")
                key = f"{sample['__key__']}.{stem}" if stem else sample["__key__"]
                split.setdefault(key, {"__key__": key})[ext] = value
        yield from split.values()


def _buffer_shuffled(records: Iterable[Record], seed: int, size: int = SHUFFLE_BUFFER) -> Iterator[Record]:
    """Records in a seeded random order drawn from a buffer of `size`, as webdataset's shuffle stage does."""
    rng, buffer = random.Random(seed), []
    for record in records:
        buffer.append(record)
        if len(buffer) >= size:
            yield buffer.pop(rng.randrange(len(buffer)))
    rng.shuffle(buffer)
    yield from buffer


def write_shards(splits: DatasetSplits, out: str | Path, shard_size: int = 1000,
                 overwrite: bool = False) -> dict[str, list[Path]]:
    """Write each split of a dataset (datasets.find_dataset's) as tar shards of `shard_size` samples:
    OUT/train-000000.tar ..., val-..., test-..., and OUT/classes.json. Images keep their encoding (JPEG, PNG,
    WebP; others become PNG); labels are `cls`, or `json` {"labels": [...]} for several. Each shard is written
    to a temporary name and renamed: a crash leaves no half-written shard. Unreadable images are counted and
    left out. Shards already in OUT are refused (new ones would mix with the stale), or removed with
    `overwrite`."""
    if shard_size < 1:
        raise VitftError(f"--shard-size must be at least 1, got {shard_size}")
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise VitftError(f"{out} is a file, not a folder: give a folder for the shards")
    sources = [Path(url).resolve() for split in (splits.train, splits.val, splits.test)
               for url in getattr(split, "urls", ()) if "://" not in url]
    if any(source.parent == out.resolve() for source in sources):
        raise VitftError(f"{out} holds the shards being read: write the new shards to another folder")
    _clear_old_shards(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {}
    for split in ("train", "val", "test"):
        samples = getattr(splits, split)
        if samples:
            written[split] = _write_split(_split_records(samples), out, split, shard_size)
    atomic_write(out / "classes.json", lambda tmp: tmp.write_text(json.dumps(splits.classes, indent=1)))
    return written


def _clear_old_shards(out: Path, overwrite: bool) -> None:
    """Remove the shards (and half-written ones) of an earlier write to `out` with `overwrite`, else refuse."""
    old = [p for split in ("train", "val", "test") for p in out.glob(f"{split}-[0-9]*.tar")]
    if old and not overwrite:
        raise VitftError(f"{out} already holds {len(old)} shard(s) ({few([p.name for p in old])}); pass "
                         "--overwrite to replace them, or give an empty folder")
    for path in old + list(out.glob(".*-[0-9]*.tar.tmp")):
        path.unlink()
    if old:
        (out / "classes.json").unlink(missing_ok=True)


def _split_records(samples: Any) -> Iterator[tuple[str, Any, Label]]:
    """(name, image, label) of a split: a list of samples, or a stream read whole in one process."""
    if isinstance(samples, list):
        return ((str(image), image, label) for image, label in samples)
    return samples.records(0, 1, None)


def _write_split(records: Iterable[tuple[str, Any, Label]], out: Path, split: str, shard_size: int) -> list[Path]:
    shards: list[Path] = []
    tar, count, bad = None, 0, []
    for name, image, label in records:
        try:
            data, ext = _encoded(image)
        except Exception:
            bad.append(name)
            continue
        if count % shard_size == 0:
            _close(tar, shards)
            path = out / f"{split}-{len(shards):06d}.tar"
            tar = (tarfile.open(out / f".{path.name}.tmp", "w"), path)
        key = f"{count:09d}"
        labels = {"cls": str(label).encode()} if isinstance(label, int) else \
            {"json": json.dumps({"labels": list(label)}).encode()}
        for suffix, payload in ({ext: data} | labels).items():
            info = tarfile.TarInfo(f"{key}.{suffix}")
            info.size, info.mtime = len(payload), int(time.time())
            tar[0].addfile(info, io.BytesIO(payload))
        count += 1
    _close(tar, shards)
    if bad:
        log.warning("%s: left out %d image(s) that cannot be read: %s", split, len(bad), few(bad))
    return shards


def _close(tar: Optional[tuple[tarfile.TarFile, Path]], shards: list[Path]) -> None:
    if tar is not None:
        tar[0].close()
        os.replace(tar[0].name, tar[1])
        shards.append(tar[1])


def _encoded(image: Any) -> tuple[bytes, str]:
    """(the image's bytes, their extension): as they are for JPEG, PNG and WebP, else re-encoded as PNG."""
    data = image if isinstance(image, bytes) else Path(image).read_bytes() if isinstance(image, (str, Path)) \
        else image.read_bytes()
    with open_image(data) as im:
        kind = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}.get(im.format or "")
        if kind:
            im.verify()
            return data, kind
        buffer = io.BytesIO()
        im.convert("RGB").save(buffer, "PNG")
        return buffer.getvalue(), "png"

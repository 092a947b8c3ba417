"""Prediction on loose images: top-k labels per image as batches complete, in sorted path order; files that
cannot be read become rows with an error, never an exception. With `output`, the rows go to a CSV or JSONL file
(or stream) as `vitft predict` writes them."""
from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional, Union

import torch

from ..data.images import unreadable_reason
from ..data.loaders import ImageDataset
from ..data.transforms import build_transforms
from ..errors import VitftError
from ..files import atomic_write, printable, printable_tree
from ..models.vit import VisionTransformer
from ..runtime import choose_precision, model_widths
from ..weights.preprocessing import preprocessing
from .inference import (
    ImagesLike,
    ModelLike,
    ProgressFn,
    infer,
    is_multi_label,
    label_names,
    prepare_classifier,
    thresholds,
)

DECODE_ERROR = "could not be decoded (truncated or corrupt image)"
FORMATS = ("csv", "jsonl")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
REPR_CLASSES = 5  # class names a Predictions' repr shows


@dataclass
class Prediction:
    """Top-k labels of one image, most probable first; `error` says why a file could not be read (labels empty)."""

    path: str
    labels: list[str]
    probs: list[float]
    error: Optional[str] = None

    @property
    def label(self) -> Optional[str]:
        return self.labels[0] if self.labels else None

    def to_dict(self) -> dict:
        if self.error is not None:
            return {"path": self.path, "error": self.error}
        return {"path": self.path, "labels": list(self.labels), "probs": list(self.probs)}


class Predictions(Iterator[Prediction]):
    """What `predict` returns: an iterator of Prediction rows (`.path`, `.labels` and `.probs` most probable first,
    `.label` the top one, `.error` for a file that could not be read), one per file in sorted path order, as
    batches complete. It can be iterated once: `list(predictions)` keeps the rows.

    `total` is the number of files, `top_k` the number of labels per row, `classes` the model's class names.
    """

    def __init__(self, rows: Iterator[Prediction], total: int, top_k: int, classes: list[str]):
        self._rows, self.total, self.top_k, self.classes = rows, total, top_k, classes

    def __iter__(self) -> Predictions:
        return self

    def __next__(self) -> Prediction:
        return next(self._rows)

    def __repr__(self) -> str:
        shown = ", ".join(self.classes[:REPR_CLASSES]) + (", ..." if len(self.classes) > REPR_CLASSES else "")
        return (f"Predictions({self.total} image(s), top-{self.top_k} of {len(self.classes)} classes: {shown}; "
                f"iterate or list() it for Prediction rows)")


def predict(
    model: ModelLike,
    inputs: ImagesLike,
    top_k: int = 3,
    img_size: Optional[int] = None,
    tta: bool = False,
    batch_size: int = 64,
    workers: Optional[int] = None,
    device: str = "auto",
    precision: str = "auto",
    arch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    pretrained: bool = False,
    output: Union[str, os.PathLike, IO[str], None] = None,
    fmt: Optional[str] = None,
    threads: Optional[int] = None,
    threshold: Optional[float] = None,
) -> Predictions:
    """Top-k labels for image files, folders (recursive) or globs: a Predictions iterator of Prediction rows
    (path, labels, probs, label, error), yielded as batches complete.

    Rows come in sorted path order. A file that is not a readable image, or fails to decode, gives a Prediction
    with `error` set (never an exception). Model and inputs are checked now; images are read while iterating.
    `model` as `evaluate` takes it (a timm name needs `pretrained=True`). With `output` (a file path, written
    atomically, or an open text stream such as sys.stdout), every row is written there before predict returns,
    as CSV (path, label_1, prob_1, ..., error) or JSONL (`fmt`; default: from the path's suffix, else csv), and
    the Predictions returned iterate over the rows written. A multi-label model gives every label whose
    probability reaches its class's threshold (chosen in training; `threshold` for all classes), most probable
    first, however many that is (top_k does not apply).
    """
    fmt = prediction_format(fmt, output)
    dev, paths, net = prepare_classifier(model, inputs, arch, pretrained, img_size, top_k, batch_size, device,
                                         precision, "predict")
    precision = choose_precision(dev, precision, model_widths(net)).precision
    classes = label_names(net)
    cuts = thresholds(net, threshold) if is_multi_label(net) else None
    k = len(classes) if cuts is not None else min(top_k, len(classes))
    size = tuple(net.patch_embed.img_size)
    transform = build_transforms(net.pretrained_cfg, size, train=False)
    try:
        dataset = ImageDataset(paths, transform, img_size=size, return_index=True, name="inputs",
                               crop_pct=preprocessing(net.pretrained_cfg).crop_pct)
    except VitftError:  # not one readable image: every row is an error
        rows = iter([Prediction(str(p), [], [], unreadable_reason(p)) for p in paths])
    else:
        rows = _predict_rows(net, dataset, paths, classes, k, tta, batch_size, workers, dev, precision, progress,
                             threads, cuts)
    predictions = Predictions(rows, len(paths), k, classes)
    if output is None:
        return predictions
    if isinstance(output, (str, os.PathLike)):
        written: list[Prediction] = []

        def write(tmp: Path) -> None:
            with open(tmp, "w", newline="", encoding="utf-8") as f:
                written.extend(write_predictions(predictions, f, fmt, k))

        atomic_write(Path(output).expanduser(), write)
    else:
        written = write_predictions(predictions, output, fmt, k)
    return Predictions(iter(written), len(paths), k, classes)


def prediction_format(fmt: Optional[str], output: Union[str, os.PathLike, IO[str], None]) -> str:
    """csv or jsonl: `fmt` if given, else jsonl for an output path ending in .jsonl, .json or .ndjson, else csv."""
    suffix = Path(output).suffix.lower() if isinstance(output, (str, os.PathLike)) else ""
    fmt = (fmt or ("jsonl" if suffix in JSONL_SUFFIXES else "csv")).lower()
    if fmt not in FORMATS:
        raise VitftError(f"unknown --format {fmt!r}; use csv or jsonl")
    return fmt


def _predict_rows(net: VisionTransformer, dataset: ImageDataset, paths: list[Path], classes: list[str], k: int,
                  tta: bool, batch_size: int, workers: Optional[int], device: torch.device, precision: str,
                  progress: Optional[ProgressFn], threads: Optional[int],
                  cuts: Optional[list[float]] = None) -> Iterator[Prediction]:
    """Rows in path order; with `cuts` (multi-label thresholds) only the labels that reach them."""
    position = {p: i for i, p in enumerate(paths)}
    ready = {position[p]: Prediction(str(p), [], [], unreadable_reason(p)) for p in dataset.unreadable}
    next_row = done = 0
    try:
        for requested, decoded, logp in infer(net, dataset, batch_size, workers, device, precision, tta,
                                              progress, threads):
            probs, idx = logp.exp().topk(k, dim=1)
            for r, ok, p, j in zip(requested.tolist(), decoded.tolist(), probs.tolist(), idx.tolist()):
                path = dataset.paths[r]
                kept = [(c, v) for c, v in zip(j, p) if cuts is None or v >= cuts[c]]
                ready[position[path]] = Prediction(str(path), [classes[c] for c, _ in kept],
                                                   [round(v, 6) for _, v in kept]) if ok else (
                    Prediction(str(path), [], [], DECODE_ERROR))
            done += len(requested)
            while next_row in ready:
                yield ready.pop(next_row)
                next_row += 1
    except VitftError as err:  # no image at all could be decoded
        for path in dataset.paths[done:]:
            ready[position[path]] = Prediction(str(path), [], [], f"{DECODE_ERROR}: {err}".splitlines()[0])
    while next_row in ready:
        yield ready.pop(next_row)
        next_row += 1


def write_predictions(rows: Iterable[Prediction], file: IO[str], fmt: str, top_k: int) -> list[Prediction]:
    """Write rows as CSV (path, label_1, prob_1, ..., error) or JSONL, each as it comes; returns the rows."""
    written = []
    writer = None
    if fmt == "csv":
        writer = csv.writer(file, lineterminator="\n")
        header = ["path"]
        for i in range(1, top_k + 1):
            header += [f"label_{i}", f"prob_{i}"]
        writer.writerow(header + ["error"])
    for row in rows:
        written.append(row)
        if writer is not None:
            cells = [printable(row.path)]
            for i in range(top_k):
                cells += [printable(row.labels[i]), f"{row.probs[i]:.6f}"] if i < len(row.labels) else ["", ""]
            writer.writerow(cells + [printable(row.error or "")])
        else:
            file.write(json.dumps(printable_tree(row.to_dict())) + "\n")
        file.flush()
    return written

"""Evaluation on a labelled dataset and prediction on loose images.

`evaluate` matches the data's class folders to the model's label names by name, runs inference (optionally with
horizontal-flip test-time augmentation), computes the metrics with numpy (top-1, top-5, cross-entropy, per-class
precision/recall/F1, confusion matrix) and writes report.json, predictions.csv, confusion_matrix.png and mistakes.png.
`predict` yields top-k labels per image as batches complete; files that cannot be read become rows with an error.
`evaluate_command` and `predict_command` are what the `vitft evaluate` / `vitft predict` commands run.
"""
from __future__ import annotations

import copy
import csv
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from timm.data.constants import DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from .data import (ImageDataset, build_loader, build_transforms, find_dataset, list_images, load_rgb, printable,
                   printable_tree, unreadable_reason)
from .errors import VitftError
from .model import VisionTransformer
from .pos_embed import _pair
from .refs import RefKind, parse_ref
from .runtime import check_precision, compute_context, resolve_device
from .weights import atomic_write, describe_weights, load_model

log = logging.getLogger("vitft")

ModelLike = Union[str, os.PathLike, VisionTransformer]
ProgressFn = Callable[[int, int], None]  # (images done, total)
SPLITS = ("train", "val", "test")
DECODE_ERROR = "could not be decoded (truncated or corrupt image)"
N_CONFUSED_PAIRS = 10
N_MISTAKES = 16
THUMB_PX = 260  # mistakes.png cells are 2.6 in at 100 dpi


# ----------------------------------------------------------------------------- results


@dataclass
class EvalReport:
    """Metrics of one evaluation; `to_dict()` is what report.json holds. Fractions are in [0, 1]."""

    accuracy: float
    top5: Optional[float]  # None with 5 classes or fewer
    loss: float  # mean cross-entropy (of the flip-averaged probabilities with TTA)
    macro_f1: float  # mean F1 over the classes present in the data
    weighted_f1: float  # F1 weighted by support
    per_class: dict[str, dict]  # class -> precision, recall, f1, support (None where undefined)
    confusion: np.ndarray  # counts, rows: true class, columns: predicted class, in `classes` order
    classes: list[str]  # the model's classes
    confused_pairs: list[dict]  # most frequent (true, predicted) mistakes
    images_per_s: float
    num_images: int
    absent_classes: list[str]  # model classes with no image in the data (support 0)
    skipped: list[str]  # files left out: not readable images, or failed to decode
    model: dict  # source, architecture, pretrained_cfg_source, num_classes, label_names_from
    data: dict  # root, split, layout, num_images
    preprocessing: dict  # img_size, mean, std, interpolation, crop_pct, tta
    runtime: dict  # device, precision, batch_size
    predictions: list[dict] = field(default_factory=list, repr=False)  # path, true_label, predicted_label, confidence
    output: Optional[Path] = None  # folder the files were written to

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "top5": self.top5,
            "loss": self.loss,
            "macro_f1": self.macro_f1,
            "weighted_f1": self.weighted_f1,
            "num_images": self.num_images,
            "images_per_s": self.images_per_s,
            "per_class": self.per_class,
            "confused_pairs": self.confused_pairs,
            "classes": list(self.classes),
            "confusion": np.asarray(self.confusion).tolist(),
            "absent_classes": list(self.absent_classes),
            "skipped": list(self.skipped),
            "model": self.model,
            "data": self.data,
            "preprocessing": self.preprocessing,
            "runtime": self.runtime,
        }

    @classmethod
    def from_dict(cls, values: dict) -> EvalReport:
        """The report `to_dict()` wrote (report.json), without its predictions."""
        kept = {f.name: values[f.name] for f in fields(cls) if f.name not in ("predictions", "output")}
        return cls(**dict(kept, confusion=np.asarray(kept["confusion"])))

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> EvalReport:
        """report.json as written by `write_report`; a VitftError for anything else."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise VitftError(f"cannot read the evaluation report {path} ({type(err).__name__}: {err}); "
                             "write it again with `vitft evaluate`") from err


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
    """The iterator `predict` returns: Predictions in sorted path order, as batches complete.

    `total` is the number of files, `top_k` the number of labels per row, `classes` the model's class names.
    """

    def __init__(self, rows: Iterator[Prediction], total: int, top_k: int, classes: list[str]):
        self._rows, self.total, self.top_k, self.classes = rows, total, top_k, classes

    def __iter__(self) -> Predictions:
        return self

    def __next__(self) -> Prediction:
        return next(self._rows)


# ----------------------------------------------------------------------------- shared helpers


def label_names(model: VisionTransformer) -> list[str]:
    """The model's class names, else (with a warning) its class indices as strings."""
    names = model.pretrained_cfg.get("label_names")
    if names and len(names) == model.num_classes:
        return [str(n) for n in names]
    log.warning("the model has no label names: labels are class indices")
    return [str(i) for i in range(model.num_classes)]


def _prepare_model(model: ModelLike, arch: Optional[str], img_size) -> tuple[VisionTransformer, Optional[str]]:
    """(model, source string): loads paths/names with load_model; a built model is copied if it must be resized."""
    if isinstance(model, VisionTransformer):
        if img_size is not None and _pair(img_size) != tuple(model.patch_embed.img_size):
            model = copy.deepcopy(model)
            model.set_input_size(_pair(img_size))
        return model, None
    if isinstance(model, torch.nn.Module):
        raise VitftError(f"evaluate/predict take a vitft VisionTransformer or a model path/name, not a "
                         f"{type(model).__name__}")
    return load_model(str(model), arch=arch, img_size=img_size), str(model)


def _preprocessing(model: VisionTransformer, tta: bool) -> dict:
    cfg = model.pretrained_cfg
    return {
        "img_size": list(model.patch_embed.img_size),
        "mean": [float(v) for v in cfg.get("mean", IMAGENET_DEFAULT_MEAN)],
        "std": [float(v) for v in cfg.get("std", IMAGENET_DEFAULT_STD)],
        "interpolation": cfg.get("interpolation", "bicubic"),
        "crop_pct": float(cfg.get("crop_pct", DEFAULT_CROP_PCT)),
        "tta": bool(tta),
    }


def _check_args(batch_size: int, device: str, precision: str) -> torch.device:
    if batch_size < 1:
        raise VitftError(f"--batch-size must be at least 1, got {batch_size}")
    dev = resolve_device(device)
    check_precision(dev, precision)  # an unknown or unusable precision fails now, before any loading
    return dev


def _infer(model: VisionTransformer, dataset: ImageDataset, batch_size: int, workers: Optional[int],
           device: torch.device, precision: str, tta: bool, progress: Optional[ProgressFn]
           ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(requested indices, indices of the images actually used, log-probabilities) per batch, in dataset order.

    A requested image that failed to decode was replaced by another one (used != requested): callers drop it.
    """
    loader = build_loader(dataset, batch_size, train=False, workers=workers, device_type=device.type)
    was_training = model.training
    model.to(device).eval()
    done = 0
    try:
        with torch.inference_mode():
            for x, _, used in _worker_errors_unwrapped(loader):
                x = x.to(device, non_blocking=True)
                with compute_context(device, precision):
                    logits = model(x)
                    flipped = model(torch.flip(x, dims=[3])) if tta else None
                logp = F.log_softmax(logits.float(), dim=1)
                if flipped is not None:  # log of the mean of the two softmaxes
                    both = torch.stack([logp, F.log_softmax(flipped.float(), dim=1)])
                    logp = torch.logsumexp(both, dim=0) - math.log(2)
                requested = torch.arange(done, done + len(used))
                done += len(used)
                yield requested, used.cpu(), logp.cpu()
                if progress:
                    progress(done, len(dataset))
    finally:
        model.train(was_training)


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


# ----------------------------------------------------------------------------- evaluate


def _run_split(model: ModelLike, data: Union[str, os.PathLike]) -> Optional[tuple[float, int]]:
    """(val_split, seed) of the run folder `model` when `data` is the folder it was trained on, else None."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    config = Path(str(model).removeprefix("local-dir:")).expanduser() / "config.json"
    try:
        train = json.loads(config.read_text(encoding="utf-8"))["vitft"]["train"]
        same = os.path.realpath(os.path.expanduser(str(train["data"]))) == \
            os.path.realpath(os.path.expanduser(str(data)))
        return (float(train.get("val_split", 0.1)), int(train.get("seed", 0))) if same else None
    except (OSError, ValueError, KeyError, TypeError):  # not a run folder (or not one of ours)
        return None


def _eval_samples(data: Union[str, os.PathLike], split: Optional[str], val_split: Optional[float] = None,
                  seed: int = 0, explicit: bool = True) -> tuple[list, list[str], dict]:
    """(samples, data classes, data identity) of the split to evaluate.

    Where the data has no validation folder, `val_split` and `seed` split it as `finetune` does; a single
    folder of class folders without `val_split` is evaluated whole. An `explicit` val_split (the user's, not
    a run's) on data that has a validation folder is an error.
    """
    splits = find_dataset(data, 0.1 if val_split is None else val_split, seed)
    root = os.path.abspath(os.path.expanduser(str(data)))
    if explicit and val_split is not None and " split " not in splits.layout:
        raise VitftError(f"--val-split applies to a folder without a validation folder; {data} has one "
                         f"(layout: {splits.layout})")
    if splits.layout.startswith("single folder") and (val_split is None or split == "all"):
        if split not in (None, "all"):
            raise VitftError(f"{data} is a single folder of class folders: it is evaluated whole; --split applies "
                             f"to train/val/test layouts, or with --val-split")
        samples, split, layout = sorted(splits.train + splits.val), "all", "single folder"
    else:
        available = {"train": splits.train, "val": splits.val}
        if splits.test is not None:
            available["test"] = splits.test
        if split is None:
            split = "test" if "test" in available else "val"
        if split not in SPLITS:
            raise VitftError(f"unknown split {split!r}; use one of {', '.join(available)}")
        if split not in available:
            raise VitftError(f"{data} has no {split} split (layout: {splits.layout}); use --split "
                             f"{' or '.join(available)}")
        samples, layout = available[split], splits.layout
    return samples, splits.classes, {"root": root, "split": split, "layout": layout}


def _match_classes(model: VisionTransformer, data_classes: list[str], present: list[int]
                   ) -> tuple[list[str], list[int], str]:
    """(model classes, data class index -> model class index (-1: not in the model), where the names came from)."""
    k = model.num_classes
    if k <= 0:
        raise VitftError("the model has no classifier head (num_classes=0); evaluate a fine-tuned classifier")
    names = model.pretrained_cfg.get("label_names")
    if names:
        names = [str(n) for n in names]
        if len(names) != k:
            raise VitftError(f"the model has {k} outputs but {len(names)} label names; its config.json is "
                             f"inconsistent")
        unknown = [data_classes[i] for i in present if data_classes[i] not in names]
        if unknown:
            shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            raise VitftError(
                f"class{'es' if len(unknown) > 1 else ''} {', '.join(repr(c) for c in unknown)} in the data "
                f"{'are' if len(unknown) > 1 else 'is'} not known to the model (its classes: {shown}); remove "
                f"{'those folders' if len(unknown) > 1 else 'that folder'} or evaluate a model trained on "
                f"{'them' if len(unknown) > 1 else 'it'}")
        return names, [names.index(c) if c in names else -1 for c in data_classes], "model"
    if k != len(data_classes):
        raise VitftError(f"the model has no label names and {k} outputs, but the data has {len(data_classes)} "
                         f"classes ({', '.join(data_classes[:10])}); classes cannot be matched")
    log.warning("the model has no label names: assuming its %d outputs are the data's classes in sorted order (%s)",
                k, ", ".join(data_classes[:10]))
    return list(data_classes), list(range(k)), "data"


def _metrics(y: np.ndarray, logp: torch.Tensor, classes: list[str]) -> dict:
    k = len(classes)
    n = len(y)
    target = torch.as_tensor(y, dtype=torch.long)
    pred = logp.argmax(dim=1).numpy()
    loss = float(-logp.gather(1, target[:, None]).mean())
    top5 = None
    if k > 5:
        top5 = float((logp.topk(5, dim=1).indices == target[:, None]).any(dim=1).float().mean())
    confusion = np.bincount(y * k + pred, minlength=k * k).reshape(k, k)
    tp = np.diag(confusion).astype(float)
    support = confusion.sum(axis=1)
    predicted = confusion.sum(axis=0)
    per_class = {}
    f1s = np.zeros(k)
    for i, name in enumerate(classes):
        precision = tp[i] / predicted[i] if predicted[i] else (0.0 if support[i] else None)
        recall = tp[i] / support[i] if support[i] else None
        if precision is not None and recall is not None:
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            f1s[i] = f1
        else:
            f1 = None
        per_class[name] = {"precision": _num(precision), "recall": _num(recall), "f1": _num(f1),
                           "support": int(support[i])}
    present = support > 0
    pairs = [(int(confusion[i, j]), i, j) for i in range(k) for j in range(k) if i != j and confusion[i, j]]
    pairs.sort(key=lambda t: (-t[0], t[1], t[2]))
    confused = [{"true": classes[i], "predicted": classes[j], "count": c, "fraction_of_true": c / int(support[i])}
                for c, i, j in pairs[:N_CONFUSED_PAIRS]]
    return {
        "accuracy": float((pred == y).mean()),
        "top5": top5,
        "loss": loss,
        "macro_f1": float(f1s[present].mean()),
        "weighted_f1": float((f1s * support).sum() / n),
        "per_class": per_class,
        "confusion": confusion,
        "confused_pairs": confused,
        "absent_classes": [c for c, p in zip(classes, present) if not p],
        "pred": pred,
    }


def _num(value) -> Optional[float]:
    return None if value is None else float(value)


def evaluate(
    model: ModelLike,
    data: Union[str, os.PathLike],
    split: Optional[str] = None,
    img_size: Optional[int] = None,
    tta: bool = False,
    batch_size: int = 64,
    workers: Optional[int] = None,
    device: str = "auto",
    precision: str = "fp32",
    output: Union[str, os.PathLike, None] = None,
    arch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    explain: Optional[str] = None,
    val_split: Optional[float] = None,
    seed: Optional[int] = None,
) -> EvalReport:
    """Evaluate a classifier on a labelled dataset (any layout `finetune` accepts).

    `model`: a run/export folder, weights file (with `arch`), `hf-hub:org/repo`, timm name (its pretrained
    weights), or a built VisionTransformer. `split`: train, val or test (default: test if present, else val).
    Data without a validation folder is split by `val_split` and `seed` (0 by default), as `finetune` splits it;
    a run folder evaluated on the data it was trained on reuses the run's own split, so its validation images
    are the ones training validated on. A single folder of class folders is otherwise evaluated whole. With
    `output`, report.json, predictions.csv, confusion_matrix.png and mistakes.png are written there
    (atomically); without it nothing is written. `explain`: rollout, attention or gradcam (explain.py):
    mistakes.png shows that heat map on each image.
    """
    dev = _check_args(batch_size, device, precision)
    if explain is not None:
        from .explain import METHODS

        if explain not in METHODS:
            raise VitftError(f"unknown explain method {explain!r}; use one of {', '.join(METHODS)}")
    own = _run_split(model, data) if val_split is None else None
    if own is not None:
        val_split, seed = own[0], own[1] if seed is None else seed
    samples, data_classes, data_info = _eval_samples(data, split, val_split, 0 if seed is None else seed,
                                                     explicit=own is None)
    if own is not None and " split " in data_info["layout"]:
        log.info("evaluating on the run's own split of %s: %g%% validation, seed %d, as in training "
                 "(--val-split to split otherwise)", printable(str(data)), 100 * val_split, seed)
    present = sorted({label for _, label in samples})
    net, source = _prepare_model(model, arch, img_size)
    for line in describe_weights(net):
        log.info(line)
    classes, to_model, names_from = _match_classes(net, data_classes, present)
    missing = [c for c in classes if c not in {data_classes[i] for i in present}]
    if missing:
        log.warning("model class(es) with no image in the data (support 0): %s", ", ".join(missing[:20]))

    size = tuple(net.patch_embed.img_size)
    transform = build_transforms(net.pretrained_cfg, size, train=False)
    dataset = ImageDataset([(p, to_model[label]) for p, label in samples], transform, img_size=size,
                           crop_pct=net.pretrained_cfg.get("crop_pct", DEFAULT_CROP_PCT), return_index=True,
                           name=f"{data_info['split']} images")
    skipped = [str(p) for p in dataset.unreadable]
    keep, logps = [], []
    start = time.perf_counter()
    for requested, used, logp in _infer(net, dataset, batch_size, workers, dev, precision, tta, progress):
        ok = requested == used
        skipped += [str(dataset.paths[i]) for i in requested[~ok].tolist()]
        keep += requested[ok].tolist()
        logps.append(logp[ok])
    seconds = time.perf_counter() - start
    if not keep:
        raise VitftError(f"none of the {len(samples)} images in {data} could be decoded")
    logp = torch.cat(logps)
    y = np.array([dataset.labels[i] for i in keep], dtype=np.int64)
    m = _metrics(y, logp, classes)
    conf = logp.max(dim=1).values.exp().numpy()
    predictions = [{"path": str(dataset.paths[i]), "true_label": classes[t], "predicted_label": classes[p],
                    "confidence": float(c)} for i, t, p, c in zip(keep, y, m["pred"], conf)]
    cfg = net.pretrained_cfg
    report = EvalReport(
        accuracy=m["accuracy"], top5=m["top5"], loss=m["loss"], macro_f1=m["macro_f1"],
        weighted_f1=m["weighted_f1"], per_class=m["per_class"], confusion=m["confusion"], classes=classes,
        confused_pairs=m["confused_pairs"], images_per_s=len(keep) / max(seconds, 1e-9), num_images=len(keep),
        absent_classes=m["absent_classes"], skipped=skipped,
        model={"source": source, "architecture": cfg.get("architecture"), "pretrained_cfg_source": cfg.get("source"),
               "num_classes": net.num_classes, "label_names_from": names_from},
        data={**data_info, "num_images": len(keep), "num_skipped": len(skipped)},
        preprocessing=_preprocessing(net, tta),
        runtime={"device": str(dev), "precision": precision, "batch_size": batch_size},
        predictions=predictions,
    )
    if output is not None:
        heatmaps = _mistake_heatmaps(net, predictions, explain, dev, precision) if explain else None
        write_report(report, output, heatmaps)
    return report


def write_report(report: EvalReport, folder: Union[str, os.PathLike],
                 heatmaps: Optional[dict[str, np.ndarray]] = None) -> Path:
    """report.json, predictions.csv, confusion_matrix.png and mistakes.png in `folder`, each written atomically.

    `heatmaps` (image path -> heat map at the image's size) are overlaid on the images of mistakes.png.
    """
    folder = Path(folder).expanduser()

    def write_csv(tmp: Path) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["path", "true_label", "predicted_label", "confidence"])
            for row in report.predictions:
                writer.writerow([printable(row["path"]), printable(row["true_label"]),
                                 printable(row["predicted_label"]), f"{row['confidence']:.6f}"])

    atomic_write(folder / "predictions.csv", write_csv)
    _save_figure(_confusion_figure(report), folder / "confusion_matrix.png")
    _save_figure(_mistakes_figure(report.predictions, heatmaps=heatmaps), folder / "mistakes.png")
    text = json.dumps(printable_tree(report.to_dict()), indent=2) + "\n"
    atomic_write(folder / "report.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    report.output = folder
    return folder


def _save_figure(fig, path: Path) -> None:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, pil_kwargs={"compress_level": 3}))


def _confusion_figure(report: EvalReport):
    from matplotlib.figure import Figure  # the object API renders with Agg and leaves pyplot's backend alone

    cm = np.asarray(report.confusion, dtype=float)
    k = len(report.classes)
    rows = cm.sum(axis=1, keepdims=True)
    norm = np.divide(cm, rows, out=np.zeros_like(cm), where=rows > 0)
    side = min(40.0, max(5.0, 0.45 * k + 2.5))
    fig = Figure(figsize=(side + 1.2, side), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if k <= 100:
        names = [printable(c) for c in report.classes]
        ax.set_xticks(range(k), names, rotation=45 if k <= 20 else 90, ha="right" if k <= 20 else "center",
                      fontsize=10 if k <= 20 else 6)
        ax.set_yticks(range(k), names, fontsize=10 if k <= 20 else 6)
    if k <= 25:
        for i in range(k):
            for j in range(k):
                if cm[i, j]:
                    ax.text(j, i, f"{norm[i, j]:.2f}\n({int(cm[i, j])})", ha="center", va="center", fontsize=8,
                            color="white" if norm[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"confusion matrix (row-normalised), {report.num_images} images, "
                 f"top-1 {100 * report.accuracy:.1f}%")
    return fig


def _thumbnail(path: str, side: int) -> np.ndarray:
    import cv2

    image = load_rgb(path, max_short_side=side)
    h, w = image.shape[:2]
    scale = side / max(h, w)
    return cv2.resize(image, (max(1, round(w * scale)), max(1, round(h * scale))),
                      interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)


def _shown_mistakes(predictions: list[dict], n: int = N_MISTAKES) -> list[dict]:
    """The mistakes mistakes.png shows: the n most confident."""
    wrong = [p for p in predictions if p["true_label"] != p["predicted_label"]]
    return sorted(wrong, key=lambda p: -p["confidence"])[:n]


def _mistake_heatmaps(model: VisionTransformer, predictions: list[dict], method: str, device: torch.device,
                      precision: str) -> dict[str, np.ndarray]:
    """Heat maps (explain.py's `method`) of the images mistakes.png shows, by path."""
    from .explain import explain

    shown = [p["path"] for p in _shown_mistakes(predictions)]
    if not shown:
        return {}
    results = explain(model, shown, method=method, device=str(device), precision=precision)
    return {r.path: r.heatmap for r in results if r.heatmap is not None}


def _with_heatmap(thumb: np.ndarray, heatmap: np.ndarray) -> np.ndarray:
    import cv2

    from .explain import overlay

    return overlay(thumb, cv2.resize(heatmap, (thumb.shape[1], thumb.shape[0]), interpolation=cv2.INTER_AREA))


def _mistakes_figure(predictions: list[dict], n: int = N_MISTAKES,
                     heatmaps: Optional[dict[str, np.ndarray]] = None):
    from matplotlib.figure import Figure

    wrong = _shown_mistakes(predictions, n)
    if not wrong:
        fig = Figure(figsize=(4, 2))
        fig.text(0.5, 0.5, "no mistakes", ha="center", va="center", fontsize=14)
        return fig
    cols = min(4, len(wrong))
    rows = math.ceil(len(wrong) / cols)
    cell, gap, top = 2.6, 0.65, 0.45  # inches: image side, room for a three-line title, room for the suptitle
    width, height = cols * cell + (cols - 1) * 0.2 + 0.2, rows * cell + rows * gap + top + 0.1
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.1 / width, right=1 - 0.1 / width, bottom=0.1 / height,
                        top=1 - (top + gap) / height, wspace=0.2 / cell, hspace=gap / cell)
    for i, p in enumerate(wrong):
        ax = fig.add_subplot(rows, cols, i + 1)
        try:
            thumb = _thumbnail(p["path"], THUMB_PX)
            if heatmaps and p["path"] in heatmaps:
                thumb = _with_heatmap(thumb, heatmaps[p["path"]])
            ax.imshow(thumb, interpolation="nearest")  # pre-sized: cheap to draw
        except Exception:  # noqa: BLE001 - the file changed since: show the labels anyway
            ax.text(0.5, 0.5, "(unreadable)", ha="center", va="center")
        name = printable(Path(p["path"]).name)
        name = name if len(name) <= 30 else "..." + name[-27:]
        ax.set_title(printable(f"true: {p['true_label']}\npred: {p['predicted_label']} ({100 * p['confidence']:.0f}%)"
                               f"\n{name}"), fontsize=9)
        ax.axis("off")
    fig.suptitle("most confident mistakes", y=1 - 0.1 / height, va="top")
    return fig


# ----------------------------------------------------------------------------- predict


def predict(
    model: ModelLike,
    inputs: Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]],
    top_k: int = 3,
    img_size: Optional[int] = None,
    tta: bool = False,
    batch_size: int = 64,
    workers: Optional[int] = None,
    device: str = "auto",
    precision: str = "fp32",
    arch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
) -> Predictions:
    """Top-k labels for image files, folders (recursive) or globs; yields Predictions as batches complete.

    Rows come in sorted path order. A file that is not a readable image, or fails to decode, gives a Prediction
    with `error` set (never an exception). Model and inputs are checked now; images are read while iterating.
    """
    if top_k < 1:
        raise VitftError(f"--top-k must be at least 1, got {top_k}")
    dev = _check_args(batch_size, device, precision)
    paths = list_images(inputs)
    net, _ = _prepare_model(model, arch, img_size)
    if net.num_classes <= 0:
        raise VitftError("the model has no classifier head (num_classes=0); predict needs a classifier")
    classes = label_names(net)
    k = min(top_k, len(classes))
    size = tuple(net.patch_embed.img_size)
    transform = build_transforms(net.pretrained_cfg, size, train=False)
    try:
        dataset = ImageDataset(paths, transform, img_size=size, return_index=True, name="inputs",
                               crop_pct=net.pretrained_cfg.get("crop_pct", DEFAULT_CROP_PCT))
    except VitftError:  # not one readable image: every row is an error
        rows = iter([Prediction(str(p), [], [], unreadable_reason(p)) for p in paths])
        return Predictions(rows, len(paths), k, classes)
    rows = _predict_rows(net, dataset, paths, classes, k, tta, batch_size, workers, dev, precision, progress)
    return Predictions(rows, len(paths), k, classes)


def _predict_rows(net, dataset: ImageDataset, paths: list[Path], classes: list[str], k: int, tta: bool,
                  batch_size: int, workers: Optional[int], device: torch.device, precision: str,
                  progress: Optional[ProgressFn]) -> Iterator[Prediction]:
    position = {p: i for i, p in enumerate(paths)}
    ready = {position[p]: Prediction(str(p), [], [], unreadable_reason(p)) for p in dataset.unreadable}
    next_row = done = 0
    try:
        for requested, used, logp in _infer(net, dataset, batch_size, workers, device, precision, tta, progress):
            probs, idx = logp.exp().topk(k, dim=1)
            for r, u, p, j in zip(requested.tolist(), used.tolist(), probs.tolist(), idx.tolist()):
                path = dataset.paths[r]
                ready[position[path]] = Prediction(str(path), [classes[c] for c in j],
                                                   [round(v, 6) for v in p]) if r == u else (
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


def write_predictions(rows: Iterable[Prediction], file: IO[str], fmt: str, top_k: int) -> tuple[int, int]:
    """Write rows as CSV (path, label_1, prob_1, ..., error) or JSONL; returns (good rows, error rows)."""
    good = bad = 0
    writer = None
    if fmt == "csv":
        writer = csv.writer(file, lineterminator="\n")
        header = ["path"]
        for i in range(1, top_k + 1):
            header += [f"label_{i}", f"prob_{i}"]
        writer.writerow(header + ["error"])
    for row in rows:
        good, bad = (good, bad + 1) if row.error is not None else (good + 1, bad)
        if writer is not None:
            cells = [printable(row.path)]
            for i in range(top_k):
                cells += [printable(row.labels[i]), f"{row.probs[i]:.6f}"] if i < len(row.labels) else ["", ""]
            writer.writerow(cells + [printable(row.error or "")])
        else:
            file.write(json.dumps(printable_tree(row.to_dict())) + "\n")
        file.flush()
    return good, bad


# ----------------------------------------------------------------------------- command line


def _check_model_arg(model: str, arch: Optional[str], pretrained: bool) -> None:
    """Clear errors for a missing path, and for a timm name given without --pretrained."""
    ref = parse_ref(model)
    if ref.kind in (RefKind.FOLDER, RefKind.FILE, RefKind.HUB, RefKind.LOCAL_DIR) or (arch and pretrained):
        return
    if ref.kind is RefKind.MISSING_PATH and not arch:
        raise VitftError(f"model {model} not found; pass a run or model folder, a weights file with --model ARCH, "
                         f"hf-hub:org/repo, or a timm name with --pretrained")
    if not arch and not pretrained:
        raise VitftError(f"{model} is not a file or folder; to use the pretrained weights of the timm model "
                         f"{model}, add --pretrained")


def default_output(model: str) -> Path:
    """The run folder for a local model folder, else ./eval-<model name>."""
    if model.startswith("local-dir:"):
        return Path(model[len("local-dir:"):]).expanduser()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        name = path.stem
    else:
        name = model.removeprefix("hf-hub:").split("@")[0].rstrip("/").split("/")[-1]
    return Path("eval-" + (re.sub(r"[^\w.-]+", "-", name).strip("-") or "model"))


class _ProgressBar:
    """A rich progress bar on stderr, shown only on a terminal and for at least `min_total` images."""

    def __init__(self, description: str, min_total: int = 128, enabled: bool = True):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.description, self.min_total = description, min_total
        self.enabled = enabled and self.console.is_terminal
        self._progress = self._task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        if self._progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), console=self.console, transient=True,
                                      redirect_stdout=False, redirect_stderr=False)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=total)
        self._progress.update(self._task, completed=done)

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


def print_report(report: EvalReport, console=None) -> None:
    """The report as rich tables on a terminal, as plain aligned text when piped."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape as rich_escape
    from rich.table import Table

    def escape(text: str) -> str:  # rich markup escaped, undecodable file name bytes as \xNN
        return rich_escape(printable(text))

    console = console or Console()
    style = box.SIMPLE_HEAD if console.is_terminal else None
    data = report.data
    console.print(f"evaluated {escape(str(report.model['source'] or report.model['architecture']))} on "
                  f"{escape(data['root'])} (split: {data['split']}, layout: {escape(data['layout'])}): "
                  f"{report.num_images} images", highlight=False, soft_wrap=True)
    summary = Table.grid(padding=(0, 2))
    summary.add_column()
    summary.add_column(justify="right")
    summary.add_row("top-1 accuracy", f"{100 * report.accuracy:.1f}%")
    if report.top5 is not None:
        summary.add_row("top-5 accuracy", f"{100 * report.top5:.1f}%")
    summary.add_row("loss", f"{report.loss:.4f}")
    summary.add_row("macro F1", f"{report.macro_f1:.3f}")
    summary.add_row("weighted F1", f"{report.weighted_f1:.3f}")
    summary.add_row("images/s", f"{report.images_per_s:.1f}")
    console.print(summary, highlight=False)

    per_class = Table(title="per class", box=style, title_justify="left", highlight=False)
    per_class.add_column("class")
    for col in ("precision", "recall", "F1", "support"):
        per_class.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for name, row in report.per_class.items():
        per_class.add_row(escape(name), fmt(row["precision"]), fmt(row["recall"]), fmt(row["f1"]),
                          str(row["support"]))
    console.print()
    console.print(per_class)
    if report.confused_pairs:
        pairs = Table(title="most confused (true -> predicted)", box=style, title_justify="left", highlight=False)
        for col in ("true", "predicted", "count", "% of true"):
            pairs.add_column(col, justify="right" if col in ("count", "% of true") else "left")
        for p in report.confused_pairs[:5]:
            pairs.add_row(escape(p["true"]), escape(p["predicted"]), str(p["count"]),
                          f"{100 * p['fraction_of_true']:.1f}%")
        console.print()
        console.print(pairs)
    if report.absent_classes:
        console.print(f"\nmodel classes not in the data (support 0): {escape(', '.join(report.absent_classes))}",
                      highlight=False, soft_wrap=True)
    if report.skipped:
        console.print(f"\n{len(report.skipped)} file(s) skipped (not readable images): "
                      f"{escape(', '.join(report.skipped[:3]))}" + (" ..." if len(report.skipped) > 3 else ""),
                      highlight=False, soft_wrap=True)
    if report.output is not None:
        console.print(f"\nwrote report.json, predictions.csv, confusion_matrix.png, mistakes.png to "
                      f"{escape(str(report.output))}", highlight=False, soft_wrap=True)


def evaluate_command(model: str, data: str, split: Optional[str] = None, arch: Optional[str] = None,
                     pretrained: bool = False, img_size: Optional[int] = None, tta: bool = False,
                     batch_size: int = 64, workers: Optional[int] = None, device: str = "auto",
                     precision: str = "fp32", output: Optional[str] = None, val_split: Optional[float] = None,
                     seed: Optional[int] = None, explain: Optional[str] = None) -> EvalReport:
    """`vitft evaluate`: evaluate, write the files, print the report."""
    _check_model_arg(model, arch, pretrained)
    out = Path(output).expanduser() if output else default_output(model)
    with _ProgressBar("evaluating") as bar:
        report = evaluate(model, data, split=split, img_size=img_size, tta=tta, batch_size=batch_size,
                          workers=workers, device=device, precision=precision, output=out, arch=arch, progress=bar,
                          val_split=val_split, seed=seed, explain=explain)
    print_report(report)
    return report


def predict_command(model: str, inputs: list[str], arch: Optional[str] = None, pretrained: bool = False,
                    top_k: int = 3, fmt: Optional[str] = None, output: Optional[str] = None,
                    batch_size: int = 64, workers: Optional[int] = None, device: str = "auto",
                    precision: str = "fp32", img_size: Optional[int] = None, tta: bool = False) -> None:
    """`vitft predict`: stream rows to --output (written atomically) or stdout; warn about unreadable files."""
    from rich.console import Console
    from rich.markup import escape

    _check_model_arg(model, arch, pretrained)
    if not inputs:
        raise VitftError("give at least one image file, folder or glob to predict")
    suffix = Path(output).suffix.lower() if output else ""
    fmt = (fmt or ("jsonl" if suffix in (".jsonl", ".json", ".ndjson") else "csv")).lower()
    if fmt not in ("csv", "jsonl"):
        raise VitftError(f"unknown --format {fmt!r}; use csv or jsonl")
    err = Console(stderr=True)
    # a bar on a terminal only when the rows do not go to that same terminal
    with _ProgressBar("predicting", enabled=bool(output) or not sys.stdout.isatty()) as bar:
        rows = predict(model, inputs, top_k=top_k, img_size=img_size, tta=tta, batch_size=batch_size,
                       workers=workers, device=device, precision=precision, arch=arch, progress=bar)
        counts = []
        if output:
            def write(tmp: Path) -> None:
                with open(tmp, "w", newline="", encoding="utf-8") as f:
                    counts.append(write_predictions(rows, f, fmt, rows.top_k))

            atomic_write(Path(output).expanduser(), write)
        else:
            counts.append(write_predictions(rows, sys.stdout, fmt, rows.top_k))
    good, bad = counts[0]
    if output:
        err.print(f"wrote {good} prediction(s) to {escape(printable(str(output)))}", highlight=False, soft_wrap=True)
    if bad:
        err.print(f"[yellow]warning:[/] {bad} of {good + bad} file(s) could not be read; their rows have an "
                  f"error field", highlight=False, soft_wrap=True)

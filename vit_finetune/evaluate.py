"""Evaluation on a labelled dataset and prediction on loose images.

`evaluate` matches the data's class folders to the model's label names by name, runs inference (optionally with
horizontal-flip test-time augmentation), computes the metrics with numpy (top-1, top-5, cross-entropy, per-class
precision/recall/F1, confusion matrix) and writes report.json, predictions.csv, confusion_matrix.png and mistakes.png.
`predict` yields top-k labels per image as batches complete; files that cannot be read become rows with an error.
The `vitft evaluate` / `vitft predict` commands (cli.py) print and write what these return.
"""
from __future__ import annotations

import copy
import csv
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from timm.data.constants import DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from .data import (
    ImageDataset,
    build_loader,
    build_transforms,
    find_dataset,
    list_images,
    unreadable_reason,
)
from .errors import VitftError
from .files import atomic_write, printable, printable_tree
from .model import VisionTransformer
from .plots import confusion_figure, mistakes_figure, save_png, shown_mistakes
from .pos_embed import _pair
from .runtime import check_precision, choose_precision, compute_context, model_widths, resolve_device
from .weights import describe_weights, load_model

log = logging.getLogger("vitft")

ModelLike = Union[str, os.PathLike, VisionTransformer]
ProgressFn = Callable[[int, int], None]  # (images done, total)
SPLITS = ("train", "val", "test")
DECODE_ERROR = "could not be decoded (truncated or corrupt image)"
N_CONFUSED_PAIRS = 10


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


def top_k_hits(scores: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)) -> list[torch.Tensor]:
    """Per k, a bool per row: is the target among the row's k highest scores (k capped at the number of classes)?

    The one top-k accuracy of training's validation and of evaluate.
    """
    ranked = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices == targets[:, None]
    return [ranked[:, :k].any(dim=1) for k in ks]


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


def prepare_classifier(model: ModelLike, inputs, arch: Optional[str], img_size, top_k: int, batch_size: int,
                       device: str, precision: str, purpose: str) -> tuple[torch.device, list[Path], VisionTransformer]:
    """(device, image paths, model) for predict and explain, every argument checked before any image is read."""
    if top_k < 1:
        raise VitftError(f"--top-k must be at least 1, got {top_k}")
    dev = _check_args(batch_size, device, precision)
    paths = list_images(inputs)
    net, _ = _prepare_model(model, arch, img_size)
    if net.num_classes <= 0:
        raise VitftError(f"the model has no classifier head (num_classes=0); {purpose} needs a classifier")
    return dev, paths, net


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
    top1_hits, top5_hits = top_k_hits(logp, target)
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
        "accuracy": float(top1_hits.float().mean()),
        "top5": float(top5_hits.float().mean()) if k > 5 else None,
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
    precision: str = "auto",
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
    precision = choose_precision(dev, precision, model_widths(net)).precision
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
    save_png(confusion_figure(report), folder / "confusion_matrix.png")
    save_png(mistakes_figure(report.predictions, heatmaps=heatmaps), folder / "mistakes.png")
    text = json.dumps(printable_tree(report.to_dict()), indent=2) + "\n"
    atomic_write(folder / "report.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
    report.output = folder
    return folder


def _mistake_heatmaps(model: VisionTransformer, predictions: list[dict], method: str, device: torch.device,
                      precision: str) -> dict[str, np.ndarray]:
    """Heat maps (explain.py's `method`) of the images mistakes.png shows, by path."""
    from .explain import explain

    shown = [p["path"] for p in shown_mistakes(predictions)]
    if not shown:
        return {}
    results = explain(model, shown, method=method, device=str(device), precision=precision)
    return {r.path: r.heatmap for r in results if r.heatmap is not None}


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
    precision: str = "auto",
    arch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
) -> Predictions:
    """Top-k labels for image files, folders (recursive) or globs; yields Predictions as batches complete.

    Rows come in sorted path order. A file that is not a readable image, or fails to decode, gives a Prediction
    with `error` set (never an exception). Model and inputs are checked now; images are read while iterating.
    """
    dev, paths, net = prepare_classifier(model, inputs, arch, img_size, top_k, batch_size, device, precision,
                                         "predict")
    precision = choose_precision(dev, precision, model_widths(net)).precision
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

"""The evaluation report: its metrics, computed from integer counts (827 right of 2,158 is exactly 827/2158),
and its files, report.json, predictions.csv, confusion_matrix.png and mistakes.png. Imports no torch, so the
model card (hub) reads report.json without it."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..data.images import load_rgb
from ..errors import VitftError
from ..files import atomic_write, printable, printable_tree
from ..run_folder import RunFolder
from .plots import THUMB_PX, confusion_figure, mistakes_figure, save_png, thumbnail

N_CONFUSED_PAIRS = 10
N_MISTAKES = 16  # images in mistakes.png


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
            "f1_macro": self.macro_f1,  # the name multi-label reports use: one key reads both kinds
            "balanced_accuracy": self.balanced_accuracy,
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

    @property
    def balanced_accuracy(self) -> float:
        """The mean recall over the classes in the data: top-1 as if every class had as many images."""
        return confusion_scores(self.confusion)["balanced_accuracy"]

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


def classification_metrics(y: np.ndarray, pred: np.ndarray, top5_correct: Optional[int], classes: list[str]
                           ) -> dict:
    """Accuracy, top-5, per-class precision/recall/F1, macro and weighted F1, the confusion matrix and the most
    confused pairs of true labels `y` and predictions `pred` (class indices); `top5_correct` counts the images
    whose label is among their five best (None: fewer than six classes). Every fraction is a ratio of integer
    counts, computed in float64."""
    k, n = len(classes), len(y)
    confusion = np.bincount(np.asarray(y) * k + np.asarray(pred), minlength=k * k).reshape(k, k)
    tp = np.diag(confusion)
    support, predicted = confusion.sum(axis=1), confusion.sum(axis=0)
    per_class = {}
    for i, name in enumerate(classes):
        precision = int(tp[i]) / int(predicted[i]) if predicted[i] else (0.0 if support[i] else None)
        recall = int(tp[i]) / int(support[i]) if support[i] else None
        per_class[name] = {"precision": precision, "recall": recall, "f1": _f1(confusion, i),
                           "support": int(support[i])}
    present = support > 0
    pairs = [(int(confusion[i, j]), i, j) for i in range(k) for j in range(k) if i != j and confusion[i, j]]
    pairs.sort(key=lambda t: (-t[0], t[1], t[2]))
    confused = [{"true": classes[i], "predicted": classes[j], "count": c, "fraction_of_true": c / int(support[i])}
                for c, i, j in pairs[:N_CONFUSED_PAIRS]]
    return {
        "accuracy": int(tp.sum()) / n,
        "top5": top5_correct / n if top5_correct is not None else None,
        "macro_f1": confusion_scores(confusion)["f1_macro"],
        "weighted_f1": sum(int(support[i]) * _f1(confusion, i) for i in range(k) if present[i]) / n,
        "per_class": per_class,
        "confusion": confusion,
        "confused_pairs": confused,
        "absent_classes": [c for c, p in zip(classes, present) if not p],
    }


def _f1(confusion: np.ndarray, i: int) -> Optional[float]:
    """Class i's F1, 2 TP / (2 TP + FP + FN) = 2 TP / (support + predicted); None without images of class i."""
    support, predicted = int(confusion[i].sum()), int(confusion[:, i].sum())
    return 2 * int(confusion[i, i]) / (support + predicted) if support else None


def confusion_scores(confusion: np.ndarray) -> dict[str, float]:
    """Balanced accuracy (mean recall) and macro F1 over the classes with images, from a confusion matrix of
    counts (rows: true class, columns: predicted): each a mean of exact ratios of integers."""
    confusion = np.asarray(confusion)
    present = [i for i in range(len(confusion)) if confusion[i].sum()]
    recalls = [int(confusion[i, i]) / int(confusion[i].sum()) for i in present]
    return {"balanced_accuracy": float(np.mean(recalls)),
            "f1_macro": float(np.mean([_f1(confusion, i) for i in present]))}


def shown_mistakes(predictions: list[dict], n: int = N_MISTAKES) -> list[dict]:
    """The mistakes mistakes.png shows: the n most confident."""
    wrong = [p for p in predictions if p["true_label"] != p["predicted_label"]]
    return sorted(wrong, key=lambda p: -p["confidence"])[:n]


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
    save_png(confusion_figure(report.confusion, report.classes, report.accuracy), folder / "confusion_matrix.png")
    shown = shown_mistakes(report.predictions)
    thumbs = [_thumbnail(p["path"], (heatmaps or {}).get(p["path"])) for p in shown]
    save_png(mistakes_figure(thumbs, [_mistake_title(p) for p in shown]), folder / "mistakes.png")
    text = json.dumps(printable_tree(report.to_dict()), indent=2) + "\n"
    RunFolder(folder).write_report(text)
    report.output = folder
    return folder


def _thumbnail(path: str, heatmap: Optional[np.ndarray]) -> Optional[np.ndarray]:
    try:
        return thumbnail(load_rgb(path, max_short_side=THUMB_PX), heatmap)
    except Exception:  # noqa: BLE001 - the file changed since: the figure shows the labels anyway
        return None


def _mistake_title(prediction: dict) -> str:
    name = printable(Path(prediction["path"]).name)
    name = name if len(name) <= 30 else "..." + name[-27:]
    return (f"true: {prediction['true_label']}\npred: {prediction['predicted_label']} "
            f"({100 * prediction['confidence']:.0f}%)\n{name}")

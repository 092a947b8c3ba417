"""Evaluating a multi-label classifier: sigmoid probabilities over the images, the metrics of multilabel.py at the
model's per-class thresholds (or --threshold), and report.json (`task: multi-label`, mAP, f1_macro, f1_micro,
per-class AP/precision/recall/F1, the most frequent false positives and negatives), predictions.csv (true and
predicted labels, and every class's probability) and pr_curves.png."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from ..data.labels import multi_hot
from ..data.loaders import ImageDataset
from ..files import atomic_write, printable, printable_tree
from ..models.vit import VisionTransformer
from ..run_folder import RunFolder
from .inference import ProgressFn, infer_all, thresholds
from .multilabel import multilabel_metrics, pr_curve
from .plots import pr_curves_figure, save_png

N_ERRORS = 10  # classes listed among the most frequent false positives and negatives
N_EXAMPLES = 3  # image paths shown for each


@dataclass
class MultiLabelReport:
    """Metrics of one multi-label evaluation; `to_dict()` is what report.json holds. Fractions are in [0, 1]."""

    mAP: Optional[float]  # mean over the classes with positives of their average precision
    f1_macro: Optional[float]
    f1_micro: Optional[float]
    precision_micro: float
    recall_micro: Optional[float]
    exact_match: float  # images whose predicted label set is exactly their true one
    loss: float  # mean binary cross-entropy per class and image
    per_class: dict[str, dict]  # class -> ap, precision, recall, f1, support, threshold
    false_positives: list[dict]  # class, count, examples: the classes predicted most often where they are not
    false_negatives: list[dict]  # class, count, examples: the classes missed most often
    thresholds_from: str  # "validation" (chosen in training), "--threshold" or "default"
    classes: list[str]
    num_images: int
    images_per_s: float
    skipped: list[str]
    model: dict
    data: dict
    preprocessing: dict
    runtime: dict
    predictions: list[dict] = field(default_factory=list, repr=False)  # path, true_labels, predicted_labels, probs
    curves: dict = field(default_factory=dict, repr=False)  # class -> (precision, recall) arrays
    output: Optional[Path] = None
    task: str = "multi-label"

    def to_dict(self) -> dict:
        skip = {"predictions", "curves", "output"}
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def summary_lines(self) -> list[str]:
        """What `vitft evaluate` prints."""
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        lines = [f"evaluated {self.model.get('source') or self.model.get('architecture')} on {self.data['root']} "
                 f"(split: {self.data['split']}, multi-label, thresholds: {self.thresholds_from}): "
                 f"{self.num_images} images",
                 f"mAP {pct(self.mAP)}  F1 macro {pct(self.f1_macro)}  F1 micro {pct(self.f1_micro)}  exact match "
                 f"{pct(self.exact_match)}  loss {self.loss:.4f}",
                 f"{'class':<20} {'AP':>7} {'prec':>7} {'recall':>7} {'F1':>7} {'thresh':>7} {'support':>8}"]
        for name, row in self.per_class.items():
            lines.append(f"{printable(name)[:20]:<20} {pct(row['ap']):>7} {pct(row['precision']):>7} "
                         f"{pct(row['recall']):>7} {pct(row['f1']):>7} {row['threshold']:>7.3f} {row['support']:>8}")
        if self.output is not None:
            lines.append(f"wrote report.json, predictions.csv and pr_curves.png to {printable(str(self.output))}")
        return lines


def evaluate_multilabel(net: VisionTransformer, dataset: ImageDataset, classes: list[str], threshold: Optional[float],
                        context: dict, batch_size: int, workers: Optional[int], device: torch.device, precision: str,
                        tta: bool, progress: Optional[ProgressFn], threads: Optional[int],
                        output: Union[str, os.PathLike, None]) -> MultiLabelReport:
    """Run the model over `dataset` (multi-hot labels in the model's class order) and report; `context` holds the
    report's model, data, preprocessing and runtime entries."""
    keep, logp, skipped, seconds = infer_all(net, dataset, batch_size, workers, device, precision, tta, progress,
                                             threads)
    logp = logp.double()
    probs = logp.exp().numpy()
    targets = torch.stack([multi_hot(dataset.labels[i], len(classes)) for i in keep]).numpy()
    # binary cross-entropy from log-probabilities: log(1 - p) = log1p(-p), safe for p < 1
    loss = float(-(targets * logp.numpy() + (1 - targets) * np.log1p(-np.minimum(probs, 1 - 1e-12))).mean())
    cuts = thresholds(net, threshold)
    source = "--threshold" if threshold is not None else (
        "validation" if net.pretrained_cfg.get("thresholds") else "default")
    metrics = multilabel_metrics(probs, targets, cuts, classes)
    predicted = probs >= np.asarray(cuts)[None, :]
    paths = [str(dataset.paths[i]) for i in keep]
    predictions = [{"path": path, "true_labels": [classes[c] for c in np.flatnonzero(t)],
                    "predicted_labels": [classes[c] for c in np.flatnonzero(p)], "probs": [float(v) for v in row]}
                   for path, t, p, row in zip(paths, targets > 0.5, predicted, probs)]
    curves = {}
    for c, name in enumerate(classes):
        if targets[:, c].any():
            precision_c, recall_c, _ = pr_curve(probs[:, c], targets[:, c] > 0.5)
            curves[name] = (np.r_[1.0, precision_c], np.r_[0.0, recall_c])
    report = MultiLabelReport(
        mAP=metrics["mAP"], f1_macro=metrics["f1_macro"], f1_micro=metrics["f1_micro"],
        precision_micro=metrics["precision_micro"], recall_micro=metrics["recall_micro"],
        exact_match=metrics["exact_match"], loss=loss, per_class=metrics["per_class"],
        false_positives=_frequent(predicted & (targets < 0.5), classes, paths),
        false_negatives=_frequent(~predicted & (targets > 0.5), classes, paths),
        thresholds_from=source, classes=classes, num_images=len(keep), images_per_s=len(keep) / max(seconds, 1e-9),
        skipped=skipped, **{**context, "data": {**context["data"], "num_images": len(keep),
                                                "num_skipped": len(skipped)}},
        predictions=predictions, curves=curves)
    if output is not None:
        write_multilabel_report(report, output)
    return report


def _frequent(errors: np.ndarray, classes: list[str], paths: list[str]) -> list[dict]:
    """The classes with the most errors of one kind (images by row, classes by column), with a few examples."""
    counts = errors.sum(axis=0)
    order = [int(c) for c in np.argsort(-counts, kind="stable") if counts[c] > 0][:N_ERRORS]
    return [{"class": classes[c], "count": int(counts[c]),
             "examples": [paths[i] for i in np.flatnonzero(errors[:, c])[:N_EXAMPLES]]} for c in order]


def write_multilabel_report(report: MultiLabelReport, folder: Union[str, os.PathLike]) -> Path:
    """report.json, predictions.csv and pr_curves.png in `folder`, each written atomically."""
    folder = Path(folder).expanduser()

    def write_csv(tmp: Path) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(["path", "true_labels", "predicted_labels", *(f"prob_{c}" for c in report.classes)])
            for row in report.predictions:
                writer.writerow([printable(row["path"]), printable("|".join(row["true_labels"])),
                                 printable("|".join(row["predicted_labels"])), *(f"{p:.6f}" for p in row["probs"])])

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "predictions.csv", write_csv)
    aps = {name: row["ap"] for name, row in report.per_class.items()}
    save_png(pr_curves_figure(report.curves, aps), folder / "pr_curves.png")
    RunFolder(folder).write_report(json.dumps(printable_tree(report.to_dict()), indent=2) + "\n")
    report.output = folder
    return folder

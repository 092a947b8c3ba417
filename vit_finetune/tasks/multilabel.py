"""Multi-label metrics, from sigmoid probabilities and multi-hot targets: average precision per class and its mean
(mAP), precision, recall and F1 at per-class thresholds (macro and micro), the thresholds that maximise each
class's F1, and precision-recall curves. numpy only: training's validation and `evaluate` share them.

AP follows the usual step-wise definition (as scikit-learn's average_precision_score): the sum over the
distinct scores, highest first, of the recall gained there times the precision there. A class with no positive
image has no AP; mAP and macro F1 average the classes that have positives.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

DEFAULT_THRESHOLD = 0.5  # a class without positives in the validation images keeps it


def pr_curve(scores: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(precision, recall, threshold) at each distinct score, highest first: predicting positive when score >=
    threshold. Recall is nan where the class has no positive."""
    order = np.argsort(-scores, kind="stable")
    ranked, hits = scores[order], positives[order].astype(np.float64)
    tp, fp = np.cumsum(hits), np.cumsum(1 - hits)
    last = np.r_[np.flatnonzero(np.diff(ranked)), len(ranked) - 1]  # the last row of each run of equal scores
    tp, fp = tp[last], fp[last]
    with np.errstate(invalid="ignore", divide="ignore"):
        return tp / (tp + fp), tp / tp[-1], ranked[last]


def average_precision(scores: np.ndarray, positives: np.ndarray) -> Optional[float]:
    """AP of one class; None when it has no positive (undefined)."""
    if not positives.any():
        return None
    precision, recall, _ = pr_curve(scores, positives)
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def best_thresholds(probs: np.ndarray, targets: np.ndarray) -> list[float]:
    """Per class, the probability threshold with the best F1 on these images: halfway between the lowest score
    still predicted positive and the next score down. DEFAULT_THRESHOLD for a class without positives."""
    thresholds = []
    for c in range(probs.shape[1]):
        positives = targets[:, c] > 0.5
        if not positives.any():
            thresholds.append(DEFAULT_THRESHOLD)
            continue
        precision, recall, cuts = pr_curve(probs[:, c], positives)
        tp = recall * positives.sum()
        f1 = 2 * tp / (tp / np.maximum(precision, 1e-12) + positives.sum())
        k = int(np.nanargmax(f1))
        lower = cuts[k + 1] if k + 1 < len(cuts) else 0.0
        thresholds.append(float((cuts[k] + lower) / 2))
    return thresholds


def multilabel_metrics(probs: np.ndarray, targets: np.ndarray, thresholds: Sequence[float],
                       classes: Sequence[str]) -> dict:
    """mAP, macro and micro F1 (and precision, recall) at `thresholds`, and per class: AP, precision, recall,
    F1, support (images with the label) and threshold."""
    positives = targets > 0.5
    predicted = probs >= np.asarray(thresholds, dtype=probs.dtype)[None, :]
    tp = (predicted & positives).sum(axis=0)
    fp = (predicted & ~positives).sum(axis=0)
    fn = (~predicted & positives).sum(axis=0)
    per_class, aps, f1s = {}, [], []
    for c, name in enumerate(classes):
        ap = average_precision(probs[:, c], positives[:, c])
        precision = tp[c] / (tp[c] + fp[c]) if tp[c] + fp[c] else 0.0
        recall = tp[c] / (tp[c] + fn[c]) if tp[c] + fn[c] else None
        f1 = 2 * tp[c] / (2 * tp[c] + fp[c] + fn[c]) if tp[c] + fp[c] + fn[c] else None
        per_class[name] = {"ap": ap, "precision": float(precision), "recall": _float(recall), "f1": _float(f1),
                           "support": int(positives[:, c].sum()), "threshold": float(thresholds[c])}
        if ap is not None:
            aps.append(ap)
            f1s.append(f1)
    tp_all, fp_all, fn_all = int(tp.sum()), int(fp.sum()), int(fn.sum())
    return {
        "mAP": float(np.mean(aps)) if aps else None,
        "f1_macro": float(np.mean(f1s)) if f1s else None,
        "f1_micro": 2 * tp_all / (2 * tp_all + fp_all + fn_all) if tp_all + fp_all + fn_all else None,
        "precision_micro": tp_all / (tp_all + fp_all) if tp_all + fp_all else 0.0,
        "recall_micro": tp_all / (tp_all + fn_all) if tp_all + fn_all else None,
        "exact_match": float((predicted == positives).all(axis=1).mean()),
        "per_class": per_class,
    }


def precision_at_1(probs: np.ndarray, targets: np.ndarray) -> float:
    """The share of images whose most probable class is one of their labels (training's val_top1)."""
    return float((targets[np.arange(len(probs)), probs.argmax(axis=1)] > 0.5).mean())


def _float(value) -> Optional[float]:
    return None if value is None else float(value)

"""Every figure vitft draws: training curves, the confusion matrix, precision-recall curves (multi-label), the
mistakes grid and explain's heat maps.

matplotlib's object API (`Figure`) renders with Agg and leaves pyplot and its backend alone, so a library user's
interactive backend is never switched. matplotlib and OpenCV are imported when a figure is drawn. Figures take
arrays and names, never report objects, and this module imports no torch: drawing a PNG stays light.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from ..files import atomic_write, printable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

THUMB_PX = 260  # mistakes.png cells are 2.6 in at 100 dpi
DISPLAY_PX = 448  # longer side of each panel in explain's per-image PNGs


def save_png(fig: Figure, path: Path) -> None:
    """Write the figure as a PNG, atomically."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, pil_kwargs={"compress_level": 3}))


def curves_figure(rows: list[dict]) -> Figure:
    """Training and validation loss, and validation accuracy, per epoch (metrics.csv's rows)."""
    from matplotlib.figure import Figure

    epochs = [r["epoch"] for r in rows]
    fig = Figure(figsize=(10, 4), layout="tight")
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    ax_loss.plot(epochs, [r["val_loss"] for r in rows], "o-", label="val")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Loss")
    ax_loss.legend()
    ax_acc.plot(epochs, [100 * r["val_top1"] for r in rows], "o-", label="top-1")
    if any(r.get("val_top5") is not None for r in rows):
        ax_acc.plot(epochs, [100 * (r["val_top5"] or 0) for r in rows], "o-", label="top-5")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="Validation accuracy")
    ax_acc.legend()
    return fig


def confusion_figure(confusion: np.ndarray, classes: Sequence[str], accuracy: float) -> Figure:
    """The row-normalised confusion matrix (counts; rows: true class, columns: predicted, in `classes` order), with
    counts in the cells when there are few classes."""
    from matplotlib.figure import Figure

    cm = np.asarray(confusion, dtype=float)
    k = len(classes)
    rows = cm.sum(axis=1, keepdims=True)
    norm = np.divide(cm, rows, out=np.zeros_like(cm), where=rows > 0)
    side = min(40.0, max(5.0, 0.45 * k + 2.5))
    fig = Figure(figsize=(side + 1.2, side), layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="fraction of the true class")
    if k <= 100:
        names = [printable(c) for c in classes]
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
    ax.set_title(f"confusion matrix (row-normalised), {int(cm.sum())} images, top-1 {100 * accuracy:.1f}%")
    return fig


def pr_curves_figure(curves: dict[str, tuple[np.ndarray, np.ndarray]], aps: dict[str, Optional[float]]) -> Figure:
    """Precision against recall per class (multi-label evaluation), each labelled with its average precision."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 5), layout="tight")
    ax = fig.add_subplot()
    for name, (precision, recall) in curves.items():
        ap = aps.get(name)
        ax.step(recall, precision, where="post", label=f"{printable(name)} (AP {ap:.3f})" if ap is not None else
                printable(name))
    ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1.01), ylim=(0, 1.01), title="precision-recall per class")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize="small", loc="lower left")
    return fig


def mistakes_figure(thumbs: Sequence[Optional[np.ndarray]], titles: Sequence[str]) -> Figure:
    """A grid of mistakes: each thumbnail (uint8 RGB, None for a file that could not be read) under its title
    (true label, predicted label, file name)."""
    from matplotlib.figure import Figure

    if not thumbs:
        fig = Figure(figsize=(4, 2))
        fig.text(0.5, 0.5, "no mistakes", ha="center", va="center", fontsize=14)
        return fig
    cols = min(4, len(thumbs))
    rows = math.ceil(len(thumbs) / cols)
    cell, gap, top = 2.6, 0.65, 0.45  # inches: image side, room for a three-line title, room for the suptitle
    width, height = cols * cell + (cols - 1) * 0.2 + 0.2, rows * cell + rows * gap + top + 0.1
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.1 / width, right=1 - 0.1 / width, bottom=0.1 / height,
                        top=1 - (top + gap) / height, wspace=0.2 / cell, hspace=gap / cell)
    for i, (thumb, title) in enumerate(zip(thumbs, titles)):
        ax = fig.add_subplot(rows, cols, i + 1)
        if thumb is None:
            ax.text(0.5, 0.5, "(unreadable)", ha="center", va="center")
        else:
            ax.imshow(thumb, interpolation="nearest")  # pre-sized: cheap to draw
        ax.set_title(printable(title), fontsize=9)
        ax.axis("off")
    fig.suptitle("most confident mistakes", y=1 - 0.1 / height, va="top")
    return fig


def thumbnail(image: np.ndarray, heatmap: Optional[np.ndarray] = None) -> np.ndarray:
    """A mistakes.png cell: the image fitted to THUMB_PX, with its heat map (at the image's size) overlaid."""
    thumb = _fit(image, THUMB_PX, enlarge=True)
    return thumb if heatmap is None else overlay(thumb, _resized(heatmap, thumb.shape[:2]))


def explanation_figure(image: np.ndarray, heatmap: np.ndarray, name: str, title: str,
                       labels: Sequence[str], probs: Sequence[float]) -> Figure:
    """The image (captioned `name`), the image with its heat map (captioned `title`), the top labels underneath."""
    from matplotlib.figure import Figure

    shown = _fit(image, DISPLAY_PX)
    heat = _resized(heatmap, shown.shape[:2])
    panel_h = 4.0 * min(1.0, shown.shape[0] / shown.shape[1])
    panel_w = panel_h * shown.shape[1] / shown.shape[0]
    fig = Figure(figsize=(2 * panel_w + 0.4, panel_h + 1.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.imshow(shown)
    right.imshow(overlay(shown, heat))
    name = printable(name)  # file and class names may hold bytes that are not UTF-8
    left.set_title(name if len(name) <= 40 else "..." + name[-37:], fontsize=9)
    right.set_title(printable(title), fontsize=9)
    for ax in (left, right):
        ax.axis("off")
    fig.suptitle("   ".join(f"{printable(label)} {100 * p:.1f}%" for label, p in zip(labels, probs)),
                 y=0.02, va="bottom", fontsize=11)
    return fig


def overlay(image: np.ndarray, heatmap: np.ndarray) -> np.ndarray:
    """uint8 RGB image with the heat map (same height and width, in [0, 1]) blended on in 'jet' colours, more
    opaque where hotter."""
    from matplotlib import colormaps

    colours = colormaps["jet"](heatmap)[..., :3]
    alpha = (0.2 + 0.5 * heatmap)[..., None]
    blended = (1 - alpha) * (image.astype(np.float32) / 255) + alpha * colours
    return (np.clip(blended, 0, 1) * 255 + 0.5).astype(np.uint8)


def _fit(image: np.ndarray, side: int, enlarge: bool = False) -> np.ndarray:
    """The image scaled so that its longer side is `side` (a smaller image is kept as it is unless `enlarge`)."""
    h, w = image.shape[:2]
    scale = side / max(h, w)
    if scale >= 1 and not enlarge:
        return image
    return _resized(image, (max(1, round(h * scale)), max(1, round(w * scale))))


def _resized(array: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """OpenCV resize to (height, width): area averaging to shrink, bilinear to enlarge."""
    import cv2

    shrink = hw[0] * hw[1] < array.shape[0] * array.shape[1]
    return cv2.resize(array, (hw[1], hw[0]), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)

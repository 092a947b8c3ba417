"""Evaluation on a labelled dataset.

`evaluate` matches the data's class folders to the model's label names by name, runs inference (optionally with
horizontal-flip test-time augmentation), computes the metrics from counts (top-1, top-5, per-class
precision/recall/F1, confusion matrix; report.py) and the cross-entropy, and writes report.json,
predictions.csv, confusion_matrix.png and mistakes.png: to the run folder by default, as `vitft evaluate` does.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from ..data.datasets import find_dataset
from ..data.loaders import ImageDataset
from ..data.shards import is_shards
from ..data.streams import read_whole
from ..data.transforms import build_transforms
from ..errors import VitftError
from ..files import printable
from ..models.vit import VisionTransformer
from ..run_folder import RunFolder
from ..runtime import choose_precision, model_widths
from ..weights.loading import describe_weights
from ..weights.preprocessing import data_config, preprocessing
from ..weights.refs import RefKind, parse_ref
from .explain import check_method, explain
from .inference import (
    ModelLike,
    ProgressFn,
    check_model_source,
    check_runtime,
    infer_all,
    is_multi_label,
    prepare_model,
    top_k_hits,
)
from .multilabel_report import MultiLabelReport, evaluate_multilabel
from .report import EvalReport, classification_metrics, shown_mistakes, write_report

log = logging.getLogger("vitft")

SPLITS = ("train", "val", "test")
DEFAULT_OUTPUT = "auto"  # evaluate's output: the run folder of a local model folder, else ./eval-<model name>


def default_output(model: ModelLike) -> Path:
    """Where evaluate writes by default: the folder of a local model folder (a run), else ./eval-<model name>."""
    if isinstance(model, VisionTransformer):
        name = str(model.pretrained_cfg.get("architecture") or "model")
    else:
        ref = parse_ref(str(model))
        if ref.kind in (RefKind.LOCAL_DIR, RefKind.FOLDER):
            return ref.path
        name = ref.path.stem if ref.kind is RefKind.FILE else ref.target.rstrip("/").split("/")[-1]
    return Path("eval-" + (re.sub(r"[^\w.-]+", "-", name).strip("-") or "model"))


def _preprocessing(model: VisionTransformer, tta: bool) -> dict:
    config = data_config(model.pretrained_cfg, tuple(model.patch_embed.img_size))
    return {
        "img_size": list(model.patch_embed.img_size),
        "mean": [float(v) for v in config["mean"]],
        "std": [float(v) for v in config["std"]],
        "interpolation": config["interpolation"],
        "crop_pct": float(config["crop_pct"]),
        "tta": bool(tta),
    }


def _run_split(model: ModelLike, data: Union[str, os.PathLike]) -> Optional[tuple[float, int]]:
    """(val_split, seed) of the run folder `model` when `data` is the folder it was trained on, else None."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    train = RunFolder(Path(str(model).removeprefix("local-dir:")).expanduser()).vitft_info()["train"]
    try:
        same = os.path.realpath(os.path.expanduser(str(train["data"]))) == \
            os.path.realpath(os.path.expanduser(str(data)))
        return (float(train.get("val_split", 0.1)), int(train.get("seed", 0))) if same else None
    except (ValueError, KeyError, TypeError):  # not a run folder (or not one of ours)
        return None


def _eval_samples(data: Union[str, os.PathLike], split: Optional[str], val_split: Optional[float] = None,
                  seed: int = 0, explicit: bool = True, columns: Optional[dict] = None) -> tuple[list, list[str], dict]:
    """(samples, data classes, data identity) of the split to evaluate.

    Where the data has no validation folder, `val_split` and `seed` split it as `finetune` does; a single
    folder of class folders without `val_split` is evaluated whole. An `explicit` val_split (the user's, not
    a run's) on data that has a validation folder is an error. A label file without a split column is a single
    folder's like; `columns`: its image_column and label_column.
    """
    shards = is_shards(str(data))  # all the shards are the split to evaluate
    splits = find_dataset(data, 0.1 if val_split is None else val_split, seed, val_data=str(data) if shards else None,
                          **(columns or {}))
    if splits.streamed:
        splits = dataclasses.replace(splits, train=[], val=read_whole(splits.val), test=None)
    root = os.path.abspath(os.path.expanduser(str(data)))
    if explicit and val_split is not None and " split " not in splits.layout:
        raise VitftError(f"--val-split applies to a folder without a validation folder; {data} has one "
                         f"(layout: {splits.layout})")
    by_row = splits.layout.startswith("label file") and "by row" in splits.layout  # a label file's split column
    whole = splits.layout.startswith(("single folder", "label file")) and " split " in splits.layout and not by_row
    if whole and (val_split is None or split == "all"):
        if split not in (None, "all"):
            raise VitftError(f"{data} is a single folder of class folders: it is evaluated whole; --split applies "
                             f"to train/val/test layouts, or with --val-split")
        samples, split, layout = sorted(splits.train + splits.val), "all", splits.layout.split(" split ")[0]
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
                f"{'their' if len(unknown) > 1 else 'its'} images (class folders, or label-file rows) from the data "
                f"or evaluate a model trained on {'them' if len(unknown) > 1 else 'it'}")
        return names, [names.index(c) if c in names else -1 for c in data_classes], "model"
    if k != len(data_classes):
        raise VitftError(f"the model has no label names and {k} outputs, but the data has {len(data_classes)} "
                         f"classes ({', '.join(data_classes[:10])}); classes cannot be matched")
    log.warning("the model has no label names: assuming its %d outputs are the data's classes in sorted order (%s)",
                k, ", ".join(data_classes[:10]))
    return list(data_classes), list(range(k)), "data"


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
    output: Union[str, os.PathLike, None] = DEFAULT_OUTPUT,
    arch: Optional[str] = None,
    progress: Optional[ProgressFn] = None,
    explain: Optional[str] = None,
    val_split: Optional[float] = None,
    seed: Optional[int] = None,
    pretrained: bool = False,
    threads: Optional[int] = None,
    threshold: Optional[float] = None,
    image_column: Optional[str] = None,
    label_column: Optional[str] = None,
) -> Union[EvalReport, MultiLabelReport]:
    """Evaluate a classifier on a labelled dataset (any layout `finetune` accepts).

    `model`: a run/export folder, weights file (with `arch`), `hf-hub:org/repo`, timm name with
    `pretrained=True` (its pretrained weights; without it a name is refused, as `vitft evaluate` refuses it), or a
    built VisionTransformer. `split`: train, val or test (default: test if present, else val).
    Data without a validation folder is split by `val_split` and `seed` (0 by default), as `finetune` splits it;
    a run folder evaluated on the data it was trained on reuses the run's own split, so its validation images
    are the ones training validated on. A single folder of class folders is otherwise evaluated whole.
    report.json, predictions.csv, confusion_matrix.png and mistakes.png are written (atomically) to `output`:
    by default ("auto") the model's folder when it is a local folder (a run), else ./eval-<model name>
    (default_output); with output=None nothing is written. `explain`: rollout, attention or gradcam (explain.py):
    mistakes.png shows that heat map on each image. `threads` fixes torch's CPU threads (default: the free cores,
    as runtime.fit_cpu_threads chooses them). A label file (.csv, .tsv, .jsonl; `image_column`, `label_column`
    name its columns) is evaluated whole, or its test rows when it has a split column.
    A multi-label model (its config.json says so) gives a MultiLabelReport instead (multilabel_report.py):
    labels above each class's threshold (chosen in training, or `threshold` for all).
    """
    check_model_source(model, arch, pretrained)
    dev = check_runtime(batch_size, device, precision)
    if explain is not None:
        check_method(explain)
    if output == DEFAULT_OUTPUT:
        output = default_output(model)
    own = _run_split(model, data) if val_split is None else None
    if own is not None:
        val_split, seed = own[0], own[1] if seed is None else seed
    samples, data_classes, data_info = _eval_samples(data, split, val_split, 0 if seed is None else seed,
                                                     explicit=own is None, columns={"image_column": image_column,
                                                                                    "label_column": label_column})
    if own is not None and " split " in data_info["layout"]:
        log.info("evaluating on the run's own split of %s: %g%% validation, seed %d, as in training "
                 "(--val-split to split otherwise)", printable(str(data)), 100 * val_split, seed)
    present = sorted({i for _, label in samples for i in (label if isinstance(label, tuple) else (label,))})
    net, source = prepare_model(model, arch, img_size)
    precision = choose_precision(dev, precision, model_widths(net)).precision
    for line in describe_weights(net):
        log.info(line)
    classes, to_model, names_from = _match_classes(net, data_classes, present)
    missing = [c for c in classes if c not in {data_classes[i] for i in present}]
    if missing:
        log.warning("model class(es) with no image in the data (support 0): %s", ", ".join(missing[:20]))

    size = tuple(net.patch_embed.img_size)
    transform = build_transforms(net.pretrained_cfg, size, train=False)
    if is_multi_label(net):
        dataset = ImageDataset([(p, _to_model(label, to_model)) for p, label in samples], transform, img_size=size,
                               crop_pct=preprocessing(net.pretrained_cfg).crop_pct, return_index=True,
                               name=f"{data_info['split']} images", num_classes=len(classes))
        context = {"model": {"source": source, "architecture": net.pretrained_cfg.get("architecture"),
                             "num_classes": net.num_classes, "label_names_from": names_from},
                   "data": data_info, "preprocessing": _preprocessing(net, tta),
                   "runtime": {"device": str(dev), "precision": precision, "batch_size": batch_size}}
        return evaluate_multilabel(net, dataset, classes, threshold, context, batch_size, workers, dev, precision,
                                   tta, progress, threads, output)
    if any(isinstance(label, tuple) for _, label in samples):
        raise VitftError(f"{data} has rows with several labels but the model is single-label (softmax); "
                         "evaluate a model trained with multi-label data or --multi-label")
    dataset = ImageDataset([(p, to_model[label]) for p, label in samples], transform, img_size=size,
                           crop_pct=preprocessing(net.pretrained_cfg).crop_pct, return_index=True,
                           name=f"{data_info['split']} images")
    keep, logp, skipped, seconds = infer_all(net, dataset, batch_size, workers, dev, precision, tta, progress,
                                             threads)
    target = torch.tensor([dataset.labels[i] for i in keep], dtype=torch.long)
    _, top5 = top_k_hits(logp, target)
    pred = logp.argmax(dim=1).numpy()
    m = classification_metrics(target.numpy(), pred, int(top5.sum()) if len(classes) > 5 else None, classes)
    loss = float(-logp.gather(1, target[:, None]).double().mean())
    conf = logp.max(dim=1).values.exp().numpy()
    predictions = [{"path": str(dataset.paths[i]), "true_label": classes[t], "predicted_label": classes[p],
                    "confidence": float(c)} for i, t, p, c in zip(keep, target.tolist(), pred, conf)]
    cfg = net.pretrained_cfg
    report = EvalReport(
        accuracy=m["accuracy"], top5=m["top5"], loss=loss, macro_f1=m["macro_f1"],
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


def _to_model(label, to_model: list[int]) -> tuple[int, ...]:
    """A data label (index or tuple of them) as a tuple of model class indices."""
    return tuple(to_model[i] for i in (label if isinstance(label, tuple) else (label,)))


def _mistake_heatmaps(model: VisionTransformer, predictions: list[dict], method: str, device: torch.device,
                      precision: str) -> dict[str, np.ndarray]:
    """Heat maps (explain.py's `method`) of the images mistakes.png shows, by path."""
    shown = [p["path"] for p in shown_mistakes(predictions)]
    if not shown:
        return {}
    results = explain(model, shown, method=method, device=str(device), precision=precision)
    return {r.path: r.heatmap for r in results if r.heatmap is not None}



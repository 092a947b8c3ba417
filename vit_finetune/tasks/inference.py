"""The inference core below evaluate, predict and explain: which model references they accept (the same rules
as the command line's), preparing a classifier, batched inference over a dataset, and top-k."""
from __future__ import annotations

import copy
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..data.datasets import list_images
from ..data.loaders import ImageDataset, build_loader, requested_batches
from ..errors import VitftError
from ..models.pos_embed import to_int_pair
from ..models.vit import VisionTransformer
from ..runtime import check_precision, compute_context, resolve_device
from ..weights.loading import load_model
from ..weights.refs import RefKind, parse_ref

log = logging.getLogger("vitft")

ModelLike = Union[str, os.PathLike, VisionTransformer]
ImagesLike = Union[str, os.PathLike, Iterable[Union[str, os.PathLike]]]
ProgressFn = Callable[[int, int], None]  # (images done, total)


def check_model_source(model: ModelLike, arch: Optional[str], pretrained: bool) -> None:
    """Refuse, before anything is loaded, a path that does not exist and a timm name given without pretrained
    (which would quietly evaluate ImageNet weights where a run folder was meant)."""
    if isinstance(model, torch.nn.Module):
        return
    ref = parse_ref(str(model))
    if ref.kind in (RefKind.FOLDER, RefKind.FILE, RefKind.HUB, RefKind.LOCAL_DIR) or (arch and pretrained):
        return
    if ref.kind is RefKind.MISSING_PATH and not arch:
        raise VitftError(f"model {model} not found; pass a run or model folder, a weights file with --model ARCH, "
                         f"hf-hub:org/repo, or a timm name with --pretrained (pretrained=True in Python)")
    if not arch and not pretrained:
        raise VitftError(f"{model} is not a file or folder; to use the pretrained weights of the timm model "
                         f"{model}, add --pretrained (pretrained=True in Python)")


def label_names(model: VisionTransformer) -> list[str]:
    """The model's class names, else (with a warning) its class indices as strings."""
    names = model.pretrained_cfg.get("label_names")
    if names and len(names) == model.num_classes:
        return [str(n) for n in names]
    log.warning("the model has no label names: labels are class indices")
    return [str(i) for i in range(model.num_classes)]


def is_multi_label(model: VisionTransformer) -> bool:
    """Whether the model is a multi-label classifier (sigmoid outputs), as its config.json says."""
    return bool(model.pretrained_cfg.get("multi_label"))


def thresholds(model: VisionTransformer, override: Optional[float] = None) -> list[float]:
    """A multi-label model's per-class thresholds: `override` for every class if given, else the ones chosen on
    its validation images (0.5 where it has none)."""
    if override is not None:
        if not 0 < override < 1:
            raise VitftError(f"--threshold must be between 0 and 1, got {override}")
        return [float(override)] * model.num_classes
    saved = model.pretrained_cfg.get("thresholds")
    if saved and len(saved) == model.num_classes:
        return [float(t) for t in saved]
    log.warning("the model has no per-class thresholds: using 0.5 (pass --threshold to choose)")
    return [0.5] * model.num_classes


def top_k_hits(scores: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)) -> list[torch.Tensor]:
    """Per k, a bool per row: is the target among the row's k highest scores (k capped at the number of classes)?

    The one top-k accuracy of training's validation and of evaluate.
    """
    ranked = scores.topk(min(max(ks), scores.shape[1]), dim=1).indices == targets[:, None]
    return [ranked[:, :k].any(dim=1) for k in ks]


def prepare_model(model: ModelLike, arch: Optional[str], img_size) -> tuple[VisionTransformer, Optional[str]]:
    """(model, source string): loads paths/names with load_model (check_model_source first); a built model is
    copied if it must be resized."""
    if isinstance(model, VisionTransformer):
        if img_size is not None and to_int_pair(img_size) != tuple(model.patch_embed.img_size):
            model = copy.deepcopy(model)
            model.set_input_size(to_int_pair(img_size))
        return model, None
    if isinstance(model, torch.nn.Module):
        raise VitftError(f"evaluate/predict take a vitft VisionTransformer or a model path/name, not a "
                         f"{type(model).__name__}")
    return load_model(str(model), arch=arch, img_size=img_size), str(model)


def check_runtime(batch_size: int, device: str, precision: str) -> torch.device:
    """The device to run on; an unusable batch size, device or precision fails now, before any loading."""
    if batch_size < 1:
        raise VitftError(f"--batch-size must be at least 1, got {batch_size}")
    dev = resolve_device(device)
    check_precision(dev, precision)
    return dev


def prepare_classifier(model: ModelLike, inputs: ImagesLike, arch: Optional[str], pretrained: bool, img_size,
                       top_k: int, batch_size: int, device: str, precision: str, purpose: str
                       ) -> tuple[torch.device, list[Path], VisionTransformer]:
    """(device, image paths, model) for predict and explain, every argument checked before any image is read."""
    if top_k < 1:
        raise VitftError(f"--top-k must be at least 1, got {top_k}")
    dev = check_runtime(batch_size, device, precision)
    check_model_source(model, arch, pretrained)
    paths = list_images(inputs)
    net, _ = prepare_model(model, arch, img_size)
    if net.num_classes <= 0:
        raise VitftError(f"the model has no classifier head (num_classes=0); {purpose} needs a classifier")
    return dev, paths, net


def infer(model: VisionTransformer, dataset: ImageDataset, batch_size: int, workers: Optional[int],
          device: torch.device, precision: str, tta: bool, progress: Optional[ProgressFn],
          threads: Optional[int] = None) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(requested indices, decoded, log-probabilities) per batch, in dataset order; torch runs on `threads`
    (None: build_loader's choice). A multi-label model's are each class's own (log-sigmoid), else log-softmax.

    `decoded` is False where the requested image failed to decode and another one was used in its place: callers
    drop those rows (see data.loaders.requested_batches).
    """
    loader = build_loader(dataset, batch_size, train=False, workers=workers, threads=threads,
                          device_type=device.type)
    was_training = model.training
    model.to(device).eval()
    log_probs = F.logsigmoid if is_multi_label(model) else functools.partial(F.log_softmax, dim=1)
    done = 0
    try:
        with torch.inference_mode():
            for x, _, requested, decoded in requested_batches(loader):
                x = x.to(device, non_blocking=True)
                with compute_context(device, precision):
                    logits = model(x)
                    flipped = model(torch.flip(x, dims=[3])) if tta else None
                logp = log_probs(logits.float())
                if flipped is not None:  # log of the mean of the two probabilities
                    both = torch.stack([logp, log_probs(flipped.float())])
                    logp = torch.logsumexp(both, dim=0) - math.log(2)
                done += len(requested)
                yield requested, decoded, logp.cpu()
                if progress:
                    progress(done, len(dataset))
    finally:
        model.train(was_training)


def infer_all(model: VisionTransformer, dataset: ImageDataset, batch_size: int, workers: Optional[int],
              device: torch.device, precision: str, tta: bool, progress: Optional[ProgressFn],
              threads: Optional[int] = None) -> tuple[list[int], torch.Tensor, list[str], float]:
    """infer() over the whole dataset: (indices of the images decoded, their log-probabilities in that order, the
    files skipped (unreadable, or failed to decode), seconds). Raises when no image could be decoded."""
    skipped = [str(p) for p in dataset.unreadable]
    keep, logps = [], []
    start = time.perf_counter()
    for requested, decoded, logp in infer(model, dataset, batch_size, workers, device, precision, tta, progress,
                                          threads):
        skipped += [str(dataset.paths[i]) for i in requested[~decoded].tolist()]
        keep += requested[decoded].tolist()
        logps.append(logp[decoded])
    if not keep:
        raise VitftError(f"none of the {len(dataset)} {dataset.name} could be decoded")
    return keep, torch.cat(logps), skipped, time.perf_counter() - start

"""Preprocessing: the albumentations train pipeline (cv2 is faster than PIL) and timm's eval transform, step for
step, both reading their defaults (mean, std, interpolation, crop_pct) from timm's resolve_data_config."""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import cv2
import numpy as np
import torch
from PIL import Image

from ..errors import VitftError
from ..weights.preprocessing import data_config

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # albumentations would otherwise ask PyPI on every import
import albumentations as A  # noqa: E402
from albumentations.pytorch import ToTensorV2  # noqa: E402

INTERPOLATIONS = {
    "bicubic": cv2.INTER_CUBIC,
    "bilinear": cv2.INTER_LINEAR,
    "nearest": cv2.INTER_NEAREST,
    "lanczos": cv2.INTER_LANCZOS4,
    "area": cv2.INTER_AREA,
}
# the same names for PIL, which the eval transform resizes with, as timm does ('area' is PIL's box filter)
PIL_INTERPOLATIONS = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "lanczos": Image.Resampling.LANCZOS,
    "area": Image.Resampling.BOX,
}


def build_transforms(
    pretrained_cfg: dict,
    img_size: int | tuple[int, int],
    *,
    train: bool,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    color_jitter: float = 0.0,
    strong: bool = False,
) -> Callable[..., dict]:
    """timm-equivalent train/eval preprocessing: `transform(image=HWC uint8)["image"]` is a CHW float tensor.

    Training uses albumentations (cv2 is faster than PIL); evaluation is timm's own eval transform (EvalTransform);
    both take their settings from data_config.
    """
    config = data_config(pretrained_cfg, img_size)
    if config["interpolation"] not in INTERPOLATIONS:
        raise VitftError(f"unknown interpolation {config['interpolation']!r} in pretrained_cfg; use one of "
                         f"{', '.join(INTERPOLATIONS)}")
    size, name, mean, std = config["input_size"][1:], config["interpolation"], config["mean"], config["std"]
    if not train:
        return EvalTransform(size, config["crop_pct"], name, mean, std)
    interpolation = INTERPOLATIONS[name]
    ops = [
        A.RandomResizedCrop(size, scale, ratio, interpolation=interpolation, area_for_downscale="image"),
        A.HorizontalFlip(p=hflip),
    ]
    if color_jitter:
        ops.append(A.ColorJitter(color_jitter, color_jitter, color_jitter, hue=0, p=1.0))
    if strong:
        ops += _strong_ops()
    return A.Compose([*ops, A.Normalize(mean, std, max_pixel_value=255.0), ToTensorV2()])


class EvalTransform:
    """timm's eval transform, step for step, so a model predicts the same in vitft and in timm's pipeline.

    As `timm.data.create_transform(**resolve_data_config(...), is_training=False)` (crop_mode 'center'):
    the shorter side is resized to floor(size / crop_pct) with PIL (whose downscaling filters antialias;
    cv2's do not, which moved probabilities by several points at 64 px), a non-square size keeps the aspect
    ratio with both sides at least floor(side / crop_pct), then a centre crop (zero-padded if too small),
    [0, 1] scaling and normalisation, with torchvision's rounding.
    """

    def __init__(self, size: tuple[int, int], crop_pct: float, interpolation: str, mean: Sequence[float],
                 std: Sequence[float]):
        self.size = size
        self.scale_size = tuple(math.floor(s / crop_pct) for s in size)
        self.resample = PIL_INTERPOLATIONS[interpolation]
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)

    def _resized_hw(self, h: int, w: int) -> tuple[int, int]:
        sh, sw = self.scale_size
        if sh == sw:  # torchvision Resize(int): the shorter side to sh, the longer one truncated
            return (sh, int(sh * w / h)) if h <= w else (int(sh * h / w), sh)
        ratio = min(h / sh, w / sw)  # timm's ResizeKeepRatio
        return round(h / ratio), round(w / ratio)

    def __call__(self, *, image: np.ndarray, **_) -> dict:
        h, w = image.shape[:2]
        rh, rw = self._resized_hw(h, w)
        if (rh, rw) != (h, w):
            image = np.asarray(Image.fromarray(image).resize((rw, rh), self.resample))
        ch, cw = self.size
        if ch > rh or cw > rw:  # torchvision's center_crop pads with zeros first
            top, left = max(0, (ch - rh) // 2), max(0, (cw - rw) // 2)
            image = np.pad(image, ((top, max(0, ch - rh) - top), (left, max(0, cw - rw) - left), (0, 0)))
            rh, rw = image.shape[:2]
        top, left = int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))
        crop = image[top:top + ch, left:left + cw]
        x = (crop.astype(np.float32) / np.float32(255) - self.mean) / self.std
        return {"image": torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))}


def _strong_ops() -> list[A.BasicTransform]:
    """TrivialAugment-like: one randomly chosen photometric or geometric op per image, then random erasing."""
    return [
        A.OneOf(
            [
                A.Affine(rotate=(-30, 30), p=1),
                A.Affine(shear=(-15, 15), p=1),
                A.Affine(translate_percent=(-0.2, 0.2), p=1),
                A.RandomBrightnessContrast(0.4, 0.4, p=1),
                A.HueSaturationValue(p=1),
                A.Sharpen(p=1),
                A.Posterize((4, 7), p=1),
                A.Solarize(threshold_range=(0.5, 1.0), p=1),
                A.Equalize(p=1),
                A.AutoContrast(p=1),
                A.ToGray(p=1),
            ],
            p=0.9,  # the remaining 10% is TrivialAugment's identity op
        ),
        A.CoarseDropout(num_holes_range=(1, 1), hole_height_range=(0.1, 0.4), hole_width_range=(0.1, 0.4), p=0.25),
    ]

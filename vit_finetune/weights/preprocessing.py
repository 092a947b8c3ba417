"""The preprocessing a model's weights expect, with timm's defaults where their config says nothing.

The one place the defaults are filled in (timm's `resolve_data_config`: ImageNet mean and std, bicubic,
crop_pct 0.875): training and evaluation transforms, explanations, ONNX export and the weights summary all read it
here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ..models.pos_embed import to_int_pair


@dataclass(frozen=True)
class Preprocessing:
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str
    crop_pct: float  # eval: resize to size / crop_pct, then centre-crop to size


def data_config(pretrained_cfg: dict, img_size: Optional[Union[int, tuple[int, int]]] = None) -> dict:
    """timm's preprocessing settings of a model at `img_size` (default: its config's input size, else 224):
    input_size, interpolation, mean, std, crop_pct, crop_mode, each from `pretrained_cfg` or timm's default."""
    from timm.data import resolve_data_config

    h, w = to_int_pair(img_size) if img_size is not None else pretrained_cfg.get("input_size", (3, 224, 224))[1:]
    return resolve_data_config({"input_size": (3, h, w)}, pretrained_cfg=dict(pretrained_cfg))


def preprocessing(pretrained_cfg: dict) -> Preprocessing:
    """`pretrained_cfg`'s mean, std, interpolation and crop_pct as plain floats, defaults filled in."""
    config = data_config(pretrained_cfg)
    return Preprocessing(mean=tuple(float(m) for m in config["mean"]), std=tuple(float(s) for s in config["std"]),
                         interpolation=str(config["interpolation"]), crop_pct=float(config["crop_pct"]))

"""The preprocessing a model's weights expect, with timm's defaults where their config says nothing.

The one place the defaults are filled in (timm's `resolve_data_config`: ImageNet mean and std, bicubic,
crop_pct 0.875): training, evaluation, explanations, ONNX export and the weights summary all read it here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preprocessing:
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str
    crop_pct: float  # eval: resize to size / crop_pct, then centre-crop to size


def preprocessing(pretrained_cfg: dict) -> Preprocessing:
    """`pretrained_cfg`'s mean, std, interpolation and crop_pct as plain floats, defaults filled in."""
    from timm.data import resolve_data_config

    # resolve_data_config refuses an empty config; the input size is not read from here
    config = resolve_data_config(pretrained_cfg={"input_size": (3, 224, 224), **pretrained_cfg})
    return Preprocessing(mean=tuple(float(m) for m in config["mean"]), std=tuple(float(s) for s in config["std"]),
                         interpolation=str(config["interpolation"]), crop_pct=float(config["crop_pct"]))

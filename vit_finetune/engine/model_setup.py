"""The model a new run starts from: which weights (--pretrained, else --model's own), which architecture, and
the head sized to the data."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..config import TrainConfig
from ..errors import VitftError
from ..models.archs import get_arch
from ..weights.loading import create_model
from ..weights.refs import RefKind, parse_ref


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """The model for a new run: weights from `cfg.pretrained`, head sized to the data."""
    overrides = dict(cfg.model_kwargs, drop_path_rate=cfg.drop_path)
    overrides.pop("num_classes", None)  # always the data's
    img_size = cfg.img_size or overrides.pop("img_size", None)
    pretrained = cfg.pretrained if cfg.pretrained is not None else default_pretrained(cfg.model)
    if is_scratch(cfg):
        name, weights = cfg.model or "vit_b_16", False
    else:
        name, weights = (cfg.model, pretrained) if cfg.model else (pretrained, True)
        if not cfg.model and parse_ref(pretrained).kind is RefKind.FILE:
            raise VitftError(f"--pretrained {pretrained} is a bare weights file: add --model ARCH")
    return create_model(name, pretrained=weights, num_classes=num_classes, img_size=img_size, **overrides)


def is_scratch(cfg: TrainConfig) -> bool:
    """Whether the run trains from a random initialisation (--pretrained none)."""
    return cfg.pretrained is not None and parse_ref(cfg.pretrained).kind is RefKind.NONE


def default_pretrained(model: Optional[str]) -> str:
    """The weights a run uses when --pretrained is not given: the --model's own (its tag, else its
    architecture's default tag), or vit_b_16 when no model is named either."""
    if not model:
        return "vit_b_16"
    arch, tag = parse_ref(model).arch_tag
    tag = tag or get_arch(arch).default_tag
    if not tag:
        raise VitftError(f"{arch} has no pretrained weights; pass --pretrained none to train it from scratch, "
                         "or --pretrained with a weights file")
    return f"{arch}.{tag}"

"""The model a new run starts from: which weights (--pretrained, else --model's own), which architecture, the head
sized to the data, and a LoRA adapter around it (--lora)."""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..config import TrainConfig
from ..errors import VitftError
from ..models.archs import get_arch
from ..weights.adapters import METHODS, apply_lora, base_name, parse_targets, require_peft
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
    model = create_model(name, pretrained=weights, num_classes=num_classes, img_size=img_size, **overrides)
    if not cfg.lora:
        return model
    return apply_lora(model, cfg.lora, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                      targets=parse_targets(cfg.lora_targets), method=cfg.lora_method,
                      base=base_name(pretrained, model.pretrained_cfg.get("source")))


def check_lora(cfg: TrainConfig) -> None:
    """--lora's options, and peft, checked before anything is built."""
    if cfg.lora is None:
        return
    checks = [
        (cfg.lora >= 1, f"--lora is the adapter's rank: at least 1, got {cfg.lora}"),
        (cfg.lora_method in METHODS, f"--lora-method must be one of {', '.join(METHODS)}, got {cfg.lora_method!r}"),
        (cfg.lora_alpha is None or cfg.lora_alpha > 0,
         f"--lora-alpha scales the adapter: it must be positive (0 turns it off), got {cfg.lora_alpha}"),
        (0 <= cfg.lora_dropout < 1, "--lora-dropout must be in [0, 1)"),
        (not is_scratch(cfg), "--lora adapts pretrained weights: drop --pretrained none, or --lora"),
        (not cfg.ema, "--ema with --lora: the EMA would copy every frozen weight, which LoRA avoids; drop --ema"),
    ]
    for ok, message in checks:
        if not ok:
            raise VitftError(message)
    require_peft()


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

"""Model folders out: config.json (timm's format, so timm loads them too) and model.safetensors."""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Optional, Union

import torch

from ..files import write_temp
from ..models.vit import VisionTransformer
from .sources import LOCATION_KEYS, MULTI_LABEL_KEYS, VITFT_MODEL_ARGS


def _plain(value):
    """A tuple as a list: what JSON writes, so that comparisons and config.json agree."""
    return list(value) if isinstance(value, tuple) else value


def model_config(model: VisionTransformer, extra: Optional[dict] = None) -> dict:
    """timm's config.json layout for `model` (what `timm.create_model('local-dir:...')` reads)."""
    cfg = dict(model.pretrained_cfg)
    label_names = cfg.pop("label_names", None)
    arch = cfg.pop("architecture")
    for key in LOCATION_KEYS:
        cfg.pop(key, None)
    cfg.update(num_classes=model.num_classes, input_size=[3, *model.patch_embed.img_size], fixed_input_size=True)
    config = {"architecture": arch, "num_classes": model.num_classes, "num_features": model.num_features,
              "global_pool": model.global_pool}
    if label_names:
        config["label_names"] = list(label_names)
    for key in MULTI_LABEL_KEYS:  # top-level, as label_names: what a reader of the model needs to use it
        if key in cfg:
            config[key] = cfg.pop(key)
    model_args = {k: _plain(v) for k, v in model.model_args.items()}
    vitft_only = {k: model_args.pop(k) for k in list(model_args) if k not in _timm_model_args()}
    if model_args:
        config["model_args"] = model_args
    if vitft_only:
        config[VITFT_MODEL_ARGS] = vitft_only
    config["pretrained_cfg"] = {k: _plain(v) for k, v in cfg.items()}
    config.update(extra or {})
    return config


def _timm_model_args() -> set[str]:
    from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer

    return set(inspect.signature(TimmVisionTransformer.__init__).parameters)


def save_pretrained(model: VisionTransformer, folder: Union[str, Path], extra_config: Optional[dict] = None,
                    dtype: Optional[torch.dtype] = None) -> Path:
    """Write config.json + model.safetensors so timm and vitft both load the folder, replacing both together.

    Both files are written in full to temporary files first (the slow part), then renamed into place one after
    the other: config.json first, model.safetensors second. A reader never sees a half-written file; one that
    reads in the instant between the two renames, or after a crash there, finds the new config.json with the
    previous weights, never new weights under the previous label names and preprocessing.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    state = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in model.state_dict().items()}
    text = json.dumps(model_config(model, extra_config), indent=2) + "\n"
    weights = write_temp(folder / "model.safetensors",
                          lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    try:
        config = write_temp(folder / "config.json", lambda tmp: tmp.write_text(text))
        try:
            os.replace(config, folder / "config.json")
        finally:
            config.unlink(missing_ok=True)
        os.replace(weights, folder / "model.safetensors")
    finally:
        weights.unlink(missing_ok=True)
    return folder

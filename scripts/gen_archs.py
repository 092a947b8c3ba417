"""Regenerate vit_finetune/models/archs.json from the installed timm.

Every timm `vision_transformer` and `deit` entrypoint is called with timm's model
factory intercepted, so we record exactly the hyperparameters timm would build with
(DeiT's distillation token and second head become `distilled: true`).
Layer classes are turned into the plain names the native model understands.
Architectures built from blocks we do not implement (parallel, res-post,
differential attention) are left out.

    python scripts/gen_archs.py
"""
import functools
import json
from pathlib import Path

import timm
import timm.models.deit as timm_deit
import timm.models.vision_transformer as timm_vit
import torch
import torch.nn as nn
from timm.layers import GluMlp, LayerNorm, RmsNorm, SwiGLU

OUT = Path(__file__).resolve().parents[1] / "vit_finetune" / "models" / "archs.json"
UNSUPPORTED = {"block_fn", "attn_layer"}
FACTORY_ONLY = {"cache_dir", "pretrained_cfg", "pretrained_cfg_overlay"}  # create_model plumbing, not hyperparameters
MODULES = ("vision_transformer", "deit")


_CAPTURED: dict = {}
_create_timm_vit = timm_vit._create_vision_transformer
_create_timm_deit = timm_deit._create_deit


def _capture(variant, pretrained=False, **kwargs):
    _CAPTURED[variant] = dict(kwargs)
    return _create_timm_vit(variant, pretrained=pretrained, **kwargs)


def _capture_deit(variant, pretrained=False, distilled=False, **kwargs):
    _CAPTURED[variant] = dict(kwargs, distilled=True) if distilled else dict(kwargs)
    return _create_timm_deit(variant, pretrained=pretrained, distilled=distilled, **kwargs)


def _norm(spec, prefix: str) -> dict:
    """timm norm layer (class, partial or name) -> {'<prefix>_layer': name, '<prefix>_eps': eps}."""
    eps = None
    if isinstance(spec, functools.partial):
        eps = spec.keywords.get("eps")
        spec = spec.func
    names = {LayerNorm: "layernorm", nn.LayerNorm: "layernorm", RmsNorm: "rmsnorm"}
    name = spec if isinstance(spec, str) else names[spec]
    out = {f"{prefix}_layer": name}
    if eps is not None:
        out[f"{prefix}_eps"] = eps
    return out


def _act(spec) -> str:
    return spec if isinstance(spec, str) else {nn.SiLU: "silu", nn.GELU: "gelu"}[spec]


def _mlp(spec) -> str:
    if spec is SwiGLU:
        return "swiglu"
    if isinstance(spec, functools.partial) and spec.func is GluMlp:
        assert spec.keywords == {"act_layer": nn.SiLU, "gate_last": False}, spec.keywords
        return "swiglu_packed"
    raise ValueError(f"unknown mlp layer {spec}")


def native_kwargs(kwargs: dict) -> dict:
    out = {}
    for key, value in kwargs.items():
        if key == "norm_layer":
            out.update(_norm(value, "norm"))
        elif key == "embed_norm_layer":
            out.update(_norm(value, "embed_norm"))
        elif key == "act_layer":
            out[key] = _act(value)
        elif key == "mlp_layer":
            out[key] = _mlp(value)
        elif isinstance(value, tuple):
            out[key] = list(value)
        else:
            out[key] = value
    return out


def main() -> None:
    timm_vit._create_vision_transformer = _capture
    timm_deit._create_deit = _capture_deit
    table = {}
    for name in (n for module in MODULES for n in timm.list_models(module=module)):
        with torch.device("meta"):
            model = timm.create_model(name)
        kwargs = {k: v for k, v in _CAPTURED[name].items() if k not in FACTORY_ONLY}
        if UNSUPPORTED & kwargs.keys():
            continue
        # what timm's builder fills in from the default pretrained cfg
        kwargs.update(num_classes=model.num_classes, global_pool=model.global_pool,
                      img_size=tuple(model.patch_embed.img_size))
        default_cfg = timm.models.get_pretrained_cfg(name)
        table[name] = {
            "kwargs": native_kwargs(kwargs),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
            "img_size": list(model.patch_embed.img_size),
            "patch_size": list(model.patch_embed.patch_size),
            "default_tag": default_cfg.tag if default_cfg else None,
        }
    OUT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(table)} architectures to {OUT}")


if __name__ == "__main__":
    main()

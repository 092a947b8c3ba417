"""Building a native ViT and fitting a checkpoint to it: the one loading pipeline.

`create_model` resolves a name (architecture, alias, `hf-hub:org/repo`, `local-dir:PATH`) and a `pretrained`
value into a `Source` (sources.py), builds the native model, and fits the source's checkpoint to it in one
step for every layout (`fit_checkpoint`): convert to timm's names (layouts.py), resample the patch and position
embeddings, replace the head. What that step did is `model.load_report`. A peft adapter is applied to its base
model (adapters.py). Anything else that does not fit is an error that names the keys: never a silent partial load.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ..errors import VitftError
from ..models.archs import get_arch
from ..models.pos_embed import resize_pos_embed
from ..models.vit import MODEL_DEFAULTS, VisionTransformer, differing_args
from .adapters import adapter_files, apply_saved_adapter, read_adapter
from .layouts import Checkpoint
from .preprocessing import preprocessing
from .refs import RefKind, parse_ref
from .sources import LOCATION_KEYS, MULTI_LABEL_KEYS, Pretrained, Source, resolve

log = logging.getLogger("vitft")

HEAD_KEYS = ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias")  # head_dist: DeiT distilled
# pretrained_cfg entries that describe trained weights: a randomly initialised model must not claim them
_WEIGHTS_KEYS = ("tag", "license", "description", "origin_url", "paper_name", "paper_ids", "notes", "label_names",
                 "label_descriptions", "label_offset", *MULTI_LABEL_KEYS)


@dataclass
class LoadReport:
    """What loading a checkpoint into a model did (`model.load_report`; see `describe_weights`)."""

    layout: str = "timm"  # timm, torchvision, transformers vit / deit / dinov2, or layouts.TIMM_FILTER_LAYOUT
    new: list[str] = field(default_factory=list)  # model parameters initialised here, e.g. "head: new, 6 classes"
    dropped: list[str] = field(default_factory=list)  # checkpoint tensors not loaded, each with why
    resized: list[str] = field(default_factory=list)  # e.g. "position embedding 37x37 -> 16x16"


# ---- building ----------------------------------------------------------------------------------
def create_model(
    name: str,
    pretrained: Pretrained = False,
    num_classes: Optional[int] = None,
    img_size: Optional[Union[int, tuple[int, int]]] = None,
    merge: bool = True,
    **overrides,
) -> VisionTransformer:
    """Build a native ViT by name, optionally with weights; see the module docstring for sources.

    A peft adapter (a folder or Hub repo with adapter_config.json) is applied to its base model, built with the
    base weights; merged into them, or with peft's layers in place when `merge` is False.

    `model.pretrained_cfg` carries the weights' preprocessing (mean, std, interpolation, crop_pct,
    input_size) and label names; `model.model_args` the hyperparameters that differ from the
    architecture's defaults (what an exported config.json records).
    """
    try:
        source = resolve(name, pretrained)
    except VitftError:
        adapter = adapter_files(str(name))  # not a model: an adapter?
        if adapter is None:
            raise
        return _adapted_model(str(name), adapter, merge, num_classes, img_size, overrides)
    return build_model(source, num_classes, img_size, **overrides)


def _adapted_model(name: str, config_file, merge: bool, num_classes: Optional[int], img_size, overrides: dict):
    """A saved adapter on its base model, the head sized by the adapter's."""
    base, classes = read_adapter(config_file)
    model = create_model(base, pretrained=True, num_classes=num_classes or classes, img_size=img_size, **overrides)
    model = apply_saved_adapter(model, config_file, merge)
    model.pretrained_cfg["source"] = name
    return model


def build_model(source: Source, num_classes: Optional[int] = None,
                img_size: Optional[Union[int, tuple[int, int]]] = None, **overrides) -> VisionTransformer:
    """The native model `source` describes, with its weights fitted when it has any."""
    kwargs = _model_kwargs(source, num_classes, img_size, overrides)
    try:
        model = VisionTransformer(**kwargs)
    except (ValueError, TypeError) as err:
        raise VitftError(f"cannot build {source.arch}: {err}") from err
    has_weights = source.fetch_weights is not None
    if has_weights:
        load_checkpoint(model, source.checkpoint(), source.pretrained_cfg)
    model.model_args = differing_args(kwargs, source.arch)
    dropped = LOCATION_KEYS if has_weights else (*LOCATION_KEYS, *_WEIGHTS_KEYS)
    cfg = {k: v for k, v in source.pretrained_cfg.items() if k not in dropped}
    if model.num_classes != cfg.get("num_classes"):  # the head was replaced: the old labels no longer apply
        for key in ("label_names", *MULTI_LABEL_KEYS):
            cfg.pop(key, None)
    cfg.update(architecture=source.arch, num_classes=model.num_classes, source=source.origin,
               input_size=(3, *model.patch_embed.img_size))
    model.pretrained_cfg = cfg
    log.debug("\n".join(describe_weights(model)))
    return model


def _model_kwargs(source: Source, num_classes: Optional[int], img_size, overrides: dict) -> dict:
    unknown = sorted(set(overrides) - set(MODEL_DEFAULTS))
    if unknown:
        raise VitftError(f"unknown model argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(MODEL_DEFAULTS))}")
    kwargs = get_arch(source.arch).kwargs
    cfg = source.pretrained_cfg
    if cfg.get("num_classes") is not None and cfg["num_classes"] >= 0:
        kwargs["num_classes"] = cfg["num_classes"]
    if cfg.get("fixed_input_size") and cfg.get("input_size"):
        kwargs["img_size"] = tuple(cfg["input_size"][-2:])
    kwargs.update(source.model_args, **overrides)
    if img_size is not None:
        kwargs["img_size"] = img_size
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    return kwargs


def load_model(source: str, arch: Optional[str] = None, **kwargs) -> VisionTransformer:
    """A trained model from anything users point at: run/export folder, hub repo, weights file, timm name."""
    ref = parse_ref(source)
    if ref.kind is RefKind.FILE:
        if not arch:
            raise VitftError(f"{source} is a bare weights file: pass the architecture too (--model ARCH)")
        resolved = resolve(arch, ref.path)
        # no config: size the head from the file, else the arch's default head would replace the trained one
        head = resolved.checkpoint().state.get("head.weight")
        if head is not None:
            kwargs.setdefault("num_classes", head.shape[0])
        return build_model(resolved, **kwargs)
    if arch and not ref.is_model_folder:
        return create_model(arch, pretrained=source, **kwargs)
    return create_model(str(source), pretrained=True, **kwargs)


# ---- fitting a checkpoint to the model ------------------------------------------------------------
def load_checkpoint(model: VisionTransformer, checkpoint: Checkpoint, cfg: Optional[dict] = None) -> None:
    """Load `checkpoint` into `model` (fitted by `fit_checkpoint`); clear errors on any mismatch."""
    state, report = fit_checkpoint(checkpoint, model, cfg)
    own = model.state_dict()
    head_missing = [k for k in HEAD_KEYS if k in own and k not in state]
    missing = [k for k in own if k not in state and k not in head_missing]
    unexpected = [k for k in state if k not in own]
    mismatched = [f"{k} {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                  for k in state if k in own and state[k].shape != own[k].shape]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} mis-shaped (e.g. {', '.join(mismatched[:3])})")
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    if problems:
        arch = (cfg or {}).get("architecture", "the model")
        raise VitftError(f"weights {checkpoint.path} do not fit {arch}: {'; '.join(problems)} keys; "
                         "is it a checkpoint of another architecture? pick the matching --model")
    model.load_state_dict(state, strict=not head_missing)
    model.load_report = report


def fit_checkpoint(checkpoint: Checkpoint, model: VisionTransformer,
                   cfg: Optional[dict] = None) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """The adapter step every layout goes through: to timm's names, then the patch and position embeddings
    resampled to the model's, then the head replaced where its size differs; and the report of all three."""
    converted = checkpoint.layout.convert(checkpoint.state, model)
    report = LoadReport(layout=checkpoint.layout.name, dropped=list(converted.dropped))
    state = dict(converted.state)
    _resample_embeddings(state, model, cfg or {}, report, antialias=checkpoint.layout.antialias)
    _replace_head(state, model, report)
    return state, report


def _resample_embeddings(state: dict, model: VisionTransformer, cfg: dict, report: LoadReport,
                         antialias: bool) -> None:
    from timm.layers import resample_patch_embed

    patch_key = "patch_embed.proj.weight"
    if patch_key not in state or "pos_embed" not in state:
        return
    old_grid = _old_grid(state, model, cfg)
    new_patch = model.patch_embed.patch_size
    if tuple(state[patch_key].shape[-2:]) != new_patch:
        report.resized.append(f"patch embedding {_grid(state[patch_key].shape[-2:])} -> {_grid(new_patch)}")
        state[patch_key] = resample_patch_embed(state[patch_key], list(new_patch))
    if old_grid != model.patch_embed.grid_size:
        report.resized.append(f"position embedding {_grid(old_grid)} -> {_grid(model.patch_embed.grid_size)}")
        # transformers resizes without antialiasing (as the original DINOv2 code): do as the weights' owner
        state["pos_embed"] = resize_pos_embed(state["pos_embed"], model.patch_embed.grid_size, old_grid,
                                              0 if model.no_embed_class else model.num_prefix_tokens,
                                              antialias=antialias)


def _old_grid(state: dict, model: VisionTransformer, cfg: dict) -> tuple[int, int]:
    """The patch grid the checkpoint's position embedding was trained on."""
    num_prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    tokens = state["pos_embed"].shape[1] - num_prefix
    patch = state["patch_embed.proj.weight"].shape[-2:]
    if cfg.get("input_size"):
        h, w = cfg["input_size"][-2] // patch[0], cfg["input_size"][-1] // patch[1]
        if h * w == tokens:
            return h, w
    side = round(tokens ** 0.5)
    if side * side != tokens:
        raise VitftError(f"cannot infer the position grid of a {tokens}-token checkpoint; its config needs input_size")
    return side, side


def _grid(size) -> str:
    return "x".join(str(s) for s in size)


def _replace_head(state: dict, model: VisionTransformer, report: LoadReport) -> None:
    own_head = model.state_dict().get("head.weight")
    ckpt_head = state.get("head.weight")
    if ckpt_head is not None and (own_head is None or ckpt_head.shape != own_head.shape):
        if own_head is None:
            report.dropped.append(f"head ({ckpt_head.shape[0]} classes; the model has none)")
        else:
            report.new.append(f"head: new, {model.num_classes} classes (the checkpoint's {ckpt_head.shape[0]}-class "
                              "head re-initialised)")
        for key in HEAD_KEYS:
            state.pop(key, None)
    elif ckpt_head is None and own_head is not None:
        report.new.append(f"head: new, {model.num_classes} classes")


def describe_weights(model: VisionTransformer) -> list[str]:
    """Where the weights came from, what loading them changed, and the preprocessing in force."""
    cfg, report = model.pretrained_cfg, model.load_report
    params = sum(p.numel() for p in model.parameters()) / 1e6
    if report is None:
        lines = [f"weights: {cfg.get('source', 'random init')} ({cfg.get('architecture')}, {params:.1f}M params)"]
    else:
        lines = [f"weights: {cfg.get('source')} [{report.layout} layout] as {cfg.get('architecture')}, "
                 f"{params:.1f}M params"]
        changes = report.resized + report.new + [f"not loaded: {d}" for d in report.dropped]
        lines.append("  " + ("; ".join(changes) if changes else "every tensor loaded as it is"))
    h, w = model.patch_embed.img_size
    pre = preprocessing(cfg)
    mean, std = tuple(round(m, 3) for m in pre.mean), tuple(round(s, 3) for s in pre.std)
    lines.append(f"preprocessing: {h}x{w} (patch {model.patch_embed.patch_size[0]}), mean {mean} std {std}, "
                 f"{pre.interpolation}, crop_pct {pre.crop_pct}")
    return lines

"""Where a model comes from: a reference resolved, once, to an architecture, its arguments and its weights.

`resolve` turns `create_model`'s (name, pretrained) pair into a `Source`: timm tags on the Hub, Hub repos and
model folders (timm's config.json, or transformers' with its preprocessor_config.json), bare weights files.
A source reads its weights file at most once (`Source.checkpoint`), which also gives their layout.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from ..errors import VitftError
from ..models.archs import split_name
from . import transformers_layout as hf
from .download import hub_download
from .layouts import Checkpoint, read_checkpoint
from .refs import ModelRef, RefKind, parse_ref

log = logging.getLogger("vitft")

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PREPROCESSOR_FILE = "preprocessor_config.json"  # transformers' preprocessing (mean, std, size, crop)
# pretrained_cfg entries that are about where weights were, not how to use them
LOCATION_KEYS = ("url", "file", "hf_hub_id", "hf_hub_filename", "source", "state_dict", "architecture")
# config.json key for model arguments timm's VisionTransformer does not take (it has no LayerNorm eps
# argument): vitft reads them back, timm ignores them (and builds with its own eps)
VITFT_MODEL_ARGS = "vitft_model_args"
# a multi-label classifier's config.json says so, with its per-class thresholds (top-level keys, as label_names)
MULTI_LABEL_KEYS = ("multi_label", "thresholds")

Pretrained = Union[bool, str, os.PathLike, None]


@dataclass
class Source:
    """A resolved model: architecture, hyperparameters, preprocessing, and where its weights are."""

    arch: str
    model_args: dict = field(default_factory=dict)
    pretrained_cfg: dict = field(default_factory=dict)
    fetch_weights: Optional[Callable[[], Path]] = None  # the weights file (downloaded on call); None: random init
    origin: str = "random init"
    _checkpoint: Optional[Checkpoint] = field(default=None, repr=False)

    def checkpoint(self) -> Checkpoint:
        """The weights file's tensors and layout, fetched and read on the first call only."""
        if self._checkpoint is None:
            if self.fetch_weights is None:
                raise VitftError(f"{self.origin}: no weights to load")
            self._checkpoint = read_checkpoint(self.fetch_weights())
        return self._checkpoint


def _timm_cfg(arch: str, tag: Optional[str]) -> dict:
    """timm's pretrained config (preprocessing, Hub id, class count) for `arch.tag`."""
    import timm

    full = f"{arch}.{tag}" if tag else arch
    try:
        cfg = timm.models.get_pretrained_cfg(full, allow_unregistered=False) if tag else None
    except RuntimeError:  # timm raises (rather than returning None) for an unknown tag of a known arch
        cfg = None
    if tag and cfg is None:
        tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{arch}.*")]
        raise VitftError(f"unknown pretrained tag {tag!r} for {arch}; available: {', '.join(tags) or 'none'}")
    if cfg is None:
        cfg = timm.models.get_pretrained_cfg(arch)
    out = cfg.to_dict() if cfg is not None else {}
    out.update(architecture=arch, tag=tag or out.get("tag"))
    return out


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise VitftError(f"cannot read model config {path}: {err}") from err


def weights_in(folder: Path) -> Path:
    """The weights file of a model folder, or an error naming the files it should have."""
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise VitftError(f"{folder} has no weights file ({' or '.join(WEIGHT_FILES)})")


def _source_from_config(config: dict, fetch_weights: Optional[Callable[[], Path]], origin: str,
                        preprocessor: Optional[dict] = None) -> Source:
    """A config.json as a Source: timm's format (what timm's push_to_hub and vitft write), or transformers'
    (a vit, deit or dinov2 `model_type`; `preprocessor` is its preprocessor_config.json, if any)."""
    if hf.is_transformers_config(config):
        arch, model_args, cfg = hf.source_args(config, preprocessor, origin)
        return Source(arch, model_args, dict(cfg, architecture=arch), fetch_weights, origin)
    if "architecture" not in config:
        raise VitftError(f"{origin}: config.json has neither 'architecture' (timm) nor 'model_type' (transformers); "
                         "is this a model folder?")
    arch, _ = split_name(config["architecture"])
    cfg = dict(config.get("pretrained_cfg", {}), architecture=arch)
    for key in ("num_classes", "label_names", *MULTI_LABEL_KEYS):
        if key in config:
            cfg[key] = config[key]
    model_args = dict(config.get("model_args", {}), **config.get(VITFT_MODEL_ARGS, {}))
    return Source(arch, model_args, cfg, fetch_weights, origin)


def _folder_source(folder: Path, origin: str) -> Source:
    if not (folder / "config.json").is_file():
        raise VitftError(f"{folder} has no config.json; pass a model folder written by vitft, timm or transformers")
    config = _read_config(folder / "config.json")
    pre = folder / PREPROCESSOR_FILE
    preprocessor = _read_config(pre) if hf.is_transformers_config(config) and pre.is_file() else None
    return _source_from_config(config, lambda: weights_in(folder), origin, preprocessor)


def _hub_source(ref: ModelRef) -> Source:
    config = _read_config(hub_download(ref.target, ("config.json",), ref.revision))
    preprocessor = None
    if hf.is_transformers_config(config):
        try:
            preprocessor = _read_config(hub_download(ref.target, (PREPROCESSOR_FILE,), ref.revision))
        except VitftError:  # optional: without it the model's defaults apply
            log.debug("%s has no %s", ref.text, PREPROCESSOR_FILE)
    return _source_from_config(
        config, lambda: hub_download(ref.target, WEIGHT_FILES, ref.revision), ref.text, preprocessor)


def _named_source(ref: ModelRef) -> Source:
    """A Hub repo or model folder (its own config), else an architecture / alias / arch.tag."""
    if ref.kind is RefKind.HUB:
        return _hub_source(ref)
    if ref.is_model_folder:
        return _folder_source(ref.path, ref.text)
    arch, tag = ref.arch_tag
    cfg = _timm_cfg(arch, tag)

    def download() -> Path:
        if not cfg.get("hf_hub_id"):
            raise VitftError(f"{arch}.{cfg.get('tag')} has no weights on the Hub; pass a weights file")
        files = (cfg["hf_hub_filename"],) if cfg.get("hf_hub_filename") else WEIGHT_FILES
        return hub_download(cfg["hf_hub_id"], files)

    return Source(arch, {}, cfg, download, f"timm/{arch}.{cfg.get('tag')}")


def resolve(name: str, pretrained: Pretrained = False) -> Source:
    """Resolve `create_model`'s (name, pretrained) pair without building anything.

    A bare weights file is read here (once: the source keeps it), as its layout may add model arguments.
    """
    source = _named_source(parse_ref(str(name)))
    weights = parse_ref(pretrained)
    if weights.kind is RefKind.NONE:
        source.fetch_weights, source.origin = None, "random init"
        return source
    if weights.kind is RefKind.DEFAULT:
        return source
    if weights.is_model_folder:
        weights_source = _named_source(weights)
        if weights_source.arch != source.arch:
            raise VitftError(f"{weights.text} holds a {weights_source.arch} model, not {source.arch}; drop --model "
                             f"or pick {weights_source.arch}")
        return weights_source
    if weights.is_local:
        path = weights.path
        if weights.kind is not RefKind.FILE:
            raise VitftError(f"weights file {weights.text} not found")
        source.fetch_weights, source.origin = (lambda: path), str(path)
        source.model_args.update(source.checkpoint().layout.model_args)
        return source
    weights_source = _named_source(weights)  # an arch.tag or alias naming other weights
    if weights_source.arch != source.arch:
        raise VitftError(f"{weights.text} are weights for {weights_source.arch}, not {source.arch}")
    return weights_source

"""Model sources and weight loading: timm tags on the Hub, Hub repos, local folders and files.

`create_model` resolves a name (architecture, alias, `hf-hub:org/repo`, `local-dir:PATH`) and
a `pretrained` value into a hyperparameter set and, lazily, a weights file; builds the native
model; and fits the checkpoint to it (torchvision and transformers layout conversion, patch and
position embedding resampling, classifier re-initialisation), recording what it did in
`model.load_report`. Anything else that does not fit is an error that names the keys: never a
silent partial load.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from timm.data.constants import DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from . import convert
from .archs import get_arch, split_name
from .errors import VitftError
from .files import write_temp
from .model import VisionTransformer
from .pos_embed import resize_pos_embed
from .refs import ModelRef, RefKind, parse_ref

log = logging.getLogger("vitft")

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PREPROCESSOR_FILE = "preprocessor_config.json"  # transformers' preprocessing (mean, std, size, crop)
HEAD_KEYS = ("head.weight", "head.bias", "head_dist.weight", "head_dist.bias")  # head_dist: DeiT distilled
# pretrained_cfg entries that are about where weights were, not how to use them
_LOCATION_KEYS = ("url", "file", "hf_hub_id", "hf_hub_filename", "source", "state_dict", "architecture")
# pretrained_cfg entries that describe trained weights: a randomly initialised model must not claim them
_WEIGHTS_KEYS = ("tag", "license", "description", "origin_url", "paper_name", "paper_ids", "notes", "label_names",
                 "label_descriptions", "label_offset")
_MODEL_ARGS = set(inspect.signature(VisionTransformer.__init__).parameters) - {"self"}
# config.json key for model arguments timm's VisionTransformer does not take (it has no LayerNorm eps
# argument): vitft reads them back, timm ignores them (and builds with its own eps)
VITFT_MODEL_ARGS = "vitft_model_args"

Pretrained = Union[bool, str, os.PathLike, None]
# seconds allowed for the Hub endpoint's name lookup, then for its TCP connect: an unreachable Hub is found out
# within their sum
HUB_LOOKUP_TIMEOUT = 3.0
HUB_CONNECT_TIMEOUT = 3.0


@dataclass
class Source:
    """A resolved model: architecture, hyperparameters, preprocessing, and where its weights are."""

    arch: str
    model_args: dict = field(default_factory=dict)
    pretrained_cfg: dict = field(default_factory=dict)
    weights: Optional[Callable[[], Path]] = None  # fetches (downloads) on call
    origin: str = "random init"


# ---- sources ---------------------------------------------------------------------------------
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


def _hub_unreachable() -> Optional[str]:
    """Why the Hub endpoint cannot be reached (its host does not resolve, or refuses connections), else None.

    One name lookup and one TCP connect with a short timeout: huggingface_hub would otherwise retry an
    unreachable host several times, logging every retry, before giving up.
    """
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as LookupTimeout
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    pool = ThreadPoolExecutor(max_workers=1)  # getaddrinfo has no timeout of its own
    try:
        addresses = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM).result(HUB_LOOKUP_TIMEOUT)
    except LookupTimeout:
        return f"looking up {host} timed out"
    except OSError as err:
        return f"{host} cannot be resolved ({err.strerror or err})"
    finally:
        pool.shutdown(wait=False)
    family, kind, proto, _, address = addresses[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(HUB_CONNECT_TIMEOUT)
            sock.connect(address)
    except OSError as err:
        return f"{host}:{port} does not answer ({err.strerror or type(err).__name__})"
    return None


def _hub_download(repo_id: str, filenames: tuple[str, ...], revision: Optional[str] = None) -> Path:
    """The first of `filenames` that the repo has, through the HF cache (honours HF_HOME, HF_HUB_OFFLINE...).

    An unreachable Hub is found out once, up front: then only the cache is looked at, and the error names
    the ways out.
    """
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    unreachable = None if offline else _hub_unreachable()
    if not offline:
        log.info("fetching %s (%s) from %s%s", repo_id, " or ".join(filenames), constants.ENDPOINT,
                 f": unreachable ({unreachable}), looking in the local cache only" if unreachable else "")
    missing, not_cached = [], None
    for filename in filenames:
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision,
                                        local_files_only=bool(unreachable)))
        except LocalEntryNotFoundError as err:  # a subclass of EntryNotFoundError: test it first
            not_cached = not_cached or err  # the next filename may still be in the cache
            missing.append(filename)
            unreachable = unreachable or "the request failed"  # the other files: from the cache only, no retries
        except EntryNotFoundError:
            missing.append(filename)
        except RepositoryNotFoundError as err:
            raise VitftError(f"Hub repo {repo_id!r} not found (or private: set HF_TOKEN)") from err
    if not_cached is not None:
        why = ("HF_HUB_OFFLINE is set" if offline
               else f"the Hub at {constants.ENDPOINT} cannot be reached ({unreachable})")
        raise VitftError(
            f"{repo_id}/{' or '.join(missing)} is not in the local HF cache and {why}; download it once with "
            "network access, pass --pretrained PATH (a local weights file or model folder)"
            + ("" if offline else ", or set HF_HUB_OFFLINE=1 to use the local cache only")) from not_cached
    raise VitftError(f"Hub repo {repo_id!r} has none of {', '.join(missing)}")


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise VitftError(f"cannot read model config {path}: {err}") from err


def _weights_in(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise VitftError(f"{folder} has no weights file ({' or '.join(WEIGHT_FILES)})")


def _source_from_config(config: dict, weights: Optional[Callable[[], Path]], origin: str,
                        preprocessor: Optional[dict] = None) -> Source:
    """A config.json as a Source: timm's format (what timm's push_to_hub and vitft write), or transformers'
    (a vit, deit or dinov2 `model_type`; `preprocessor` is its preprocessor_config.json, if any)."""
    if convert.is_transformers_config(config):
        arch, model_args, cfg = convert.source_args(config, preprocessor, origin)
        return Source(arch, model_args, dict(cfg, architecture=arch), weights, origin)
    if "architecture" not in config:
        raise VitftError(f"{origin}: config.json has neither 'architecture' (timm) nor 'model_type' (transformers); "
                         "is this a model folder?")
    arch, _ = split_name(config["architecture"])
    cfg = dict(config.get("pretrained_cfg", {}), architecture=arch)
    for key in ("num_classes", "label_names"):
        if key in config:
            cfg[key] = config[key]
    model_args = dict(config.get("model_args", {}), **config.get(VITFT_MODEL_ARGS, {}))
    return Source(arch, model_args, cfg, weights, origin)


def _folder_source(folder: Path, origin: str) -> Source:
    if not (folder / "config.json").is_file():
        raise VitftError(f"{folder} has no config.json; pass a model folder written by vitft, timm or transformers")
    config = _read_config(folder / "config.json")
    pre = folder / PREPROCESSOR_FILE
    preprocessor = _read_config(pre) if convert.is_transformers_config(config) and pre.is_file() else None
    return _source_from_config(config, lambda: _weights_in(folder), origin, preprocessor)


def _hub_source(ref: ModelRef) -> Source:
    config = _read_config(_hub_download(ref.target, ("config.json",), ref.revision))
    preprocessor = None
    if convert.is_transformers_config(config):
        try:
            preprocessor = _read_config(_hub_download(ref.target, (PREPROCESSOR_FILE,), ref.revision))
        except VitftError:  # optional: without it the model's defaults apply
            log.debug("%s has no %s", ref.text, PREPROCESSOR_FILE)
    return _source_from_config(
        config, lambda: _hub_download(ref.target, WEIGHT_FILES, ref.revision), ref.text, preprocessor)


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
        return _hub_download(cfg["hf_hub_id"], files)

    return Source(arch, {}, cfg, download, f"timm/{arch}.{cfg.get('tag')}")


def resolve(name: str, pretrained: Pretrained = False) -> Source:
    """Resolve `create_model`'s (name, pretrained) pair without building anything."""
    source = _named_source(parse_ref(str(name)))
    weights = parse_ref(pretrained)
    if weights.kind is RefKind.NONE:
        source.weights, source.origin = None, "random init"
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
        source.weights, source.origin = (lambda: path), str(path)
        keys = _checkpoint_keys(path)
        layout = convert.detect_layout(keys)
        if layout:  # a bare transformers file: the named architecture plus what the layout implies
            source.model_args.update(convert.layout_args(layout, keys))
        return source
    weights_source = _named_source(weights)  # an arch.tag or alias naming other weights
    if weights_source.arch != source.arch:
        raise VitftError(f"{weights.text} are weights for {weights_source.arch}, not {source.arch}")
    return weights_source


# ---- building ----------------------------------------------------------------------------------
def _model_kwargs(source: Source, num_classes: Optional[int], img_size, overrides: dict) -> dict:
    unknown = sorted(set(overrides) - _MODEL_ARGS)
    if unknown:
        raise VitftError(f"unknown model argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(_MODEL_ARGS))}")
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


def create_model(
    name: str,
    pretrained: Pretrained = False,
    num_classes: Optional[int] = None,
    img_size: Optional[Union[int, tuple[int, int]]] = None,
    **overrides,
) -> VisionTransformer:
    """Build a native ViT by name, optionally with weights; see the module docstring for sources.

    `model.pretrained_cfg` carries the weights' preprocessing (mean, std, interpolation, crop_pct,
    input_size) and label names; `model.model_args` the hyperparameters that differ from the
    architecture's defaults (what an exported config.json records).
    """
    source = resolve(name, pretrained)
    kwargs = _model_kwargs(source, num_classes, img_size, overrides)
    try:
        model = VisionTransformer(**kwargs)
    except (ValueError, TypeError) as err:
        raise VitftError(f"cannot build {source.arch}: {err}") from err
    if source.weights is not None:
        load_weights(model, source.weights(), source.pretrained_cfg)
    defaults = get_arch(source.arch).kwargs
    model.model_args = {k: v for k, v in kwargs.items()
                        if k != "num_classes" and _plain(v) != _plain(defaults.get(k, _default_arg(k)))}
    dropped = _LOCATION_KEYS if source.weights is not None else (*_LOCATION_KEYS, *_WEIGHTS_KEYS)
    cfg = {k: v for k, v in source.pretrained_cfg.items() if k not in dropped}
    if model.num_classes != cfg.get("num_classes"):
        cfg.pop("label_names", None)  # the head was replaced: the old labels no longer apply
    cfg.update(architecture=source.arch, num_classes=model.num_classes, source=source.origin,
               input_size=(3, *model.patch_embed.img_size))
    model.pretrained_cfg = cfg
    log.debug("\n".join(describe_weights(model)))
    return model


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _default_arg(name: str):
    return inspect.signature(VisionTransformer.__init__).parameters[name].default


# ---- reading checkpoints -----------------------------------------------------------------------
def _checkpoint_keys(path: Path) -> list[str]:
    """The tensor names in a checkpoint (a .safetensors file's header only)."""
    if path.suffix == ".safetensors" and _utf8(path):  # safetensors opens UTF-8 paths only
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception:  # noqa: BLE001 - read_state_dict reports a broken file when it is loaded
            return []
    return list(read_state_dict(path))


def _utf8(path: Path) -> bool:
    """Whether `path` is valid UTF-8 (on Linux, names with other bytes come back as surrogate characters)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors or torch checkpoint, unwrapped from training wrappers."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load, load_file

            # safetensors takes UTF-8 paths only; a name with other bytes (a surrogate here) is read by Python
            state = load_file(str(path)) if _utf8(path) else load(path.read_bytes())
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any parse failure means the same thing to the user
        # weights_only met an object that unpickling would construct or call: the file could run code
        blocked = re.search(r"GLOBAL (\S+)", str(err)) if isinstance(err, pickle.UnpicklingError) else None
        if blocked:
            raise VitftError(f"refusing {path}: it holds pickled Python objects ({blocked.group(1)}) that could run "
                             "code; weights are read as tensors only: save a plain state dict or .safetensors") \
                from err
        raise VitftError(f"cannot read weights from {path}: corrupted or not a checkpoint ({type(err).__name__})") \
            from err
    for wrapper in ("state_dict", "model", "module"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VitftError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in state.items()}


TIMM_FILTER_LAYOUT = "converted by timm's filter"


_GAMMA_KEY = re.compile(r"\.gamma_\d$")  # LayerScale as DeiT-3 and BEiT name it (timm: .ls1.gamma)


def is_timm_layout(state: dict) -> bool:
    """timm's own names (vitft's too): a conv patch embedding, and nothing timm's filter would rename."""
    patch = state.get("patch_embed.proj.weight")
    return patch is not None and patch.ndim == 4 and "mask_token" not in state and not any(
        _GAMMA_KEY.search(k) for k in state)


def timm_filter(state: dict, model: VisionTransformer) -> dict:
    """Foreign layouts as timm adapts them on load: OpenAI CLIP, OpenCLIP, original DINOv2 (mask_token,
    register tokens, w12/w3), BEiT-3, DeiT-3's gamma_ LayerScale, a linear patch embedding...

    timm's `checkpoint_filter_fn`, with adapt_layer_scale where there are gamma_ keys (as DeiT's filter),
    which reads only the parameter shapes and token settings that the native model shares with timm's.
    """
    from timm.models.vision_transformer import checkpoint_filter_fn

    return checkpoint_filter_fn(state, model, adapt_layer_scale=any(_GAMMA_KEY.search(k) for k in state))


def is_torchvision(state: dict) -> bool:
    return "conv_proj.weight" in state and "encoder.pos_embedding" in state


def convert_torchvision(state: dict) -> dict:
    """torchvision's `VisionTransformer` keys -> timm's names (same tensors, no reordering needed)."""
    if any(k.startswith("heads.pre_logits") for k in state):
        raise VitftError("torchvision ViTs with a representation (pre_logits) layer are not supported")
    renames = [
        (r"^conv_proj\.", "patch_embed.proj."),
        (r"^class_token$", "cls_token"),
        (r"^encoder\.pos_embedding$", "pos_embed"),
        (r"^encoder\.ln\.", "norm."),
        (r"^heads\.head\.", "head."),
        (r"^encoder\.layers\.encoder_layer_(\d+)\.", r"blocks.\1."),
        (r"\.ln_1\.", ".norm1."), (r"\.ln_2\.", ".norm2."),
        (r"\.self_attention\.in_proj_(weight|bias)$", r".attn.qkv.\1"),
        (r"\.self_attention\.out_proj\.", ".attn.proj."),
        (r"\.mlp\.(0|linear_1)\.", ".mlp.fc1."), (r"\.mlp\.(3|linear_2)\.", ".mlp.fc2."),
    ]
    out = {}
    for key, value in state.items():
        for pattern, repl in renames:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


# ---- fitting a checkpoint to the model ------------------------------------------------------------
@dataclass
class LoadReport:
    """What loading a checkpoint into a model did (`model.load_report`; see `describe_weights`)."""

    layout: str = "timm"  # timm, torchvision, transformers vit / deit / dinov2, or TIMM_FILTER_LAYOUT
    new: list[str] = field(default_factory=list)  # model parameters initialised here, e.g. "head: new, 6 classes"
    dropped: list[str] = field(default_factory=list)  # checkpoint tensors not loaded, each with why
    resized: list[str] = field(default_factory=list)  # e.g. "position embedding 37x37 -> 16x16"


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
    mean = tuple(round(float(m), 3) for m in cfg.get("mean", IMAGENET_DEFAULT_MEAN))
    std = tuple(round(float(s), 3) for s in cfg.get("std", IMAGENET_DEFAULT_STD))
    lines.append(f"preprocessing: {h}x{w} (patch {model.patch_embed.patch_size[0]}), mean {mean} std {std}, "
                 f"{cfg.get('interpolation', 'bicubic')}, crop_pct {cfg.get('crop_pct', DEFAULT_CROP_PCT)}")
    return lines


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


def adapt_state_dict(state: dict, model: VisionTransformer, cfg: Optional[dict] = None,
                     report: Optional[LoadReport] = None) -> dict:
    """Fit `state` to `model`: patch and position embedding resampling, classifier drop.

    What it changes is recorded in `report` (a new one by default), which becomes `model.load_report`.
    """
    from timm.layers import resample_patch_embed

    cfg = cfg or {}
    report = report or LoadReport()
    model.load_report = report
    state = dict(state)
    patch_key = "patch_embed.proj.weight"
    if patch_key in state and "pos_embed" in state:
        old_grid = _old_grid(state, model, cfg)
        new_patch = model.patch_embed.patch_size
        if tuple(state[patch_key].shape[-2:]) != new_patch:
            report.resized.append(f"patch embedding {_grid(state[patch_key].shape[-2:])} -> {_grid(new_patch)}")
            state[patch_key] = resample_patch_embed(state[patch_key], list(new_patch))
        if old_grid != model.patch_embed.grid_size:
            report.resized.append(f"position embedding {_grid(old_grid)} -> {_grid(model.patch_embed.grid_size)}")
            # transformers resizes without antialiasing (as the original DINOv2 code): do as the weights' owner
            state["pos_embed"] = resize_pos_embed(
                state["pos_embed"], model.patch_embed.grid_size, old_grid,
                0 if model.no_embed_class else model.num_prefix_tokens,
                antialias=not report.layout.startswith("transformers"))
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
    return state


def load_weights(model: VisionTransformer, path: Path, cfg: Optional[dict] = None) -> None:
    """Load a checkpoint file into `model`, converting and adapting it; clear errors on any mismatch."""
    state = read_state_dict(path)
    report = LoadReport()
    transformers_layout = convert.detect_layout(state)
    if is_torchvision(state):
        state, report.layout = convert_torchvision(state), "torchvision"
    elif transformers_layout:
        state, report.dropped = convert.convert_state_dict(state, transformers_layout)
        report.layout = f"transformers {transformers_layout}"
    elif not is_timm_layout(state):
        state, report.layout = timm_filter(state, model), TIMM_FILTER_LAYOUT
    state = adapt_state_dict(state, model, cfg, report)
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
        raise VitftError(f"weights {path} do not fit {arch}: {'; '.join(problems)} keys; "
                         "is it a checkpoint of another architecture? pick the matching --model")
    model.load_state_dict(state, strict=not head_missing)


# ---- writing model folders ------------------------------------------------------------------------
def model_config(model: VisionTransformer, extra: Optional[dict] = None) -> dict:
    """timm's config.json layout for `model` (what `timm.create_model('local-dir:...')` reads)."""
    cfg = dict(model.pretrained_cfg)
    label_names = cfg.pop("label_names", None)
    arch = cfg.pop("architecture")
    for key in _LOCATION_KEYS:
        cfg.pop(key, None)
    cfg.update(num_classes=model.num_classes, input_size=[3, *model.patch_embed.img_size], fixed_input_size=True)
    config = {"architecture": arch, "num_classes": model.num_classes, "num_features": model.num_features,
              "global_pool": model.global_pool}
    if label_names:
        config["label_names"] = list(label_names)
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


def load_model(source: str, arch: Optional[str] = None, **kwargs) -> VisionTransformer:
    """A trained model from anything users point at: run/export folder, hub repo, weights file, timm name."""
    ref = parse_ref(source)
    if ref.kind is RefKind.FILE:
        if not arch:
            raise VitftError(f"{source} is a bare weights file: pass the architecture too (--model ARCH)")
        # no config: size the head from the file, else the arch's default head would replace the trained one
        head = read_state_dict(ref.path).get("head.weight")
        if head is not None:
            kwargs.setdefault("num_classes", head.shape[0])
        return create_model(arch, pretrained=ref.path, **kwargs)
    if arch and not ref.is_model_folder:
        return create_model(arch, pretrained=source, **kwargs)
    return create_model(str(source), pretrained=True, **kwargs)

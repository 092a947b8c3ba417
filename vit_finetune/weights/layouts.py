"""Checkpoint layouts: whose names a state dict uses, and how it becomes the native model's.

A checkpoint file is read once (`read_checkpoint`) and its layout recognised once, from the tensor names alone
(`detect_layout`, the only code that looks). A layout converts the tensors to timm's names at the checkpoint's
own geometry: resampling position and patch embeddings and replacing the head happen afterwards, in one step
for every layout (`loading.fit_checkpoint`), which is what makes the load report true for all of them.

Adding a layout is adding one recogniser to `RECOGNISERS`: a function from a state dict to a `Layout` (its name
in the load report, its conversion, the model arguments a bare file in it implies), or None when not its own.
"""
from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ..errors import VitftError
from ..models.vit import VisionTransformer
from . import transformers_layout as hf

TIMM_FILTER_LAYOUT = "converted by timm's filter"
_GAMMA_KEY = re.compile(r"\.gamma_\d$")  # LayerScale as DeiT-3 and BEiT name it (timm: .ls1.gamma)


@dataclass(frozen=True)
class Converted:
    """A state dict in timm's names, and the checkpoint tensors left out, each with why."""

    state: dict[str, torch.Tensor]
    dropped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Layout:
    name: str  # as the load report shows it: timm, torchvision, transformers vit, ...
    convert: Callable[[dict, VisionTransformer], Converted]  # to timm's names; must not resample anything
    model_args: dict = field(default_factory=dict)  # what a bare file needs beyond its named architecture
    antialias: bool = True  # how the weights' owner resizes position embeddings (transformers does not antialias)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: dict[str, torch.Tensor]
    layout: Layout


def read_checkpoint(path: Path) -> Checkpoint:
    """The file's tensors and their layout: the one read of a weights file."""
    state = read_state_dict(path)
    return Checkpoint(Path(path), state, detect_layout(state))


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


def _utf8(path: Path) -> bool:
    """Whether `path` is valid UTF-8 (on Linux, names with other bytes come back as surrogate characters)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def detect_layout(state: dict) -> Layout:
    """The layout of `state`: the first recogniser that claims it (the last, timm's filter, claims any)."""
    return next(layout for recognise in RECOGNISERS if (layout := recognise(state)) is not None)


# ---- the layouts -----------------------------------------------------------------------------------
_TORCHVISION_RENAMES = [
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


def torchvision_layout(state: dict) -> Optional[Layout]:
    """torchvision's `VisionTransformer`: other names, the same tensors (no reordering needed)."""
    if "conv_proj.weight" not in state or "encoder.pos_embedding" not in state:
        return None

    def convert(state: dict, model: VisionTransformer) -> Converted:
        if any(k.startswith("heads.pre_logits") for k in state):
            raise VitftError("torchvision ViTs with a representation (pre_logits) layer are not supported")
        out = {}
        for key, value in state.items():
            for pattern, repl in _TORCHVISION_RENAMES:
                key = re.sub(pattern, repl, key)
            out[key] = value
        return Converted(out)

    return Layout("torchvision", convert)


def transformers_layout(state: dict) -> Optional[Layout]:
    """Hugging Face transformers' ViT, DeiT and DINOv2 (BERT-style names, query/key/value apart)."""
    kind = hf.kind_of(state)
    if kind is None:
        return None
    return Layout(f"transformers {kind}", lambda state, model: Converted(*hf.convert_state_dict(
        state, kind)), hf.layout_args(kind, state), antialias=False)


def timm_layout(state: dict) -> Optional[Layout]:
    """timm's own names (vitft's too): a conv patch embedding, and nothing timm's filter would rename."""
    patch = state.get("patch_embed.proj.weight")
    if patch is None or patch.ndim != 4 or "mask_token" in state or any(_GAMMA_KEY.search(k) for k in state):
        return None
    return Layout("timm", lambda state, model: Converted(dict(state)))


def timm_filter_layout(state: dict) -> Layout:
    """Any other layout, as timm's `checkpoint_filter_fn` adapts it on load: OpenAI CLIP, OpenCLIP, the original
    DINOv2 (mask_token, register tokens, w12/w3), BEiT-3, DeiT-3's gamma_ LayerScale, a linear patch embedding...

    The filter resamples embeddings too when its model's shapes differ from the checkpoint's. It is given a view
    of the model with the checkpoint's patch kernel and no position embedding, so it only renames: the one
    resampling step (and its report) comes after, as for every layout.
    """
    def convert(state: dict, model: VisionTransformer) -> Converted:
        from timm.models.vision_transformer import checkpoint_filter_fn

        kernels = {tuple(v.shape) for v in state.values() if v.ndim == 4}  # a ViT has one conv: the patch kernel
        kernel = kernels.pop() if len(kernels) == 1 else tuple(model.patch_embed.proj.weight.shape)
        view = SimpleNamespace(  # what the filter reads of its model
            pos_embed=None, head=model.head,
            patch_embed=SimpleNamespace(proj=SimpleNamespace(weight=torch.empty(kernel, device="meta"))))
        adapt_layer_scale = any(_GAMMA_KEY.search(k) for k in state)  # as timm's DeiT-3 filter
        return Converted(checkpoint_filter_fn(dict(state), view, adapt_layer_scale=adapt_layer_scale))

    return Layout(TIMM_FILTER_LAYOUT, convert)


RECOGNISERS: tuple[Callable[[dict], Optional[Layout]], ...] = (
    torchvision_layout, transformers_layout, timm_layout, timm_filter_layout)

"""Checkpoints in Hugging Face transformers' layout (ViT, DeiT, DINOv2) as native ViTs.

transformers names modules after BERT, keeps query, key and value as three linears and writes its
hyperparameters to a config.json with a `model_type`; timm (and so vitft) fuses qkv and has its own
names. `source_args` turns such a config (and preprocessor_config.json) into the closest architecture
of the table plus the arguments that differ; `convert_state_dict` renames and fuses the tensors.
A DeiT's distillation token becomes a register token: the same extra prefix token with a position
embedding, which timm's ViT also has.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from ..errors import VitftError
from ..models.archs import list_archs
from ..models.pos_embed import to_int_pair
from ..models.vit import differing_args

# the transformers classes whose weights map onto a native ViT one to one
SUPPORTED_CLASSES = {
    "vit": ("ViTModel", "ViTForImageClassification"),
    "deit": ("DeiTModel", "DeiTForImageClassification", "DeiTForImageClassificationWithTeacher"),
    "dinov2": ("Dinov2Model", "Dinov2ForImageClassification", "Dinov2Backbone"),
}
# the architectures of the table a layout may become
_FAMILIES = {"vit": r"^vit_[a-z]+_patch\d+_(224|384)$", "deit": r"^vit_[a-z]+_patch\d+_(224|384)$",
             "deit_distilled": r"^deit_[a-z]+_distilled_patch\d+_(224|384)$", "dinov2": r"^vit_[a-z]+_patch14_dinov2$"}
_TEACHER_HEADS = ("cls_classifier.", "distillation_classifier.")  # DeiTForImageClassificationWithTeacher's
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "quick_gelu": "quick_gelu", "silu": "silu", "swish": "silu"}
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic"}  # PIL's resample codes
_HALF = [0.5, 0.5, 0.5]  # transformers' IMAGENET_STANDARD_MEAN and _STD


def _default_preprocessor(layout: str, image_size: tuple[int, int]) -> dict:
    """For a checkpoint saved without preprocessor_config.json: the mean, std, resample and crop of the image
    processor class transformers pairs with `layout` (ViTImageProcessor, DeiTImageProcessor, BitImageProcessor
    for DINOv2), at the checkpoint's own image size."""
    h, w = image_size
    size = {"height": h, "width": w}
    if layout == "vit":  # a squash to the input size
        return {"image_mean": _HALF, "image_std": _HALF, "resample": 2, "size": size}
    if layout == "deit":  # resize to 256/224 of the input size, then a centre crop
        return {"image_mean": _HALF, "image_std": _HALF, "resample": 3, "do_center_crop": True,
                "size": {"height": h * 256 // 224, "width": w * 256 // 224}, "crop_size": size}
    return {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "resample": 3, "size": {"shortest_edge": min(h, w)}, "do_center_crop": True, "crop_size": size}
_PREFIXES = ("vit.", "deit.", "dinov2.")
_PATCH_KEY = "embeddings.patch_embeddings.projection.weight"
_DROPPED = {  # transformers tensors a native ViT has no place for, and why they are not needed
    r"^embeddings\.mask_token$": "masked-image-modeling token",
    r"^pooler\.": "transformers' tanh pooler, not used for classification",
}
# (pattern, replacement) over keys without the model prefix; legacy (saved) and in-memory names
_RENAMES = [
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.distillation_token$", "reg_token"),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^(?:encoder\.layer|layers)\.(\d+)\.", r"blocks.\1."),
    (r"^layernorm\.", "norm."),
    (r"^classifier\.", "head."),
    (r"\.layernorm_before\.", ".norm1."), (r"\.layernorm_after\.", ".norm2."),
    (r"\.attention\.(?:output\.dense|o_proj)\.", ".attn.proj."),
    (r"\.intermediate\.dense\.", ".mlp.fc1."), (r"\.output\.dense\.", ".mlp.fc2."),
    (r"\.mlp\.weights_in\.", ".mlp.fc1."), (r"\.mlp\.(?:weights_out|down_proj)\.", ".mlp.fc2."),
    (r"\.layer_scale(\d)\.lambda1$", r".ls\1.gamma"),
]
# split tensors the native model keeps fused, in the order it concatenates them
_FUSED = [
    (r"^(blocks\.\d+)\.attention\.(?:attention\.)?(query|key|value|q_proj|k_proj|v_proj)\.(weight|bias)$",
     r"\1.attn.qkv.\3", {"query": 0, "q_proj": 0, "key": 1, "k_proj": 1, "value": 2, "v_proj": 2}),
    (r"^(blocks\.\d+)\.mlp\.(gate_proj|up_proj)\.(weight|bias)$", r"\1.mlp.fc1.\3", {"gate_proj": 0, "up_proj": 1}),
]


def is_transformers_config(config: dict) -> bool:
    """A transformers config.json (a `model_type`) rather than timm's (an `architecture`)."""
    return "model_type" in config and "architecture" not in config


def _unprefixed(key: str) -> str:
    return key[key.index(".") + 1:] if key.startswith(_PREFIXES) else key


def kind_of(keys) -> Optional[str]:
    """'vit', 'deit' or 'dinov2' for a state dict in transformers' layout, None for any other."""
    keys = {_unprefixed(k) for k in keys}
    if _PATCH_KEY not in keys:
        return None
    if any(".layer_scale1." in k for k in keys):
        return "dinov2"
    return "deit" if "embeddings.distillation_token" in keys else "vit"


def check_layout(model_type: Optional[str], class_name: Optional[str], origin: str) -> str:
    """The layout of a transformers model, or one error naming what vitft cannot convert."""
    supported = ", ".join(c for names in SUPPORTED_CLASSES.values() for c in names)
    if model_type not in SUPPORTED_CLASSES:
        raise VitftError(f"{origin}: transformers model_type {model_type!r}{f' ({class_name})' if class_name else ''}"
                         f" cannot be converted to a ViT; vitft converts {supported}")
    if class_name and class_name not in SUPPORTED_CLASSES[model_type]:
        raise VitftError(f"{origin}: transformers {class_name} (model_type {model_type!r}) cannot be "
                         f"converted; vitft converts {supported}")
    return model_type


def _mlp_ratio(hidden: int, dim: int) -> float:
    """A ratio r with int(dim * r) == hidden, as both the native model and timm size the MLP."""
    ratio = hidden / dim
    return ratio if int(dim * ratio) == hidden else (hidden + 0.5) / dim


def _preprocessing(pre: dict, image_size: tuple[int, int]) -> tuple[dict, tuple[int, int]]:
    """preprocessor_config.json -> (timm-style mean/std/interpolation/crop_pct, input size)."""
    out = {}
    if pre.get("do_normalize", True):
        if "image_mean" in pre:
            out["mean"] = tuple(float(v) for v in pre["image_mean"])
        if "image_std" in pre:
            out["std"] = tuple(float(v) for v in pre["image_std"])
    else:
        out.update(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    if pre.get("resample") in _RESAMPLE:
        out["interpolation"] = _RESAMPLE[pre["resample"]]
    size = pre.get("size") if pre.get("do_resize", True) else None
    if isinstance(size, int):
        size = {"shortest_edge": size}
    resized = None
    if isinstance(size, dict):
        resized = (size["height"], size["width"]) if "height" in size else (
            (size["shortest_edge"],) * 2 if "shortest_edge" in size else None)
    crop = pre.get("crop_size") if pre.get("do_center_crop") else None
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    if crop and resized:
        input_size = (crop["height"], crop["width"])
        out["crop_pct"] = round(input_size[0] / resized[0], 4)
    elif resized:
        input_size = resized
        out["crop_pct"] = 1.0
    else:
        input_size = image_size
    return out, input_size


def model_kwargs(config: dict) -> dict:
    """The native ViT's hyperparameters for a transformers vit/deit/dinov2 config (no head size).

    A DeiT's distillation token becomes a register token, unread, unless the checkpoint is a
    DeiTForImageClassificationWithTeacher: then it is timm's distilled DeiT, with the second head on it.
    """
    layout = config["model_type"]
    dim = config["hidden_size"]
    act = config.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise VitftError(f"transformers hidden_act {act!r} has no counterpart in vitft; "
                         f"supported: {', '.join(_ACTIVATIONS)}")
    kwargs = dict(patch_size=to_int_pair(config.get("patch_size", 16)), embed_dim=dim,
                  depth=config["num_hidden_layers"],
                  num_heads=config["num_attention_heads"], qkv_bias=config.get("qkv_bias", True),
                  norm_eps=config.get("layer_norm_eps", 1e-12), act_layer=_ACTIVATIONS[act], global_pool="token")
    if layout == "dinov2":
        hidden = int(dim * config.get("mlp_ratio", 4))
        if config.get("use_swiglu_ffn"):  # gate and value packed in one fc1, as timm's SwiGLUPacked
            hidden = 2 * ((int(hidden * 2 / 3) + 7) // 8 * 8)
            kwargs.update(mlp_layer="swiglu_packed", act_layer="silu")
        kwargs.update(mlp_ratio=_mlp_ratio(hidden, dim), init_values=config.get("layerscale_value", 1.0))
    else:
        kwargs["mlp_ratio"] = _mlp_ratio(config.get("intermediate_size", 4 * dim), dim)
    if layout == "deit":
        kwargs.update(_deit_tokens(_is_teacher_class((config.get("architectures") or [None])[0])))
    return kwargs


def _is_teacher_class(class_name: Optional[str]) -> bool:
    return class_name == "DeiTForImageClassificationWithTeacher"


def _deit_tokens(distilled: bool) -> dict:
    """Where a transformers DeiT's distillation token goes: timm's dist_token (two heads), or a register token."""
    return {"distilled": True} if distilled else {"reg_tokens": 1}


def closest_arch(layout: str, kwargs: dict) -> tuple[str, dict]:
    """The architecture of the table needing the fewest changes, and those changes (model_args)."""
    candidates = [name for name in list_archs() if re.match(_FAMILIES[layout], name)]
    arch = min(candidates, key=lambda name: (len(differing_args(kwargs, name)), name))
    return arch, differing_args(kwargs, arch)


def source_args(config: dict, preprocessor: Optional[dict], origin: str) -> tuple[str, dict, dict]:
    """(architecture, model_args, pretrained_cfg) for a transformers config and its preprocessor config.

    The model's input size is the preprocessor's (crop) size, else the config's image_size; the weights'
    own position grid (e.g. 37x37 for DINOv2 at 518 px) is resized to it when they are loaded.
    """
    class_name = (config.get("architectures") or [None])[0]
    layout = check_layout(config.get("model_type"), class_name, origin)
    kwargs = model_kwargs(config)
    image_size = to_int_pair(config.get("image_size", 224))
    # a saved preprocessor config overrides its processor class's defaults, key by key, as in transformers
    cfg, input_size = _preprocessing({**_default_preprocessor(layout, image_size), **(preprocessor or {})},
                                     image_size)
    kwargs["img_size"] = input_size
    arch, model_args = closest_arch("deit_distilled" if kwargs.get("distilled") else layout, kwargs)
    cfg.update(input_size=(3, *input_size), num_classes=0)
    id2label = config.get("id2label") or {}
    # DINOv2's classifier reads the class token and the mean patch token, a pooling timm's ViT does not
    # have: such a checkpoint loads as its backbone (convert_state_dict reports the classifier left out)
    if class_name and class_name.endswith(("ForImageClassification", "WithTeacher")) and id2label \
            and layout != "dinov2":
        cfg.update(num_classes=len(id2label), label_names=[id2label[str(i)] for i in range(len(id2label))])
    return arch, model_args, cfg


def layout_args(layout: str, keys) -> dict:
    """Model arguments a bare transformers file needs beyond its named architecture's."""
    keys = {_unprefixed(k) for k in keys}
    args = {}
    if layout == "deit":
        args.update(_deit_tokens(any(k.startswith(_TEACHER_HEADS) for k in keys)))
    if layout == "dinov2":
        args["init_values"] = 1.0  # LayerScale modules; the values come from the file
        if any(k.endswith(("mlp.weights_in.weight", "mlp.gate_proj.weight")) for k in keys):
            args.update(mlp_layer="swiglu_packed", act_layer="silu")
    return args


def convert_state_dict(state: dict[str, torch.Tensor], layout: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """transformers tensors -> native names, qkv fused; also the transformers keys left out, with why."""
    renames = _RENAMES
    if any(_unprefixed(k).startswith(_TEACHER_HEADS) for k in state):  # timm's distilled DeiT: two heads
        renames = [(r"^embeddings\.distillation_token$", "dist_token"), (r"^cls_classifier\.", "head."),
                   (r"^distillation_classifier\.", "head_dist."), *_RENAMES]
    out: dict[str, torch.Tensor] = {}
    dropped: dict[str, list[str]] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        name = _unprefixed(key)
        why = next((w for pattern, w in _DROPPED.items() if re.search(pattern, name)), None)
        if why is None and layout == "dinov2" and name.startswith("classifier."):
            why = "DINOv2 classifier on class + mean patch token, a pooling timm's ViT does not have"
        if why:
            dropped.setdefault(why, []).append(key)
            continue
        for pattern, repl in renames:
            name = re.sub(pattern, repl, name)
        for pattern, repl, order in _FUSED:
            match = re.match(pattern, name)
            if match:
                parts.setdefault(match.expand(repl), {})[order[match.group(2)]] = value
                break
        else:
            out[name] = value
    for name, pieces in parts.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)], dim=0)
    return out, [f"{', '.join(keys)} ({why})" for why, keys in dropped.items()]

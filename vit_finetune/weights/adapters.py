"""LoRA and DoRA adapters through Hugging Face peft: a native ViT wrapped for training, the adapter's files as peft
writes them (adapter_config.json + adapter_model.safetensors), and a saved adapter applied to its base model.

The native ViT has timm's module names, so the adapter a vitft run trains is the adapter a timm + peft user loads
(`timm.create_model(base, pretrained=True, num_classes=N)`, then `PeftModel.from_pretrained(model, folder)`).
peft injects its layers into the model in place: training keeps the native model (its `pretrained_cfg`, layer-
decay groups by block, DDP and checkpoints unchanged), only its module tree gains LoRA layers, and the head (and
DeiT's `head_dist`) train in full as peft's `modules_to_save`. peft is an optional extra, imported on use only.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from ..errors import VitftError
from ..files import atomic_write
from .refs import RefKind, parse_ref

PEFT_INSTALL = "pip install 'vit-finetune[peft]'"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")
METHODS = ("lora", "dora")
HEADS = ("head", "head_dist")  # trained in full (peft's modules_to_save), never adapted
_LORA_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.MultiheadAttention)  # what peft adapts
LOCAL_BASE = "local"  # base_model_name_or_path of an adapter trained on private local weights (never their path)
_ADAPTER = "default"  # peft's name of the one adapter a model carries
_PEFT_PREFIX = "base_model.model."  # the keys' prefix in peft's adapter_model.safetensors


def require_peft():
    """The peft module, or a one-line error naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise VitftError(f"LoRA adapters need the peft package: {PEFT_INSTALL}") from None
    return peft


def parse_targets(text: str) -> tuple[str, ...]:
    """--lora-targets' comma-separated module names."""
    return tuple(name.strip() for name in str(text).split(",") if name.strip())


def check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    """Each target names layers LoRA adapts, the way peft matches them (the module's name, or its last dotted
    parts): not a block or a norm, and not a head, which trains in full anyway."""
    if not targets:
        raise VitftError(f"--lora-targets is empty; pass module names such as {','.join(DEFAULT_TARGETS)}")
    for target in targets:
        matched = [(name, module) for name, module in model.named_modules()
                   if name and (name == target or name.endswith("." + target))]
        if not matched:
            raise VitftError(f"--lora-targets {target!r} matches no module of the model; timm's ViT names are like "
                             "blocks.0.attn.qkv, blocks.0.attn.proj, blocks.0.mlp.fc1, blocks.0.mlp.fc2")
        if all(name in HEADS for name, _ in matched):
            raise VitftError(f"--lora-targets {target!r} names the head, which trains in full anyway: drop it")
        for name, module in matched:
            if not isinstance(module, _LORA_LAYERS):
                raise VitftError(f"--lora-targets {target!r} matches {name} ({type(module).__name__}), not a layer "
                                 f"LoRA adapts (Linear or Conv): name layers such as {','.join(DEFAULT_TARGETS)}")


def apply_lora(model: nn.Module, rank: int, *, alpha: Optional[float] = None, dropout: float = 0.0,
               targets: tuple[str, ...] = DEFAULT_TARGETS, method: str = "lora",
               base: str = LOCAL_BASE) -> nn.Module:
    """`model` with peft's LoRA (or DoRA) layers injected in place and only they and the head trainable; `base`
    is the base weights' public name, what adapter_config.json's base_model_name_or_path will say."""
    peft = require_peft()
    check_targets(model, targets)
    heads = [name for name in HEADS if isinstance(getattr(model, name, None), nn.Linear)]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, lora_dropout=dropout,
                             target_modules=list(targets), modules_to_save=heads, use_dora=method == "dora")
    try:
        peft.get_peft_model(model, config)
    except ValueError as err:  # anything else peft refuses
        raise VitftError(f"--lora-targets {','.join(targets)}: {str(err).splitlines()[0]}") from None
    model.peft_config[_ADAPTER].base_model_name_or_path = base  # peft would name the model's class
    return model


def is_adapted(model: nn.Module) -> bool:
    """Whether peft's adapter layers are in `model` (apply_lora, or an unmerged load)."""
    return isinstance(getattr(model, "peft_config", None), dict)


def adapter_keys(model: nn.Module) -> list[str]:
    """The state-dict keys an adapter owns: its LoRA (and DoRA) tensors and the fully trained head."""
    return [k for k in model.state_dict() if "lora_" in k or f".modules_to_save.{_ADAPTER}." in k]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of an adapted model keeps: the adapter's tensors, not the frozen base weights."""
    state = model.state_dict()
    return {k: state[k] for k in adapter_keys(model)}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load adapter_state's tensors back; an adapter of another shape or targets is a one-line error."""
    expected = set(adapter_keys(model))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise VitftError(f"the checkpoint's adapter does not fit this model ({len(missing)} missing, e.g. "
                         f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}); resume with the "
                         "run's own --lora options")
    model.load_state_dict(state, strict=False)


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters); an adapted model's head counts once (peft keeps a frozen copy)."""
    frozen_copies = sum(p.numel() for n, p in model.named_parameters() if ".original_module." in n)
    total = sum(p.numel() for p in model.parameters()) - frozen_copies
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of an adapted model with the adapter merged into its weights: a plain native ViT (what timm loads),
    the model left as it is (merging and unmerging in place would drift the frozen weights by rounding)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            replacement = module.get_base_layer()
        elif isinstance(module, ModulesToSaveWrapper):
            replacement = module.modules_to_save[_ADAPTER]
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(merged.get_submodule(parent) if parent else merged, child, replacement)
    del merged.peft_config
    merged.requires_grad_(True)
    return merged


def adapter_config(model: nn.Module) -> dict:
    """adapter_config.json's content, as PeftConfig.save_pretrained writes it (in inference mode)."""
    config = copy.copy(model.peft_config[_ADAPTER])
    config.inference_mode = True
    values = config.to_dict()
    values.pop("runtime_config", None)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in values.items()}


def save_adapter(model: nn.Module, folder: Path) -> Path:
    """adapter_config.json + adapter_model.safetensors, the weights first (each replaced atomically)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {_PEFT_PREFIX + k: v.detach().cpu().contiguous()
             for k, v in get_peft_model_state_dict(model, adapter_name=_ADAPTER,
                                                          save_embedding_layers=False).items()}
    text = json.dumps(adapter_config(model), indent=2, sort_keys=True) + "\n"
    atomic_write(folder / ADAPTER_WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    atomic_write(folder / ADAPTER_CONFIG, lambda tmp: tmp.write_text(text))
    return folder


def base_name(pretrained: Optional[str], source: Optional[str]) -> str:
    """The public name of a run's base weights: a Hub repo id (timm's tags are timm/ARCH.TAG repos) or "local"
    for weights on this machine, whose path stays private."""
    ref = parse_ref(pretrained)
    if ref.kind is RefKind.HUB:
        return ref.target
    if not ref.is_local and source and source.startswith("timm/"):
        return source
    return LOCAL_BASE


# ---- a saved adapter ----------------------------------------------------------------------------------------
def adapter_files(name: str) -> Optional[Path]:
    """The adapter_config.json of an adapter folder or Hub repo (its weights fetched next to it); None when `name`
    holds no adapter. Asked only of a name that did not load as a model (no config.json)."""
    ref = parse_ref(name)
    if ref.kind in (RefKind.FOLDER, RefKind.LOCAL_DIR):
        return ref.path / ADAPTER_CONFIG if (ref.path / ADAPTER_CONFIG).is_file() else None
    if ref.kind is not RefKind.HUB:
        return None
    from .download import hub_download

    try:
        config_file = hub_download(ref.target, (ADAPTER_CONFIG,), ref.revision)
    except VitftError:
        return None
    hub_download(ref.target, (ADAPTER_WEIGHTS,), ref.revision)  # into the same snapshot folder
    return config_file


def read_adapter(config_file: Path) -> tuple[str, int]:
    """(the base weights as a vitft reference, the head's classes) of a saved adapter."""
    from safetensors import safe_open

    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise VitftError(f"cannot read {config_file}: {err}") from err
    base = config.get("base_model_name_or_path")
    if not base or base == LOCAL_BASE:
        raise VitftError(f"the adapter {config_file.parent} was trained on local weights (base_model_name_or_path "
                         f"{base!r}): build that model and apply the adapter with peft's PeftModel.from_pretrained")
    with safe_open(str(config_file.parent / ADAPTER_WEIGHTS), "pt") as f:
        head = f.get_slice(_PEFT_PREFIX + "head.weight").get_shape() if _PEFT_PREFIX + "head.weight" in f.keys() \
            else None
    on_disk = parse_ref(base).kind in (RefKind.FOLDER, RefKind.LOCAL_DIR, RefKind.FILE)  # another tool's adapter
    return (base if on_disk else f"hf-hub:{base}"), (head[0] if head else None)


def apply_saved_adapter(model: nn.Module, config_file: Path, merge: bool = True) -> nn.Module:
    """`model` (the adapter's base) with the saved adapter applied: merged into a plain native ViT, or with peft's
    layers in place (`merge=False`)."""
    peft = require_peft()
    wrapped = peft.PeftModel.from_pretrained(model, str(config_file.parent))
    inner = wrapped.base_model.model
    return merged_copy(inner) if merge else inner

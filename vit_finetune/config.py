"""The options of a training run (TrainConfig) and YAML recipes: plain Python, so that the command line can
read the defaults without importing torch."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .errors import VitftError


@dataclass
class TrainConfig:
    """Every option of a run; recipes (YAML) and CLI flags set these fields by name."""

    data: str = ""
    pretrained: Optional[str] = None  # anything create_model accepts as weights, or 'none' (random init);
    # None: the default weights of `model` (e.g. vit_small_patch16_224.augreg_in21k_ft_in1k), else vit_b_16
    model: Optional[str] = None  # architecture, where the weights do not imply it
    model_kwargs: dict = field(default_factory=dict)  # architecture overrides, e.g. {'patch_size': 8}
    img_size: Optional[int] = None  # default: the weights' input size
    epochs: int = 10
    batch_size: int = 64  # per process
    accum_steps: int = 1
    lr: float = 5e-4  # base LR per `lr_base_size` images; scaled linearly by the effective batch
    lr_base_size: int = 512
    min_lr: float = 1e-6
    warmup_epochs: int = 1
    weight_decay: float = 0.05
    layer_decay: Optional[float] = None  # layer-wise LR decay; None = 0.75 with pretrained weights, off from scratch
    opt: str = "adamw"
    clip_grad: Optional[float] = 1.0
    label_smoothing: float = 0.1
    mixup: float = 0.0
    cutmix: float = 0.0
    drop_path: float = 0.1
    ema: bool = False
    ema_decay: float = 0.9998
    freeze_backbone: bool = False  # linear probe: train the head (and fc_norm) only
    unfreeze_after: Optional[int] = None  # with freeze_backbone: train everything from this epoch on
    feature_views: int = 1  # frozen backbone: its pooled features computed once, for this many views of each
    # image (1: un-augmented, as evaluated; N > 1: N augmented views), and the head trains on them in
    # seconds; 0: every epoch runs the frozen backbone on freshly augmented images
    head_lr: Optional[float] = None  # base LR while the backbone is frozen; default: lr
    scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop area range
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    color_jitter: float = 0.0
    strong_aug: bool = False
    val_split: float = 0.1
    cache: bool = False
    workers: Optional[int] = None
    precision: str = "auto"  # auto = bf16 on CUDA, fp32 elsewhere
    compile: bool = False
    grad_checkpointing: bool = False
    device: str = "auto"
    seed: int = 0
    output: Optional[str] = None  # default runs/<date>-<model>
    overwrite: bool = False
    save_every: Optional[int] = None  # also checkpoint every N optimizer steps
    tensorboard: bool = False
    quiet: bool = False
    push_to_hub: Optional[str] = None
    max_steps_per_epoch: Optional[int] = None  # cap steps per epoch (smoke tests, quick looks)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Options by name, each coerced to its field's type (YAML's '1e-3' string -> 0.001); a bad or unknown
        key is a one-line error that names it."""
        types = typing.get_type_hints(cls)
        unknown = sorted(set(values) - set(types))
        if unknown:
            named = [k + _did_you_mean(k, types) for k in unknown]
            raise VitftError(f"unknown option(s) {', '.join(named)}; valid: {', '.join(sorted(types))}")
        return cls(**{k: _coerce(k, v, types[k]) for k, v in values.items()})

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _did_you_mean(key: str, names) -> str:
    close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               dict: "a mapping of KEY: VALUE"}
_BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """`value` as a `hint` (a TrainConfig field's type), or a VitftError naming the key and the type."""
    optional = typing.get_origin(hint) is Union and type(None) in typing.get_args(hint)
    if optional:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if value is None or (hint is not str and str(value).strip().lower() in ("none", "null")):
            return None
    items = typing.get_args(hint) if typing.get_origin(hint) is tuple else None
    try:
        if items is not None:
            if not isinstance(value, (list, tuple)) or len(value) != len(items):
                raise TypeError
            return tuple(_scalar(v, t) for v, t in zip(value, items))
        if hint is dict:
            if not isinstance(value, dict):
                raise TypeError
            return dict(value)
        return _scalar(value, hint)
    except (TypeError, ValueError, OverflowError):
        expected = f"a list of {len(items)} numbers" if items is not None else _TYPE_NAMES[hint]
        raise VitftError(f"option {key!r} must be {expected}{' or null' if optional else ''}, got {value!r}") from None


def _scalar(value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (str, int)) and str(value).strip().lower() in _BOOLS:
            return _BOOLS[str(value).strip().lower()]
        raise ValueError
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):  # True is an int to Python, not here
        raise TypeError
    if kind is int:
        number = float(value) if isinstance(value, str) else value
        if number != int(number):
            raise ValueError
        return int(number)
    if kind is float:
        return float(value)
    return str(value)


def load_recipe(path: str | Path) -> dict:
    """A YAML recipe: a mapping of TrainConfig fields."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise VitftError(f"cannot read recipe {path}: {err}") from err
    if not isinstance(values, dict):
        raise VitftError(f"recipe {path} must be a mapping of option: value")
    return {k.replace("-", "_"): v for k, v in values.items()}

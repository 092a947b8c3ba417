"""The options of a training run (TrainConfig) and YAML recipes: plain Python, so that the command line can
read the defaults without importing torch."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .errors import VitftError, did_you_mean

DATA, MODEL, OPTIMISATION, AUGMENTATION, RUNTIME, OUTPUT = (
    "Data", "Model", "Optimisation", "Augmentation", "Runtime", "Output")
DEVICE_HELP = "auto, cpu, cuda or mps."
THREADS_HELP = "torch's CPU threads (on a shared machine: the cores that no other program keeps busy)."
THREADS_DEFAULT = "the free cores: all, less loader workers and the cores other programs keep busy"
WORKERS_DEFAULT = "chosen with torch's threads from the work and the cores"


def option(default: Any = dataclasses.MISSING, *, help: str, panel: Optional[str] = None,
           when_none: Optional[str] = None, metavar: Optional[str] = None, hyperparameter: bool = True,
           factory: Optional[Callable[[], Any]] = None) -> Any:
    """A TrainConfig field and what is said of it, in one place: `vitft finetune --help` shows it in `panel` (None:
    a recipe key only), `when_none` says what a default of None does, and the model card lists it among the
    hyperparameters unless it is about the machine or the bookkeeping (`hyperparameter=False`)."""
    metadata = {"help": help, "panel": panel, "when_none": when_none, "metavar": metavar,
                "hyperparameter": hyperparameter}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Every option of a run; recipes (YAML) and CLI flags set these fields by name."""

    data: str = option("", panel=DATA, help="Image folder (class folders, train/ + val/, or the Intel layout), a "
                       "label file (.csv, .tsv or .jsonl with a path and a label per row), hf:NAME, a save_to_disk or "
                       "parquet dataset, or tar shards 'train-{000..099}.tar'.", metavar="DATA", hyperparameter=False)
    val_split: float = option(0.1, panel=DATA, help="Validation fraction for a single folder of classes, or a label "
                              "file without a split column.")
    data_config: Optional[str] = option(None, panel=DATA, metavar="NAME", when_none="the dataset's default",
                                        help="With --data hf:NAME: the dataset's configuration (subset).")
    data_revision: Optional[str] = option(None, panel=DATA, metavar="REV", when_none="main",
                                          help="With --data hf:NAME: the dataset's branch, tag or commit.")
    streaming: bool = option(False, panel=DATA, help="Read a Hugging Face dataset as a stream: never downloaded or "
                             "loaded whole; needs --steps-per-epoch.")
    val_data: Optional[str] = option(None, panel=DATA, metavar="SHARDS", when_none="none: required with shards",
                                     help="Validation tar shards for --data shards, e.g. 'val-{000..009}.tar'.")
    label_names: Optional[str] = option(None, panel=DATA, metavar="A,B,..", when_none="classes.json/classes.txt "
                                        "beside the shards, or the dataset's ClassLabel", hyperparameter=False,
                                        help="Class names of integer labels, comma-separated, in index order.")
    steps_per_epoch: Optional[int] = option(None, panel=DATA, metavar="N", when_none="one pass over a list of "
                                            "images; required for streams",
                                            help="Optimizer steps per epoch of streamed data (--streaming, shards).")
    image_column: Optional[str] = option(None, panel=DATA, metavar="NAME", hyperparameter=False,
                                         when_none="path, image, file or filename",
                                         help="A label file's column of image paths.")
    label_column: Optional[str] = option(None, panel=DATA, metavar="NAME", hyperparameter=False,
                                         when_none="label, labels, class or category",
                                         help="A label file's column of labels (several per row: a|b, a;b, or a "
                                         "JSON list).")
    multi_label: bool = option(False, panel=DATA, help="Multi-label classification (sigmoid outputs, one threshold "
                               "per class) even if no row has several labels.")
    cache: bool = option(False, panel=DATA, help="Decode every image once and keep it in memory.",
                         hyperparameter=False)
    workers: Optional[int] = option(None, panel=DATA, help="DataLoader worker processes.",
                                    when_none=WORKERS_DEFAULT + "; the start-up lines say which",
                                    hyperparameter=False)
    pretrained: Optional[str] = option(
        None, panel=MODEL, metavar="WEIGHTS", when_none="--model's default weights, else vit_b_16",
        help="Weights: vit_b_16, arch.tag, hf-hub:org/repo, a folder or file, or 'none' (random initialisation).")
    model: Optional[str] = option(None, panel=MODEL, metavar="ARCH",
                                  help="Architecture, where the weights do not imply it.")
    model_kwargs: dict = option(factory=dict, panel=MODEL, metavar="KEY=VALUE",
                                help="Architecture override KEY=VALUE (repeatable), e.g. patch_size=8.")
    img_size: Optional[int] = option(None, panel=MODEL, when_none="the weights'",
                                     help="Training resolution (position embedding resized).")
    drop_path: float = option(0.1, panel=MODEL, help="Stochastic depth rate.")
    lora: Optional[int] = option(None, panel=MODEL, metavar="RANK", when_none="off: every weight trains",
                                 help="Train a LoRA adapter of this rank (peft) and the head; the weights stay frozen.")
    lora_alpha: Optional[float] = option(None, panel=MODEL, when_none="2 x --lora", help="LoRA's scaling alpha.")
    lora_dropout: float = option(0.0, panel=MODEL, help="Dropout on LoRA's input.")
    lora_targets: str = option("qkv,proj,fc1,fc2", panel=MODEL, metavar="NAMES",
                               help="Modules LoRA adapts, by timm's names (peft matches name endings: proj is also "
                               "patch_embed.proj).")
    lora_method: str = option("lora", panel=MODEL, help="lora, or dora (peft's weight-decomposed LoRA).")
    epochs: int = option(10, panel=OPTIMISATION, help="Training epochs.")
    batch_size: int = option(64, panel=OPTIMISATION, help="Images per step per process.")
    accum_steps: int = option(1, panel=OPTIMISATION,
                              help="Gradient accumulation steps (effective batch = batch x steps).")
    lr_base_size: int = option(512, help="The batch size that --lr is given for.")
    lr: float = option(5e-4, panel=OPTIMISATION,
                       help="Base learning rate per 512 images (lr_base_size), scaled by the effective batch.")
    min_lr: float = option(1e-6, help="The learning rate the cosine schedule ends at.")
    weight_decay: float = option(0.05, panel=OPTIMISATION, help="AdamW weight decay.")
    layer_decay: Optional[float] = option(None, panel=OPTIMISATION, help="Layer-wise learning-rate decay (1 = off).",
                                          when_none="0.75 with pretrained weights, off from scratch")
    warmup_epochs: int = option(1, panel=OPTIMISATION, help="Linear warmup epochs.")
    opt: str = option("adamw", help="Optimizer, by timm's name (create_optimizer_v2).")
    clip_grad: Optional[float] = option(1.0, panel=OPTIMISATION, help="Gradient norm clip (0 = off).")
    label_smoothing: float = option(0.1, panel=OPTIMISATION,
                                    help="Label smoothing of the cross-entropy loss (0 = off).")
    balance: str = option("none", panel=OPTIMISATION, metavar="HOW",
                          help="Imbalanced classes: none; sampler (draw each class equally often); loss (class-"
                          "weighted cross-entropy, 1/count); sqrt (weights 1/sqrt(count)). Single-label data only.")
    loss: str = option("auto", panel=OPTIMISATION, help="auto (cross-entropy; binary cross-entropy for multi-label), "
                       "bce or asl (timm's AsymmetricLossMultiLabel): the last two are multi-label losses.")
    ema: bool = option(False, panel=OPTIMISATION,
                       help="Keep an EMA of the weights; it is saved when it validates better.")
    ema_decay: float = option(0.9998, help="Decay of the weights' EMA.")
    freeze_backbone: bool = option(False, panel=OPTIMISATION, help="Linear probe: train the head only.")
    unfreeze_after: Optional[int] = option(None, panel=OPTIMISATION, when_none="never",
                                           help="With --freeze-backbone: train everything from this epoch.")
    feature_views: int = option(1, panel=OPTIMISATION, help="With --freeze-backbone (or --train-blocks): compute "
                                "the pooled features (the frozen blocks' activations) once, for N views of each "
                                "image (1: un-augmented; 0: recompute every epoch), and train on them.")
    head_lr: Optional[float] = option(None, panel=OPTIMISATION, when_none="2.5e-2 (a fresh linear head on frozen "
                                      "features needs far more than fine-tuning's --lr)",
                                      help="Base learning rate per 512 images while the backbone is frozen, scaled "
                                      "by the effective batch as --lr is.")
    train_blocks: Optional[int] = option(
        None, panel=OPTIMISATION, metavar="N", when_none="every block",
        help="Train only the top N transformer blocks, the final norm and the head (0: the head alone, as "
        "--freeze-backbone; the model's depth: everything). The frozen lower part's activations are computed once, "
        "for --feature-views views of each image, and each step runs the top N blocks alone.")
    max_steps_per_epoch: Optional[int] = option(None, panel=OPTIMISATION, when_none="no cap", hyperparameter=False,
                                                help="Cap the optimizer steps per epoch (quick looks, smoke tests).")
    patience: Optional[int] = option(None, panel=OPTIMISATION, when_none="never stop early", metavar="EPOCHS",
                                     help="Stop when val top-1 has not improved for this many epochs (the best "
                                     "model is kept).")
    time_budget: Optional[float] = option(
        None, panel=OPTIMISATION, metavar="MINUTES", when_none="no budget: --epochs epochs",
        help="Plan the run to end within this many minutes, counted from the command's start to the saved best "
        "model: epochs, steps and the LR schedule are fitted to the throughput measured on the first steps "
        "(--epochs is the most it may take).")
    budget_head_share: Optional[float] = option(
        None, when_none="the head phase's share of --epochs", help="With --time-budget and a head phase before "
        "fine-tuning: the most of the budget the head phase may take (what it leaves goes to the phases after it).")
    seed: int = option(0, panel=OPTIMISATION, help="Random seed (data split, initialisation, augmentation).")
    mixup: float = option(0.0, panel=AUGMENTATION, help="Mixup alpha (0 = off).")
    cutmix: float = option(0.0, panel=AUGMENTATION, help="CutMix alpha (0 = off).")
    scale: tuple[float, float] = option((0.08, 1.0), help="RandomResizedCrop's range of areas.")
    ratio: tuple[float, float] = option((3 / 4, 4 / 3), help="RandomResizedCrop's range of aspect ratios.")
    hflip: float = option(0.5, help="Probability of a horizontal flip.")
    color_jitter: float = option(0.0, panel=AUGMENTATION, help="Colour jitter strength (0 = off).")
    strong_aug: bool = option(False, panel=AUGMENTATION, help="TrivialAugment-like policy + random erasing.")
    device: str = option("auto", panel=RUNTIME, help=DEVICE_HELP, hyperparameter=False)
    precision: str = option("auto", panel=RUNTIME, help="auto, bf16, fp16 or fp32 (auto: bf16 on CUDA, else fp16; "
                            "on the CPU bf16 only where it measures faster).")
    threads: Optional[int] = option(None, panel=RUNTIME, metavar="N", hyperparameter=False, help=THREADS_HELP,
                                    when_none=THREADS_DEFAULT + "; the start-up lines say which")
    compile: bool = option(False, panel=RUNTIME, help="torch.compile the model.", hyperparameter=False)
    grad_checkpointing: bool = option(False, panel=RUNTIME, hyperparameter=False,
                                      help="Trade compute for memory: recompute activations in backward.")
    output: Optional[str] = option(None, panel=OUTPUT, help="Run folder.", when_none="runs/<date>-<model>",
                                   metavar="DIR", hyperparameter=False)
    overwrite: bool = option(False, panel=OUTPUT, help="Replace an existing run folder.", hyperparameter=False)
    save_every: Optional[int] = option(None, panel=OUTPUT, help="Also checkpoint every N optimizer steps.",
                                       when_none="at every epoch end only", hyperparameter=False)
    log_with: Optional[str] = option(None, panel=OUTPUT, metavar="TRACKERS", when_none="no tracker",
                                     hyperparameter=False, help="Experiment trackers, comma-separated: "
                                     "tensorboard (the run folder's tensorboard/), mlflow (MLFLOW_TRACKING_URI, "
                                     "else the run folder's mlruns/).")
    tensorboard: bool = option(False, panel=OUTPUT, help="Same as --log-with tensorboard.", hyperparameter=False)
    push_to_hub: Optional[str] = option(None, panel=OUTPUT, metavar="REPO", hyperparameter=False,
                                        help="Push the best model to this Hub repo when training ends.")
    quiet: bool = option(False, panel=OUTPUT, help="Log lines only, no progress bars.", hyperparameter=False)

    @classmethod
    def options(cls) -> list[dataclasses.Field]:
        """The fields that are command-line options, in the order `--help` shows them."""
        return [f for f in dataclasses.fields(cls) if f.metadata.get("panel")]

    @classmethod
    def hyperparameters(cls) -> set[str]:
        """The fields that describe the training recipe (the model card lists them), not the machine or the files."""
        return {f.name for f in dataclasses.fields(cls) if f.metadata.get("hyperparameter", True)}

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Options by name, each coerced to its field's type (YAML's '1e-3' string -> 0.001); a bad or unknown
        key is a one-line error that names it."""
        types = typing.get_type_hints(cls)
        unknown = sorted(set(values) - set(types))
        if unknown:
            named = [k + did_you_mean(k, types) for k in unknown]
            raise VitftError(f"unknown option(s) {', '.join(named)}; valid: {', '.join(sorted(types))}")
        return cls(**{k: _coerce(k, v, types[k]) for k, v in values.items()})

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


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

"""Share a run: `export` writes a Hub-ready model folder, `push` uploads it to the Hugging Face Hub.

An exported folder holds timm's own format (config.json + model.safetensors: `timm.create_model(
"hf-hub:REPO", pretrained=True)` builds timm's model from it, and vitft's `create_model` its native
one), a model card (README.md with Hub metadata, the labels, the training hyperparameters, the
evaluation results and usage snippets) and, when the run has them, the training curves and the
confusion matrix the card embeds.

`push` exports to a temporary folder and uploads it with huggingface_hub's `HfApi`. The token comes
from the `token` argument, HF_TOKEN or the cached `hf auth login`, in that order; it is only ever
handed to huggingface_hub, never printed, logged or written anywhere.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from .errors import VitftError
from .onnx_export import ONNX_FILES
from .weights.refs import RefKind, parse_ref

log = logging.getLogger("vitft")

PLACEHOLDER_REPO = "<user>/<repo>"
CARD_IMAGES = ("curves.png", "confusion_matrix.png")
# every file `export` writes: what --overwrite replaces in an existing folder (nothing else is touched)
EXPORT_FILES = ("config.json", "model.safetensors", "README.md", *CARD_IMAGES, *ONNX_FILES)
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "half": "float16",
          "bf16": "bfloat16", "bfloat16": "bfloat16"}
TAGS = ["image-classification", "timm", "vitft", "vision-transformer"]
# TrainConfig fields that name weights or an architecture: public only as a Hub id or a timm name, never a path
_WEIGHT_NAMES = ("pretrained", "model")
_SPLIT_NAMES = {"train", "val", "valid", "validation", "test", "seg_train", "seg_test", "seg_pred", "images", "data"}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class PushResult:
    """Where a push landed: the repo URL and the commit (plus the pull request, with create_pr)."""

    url: str
    commit: str
    commit_url: str = ""
    pr_url: Optional[str] = None


# ---- reading a run ----------------------------------------------------------------------------------
def _check_run(run_dir: PathLike) -> Path:
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise VitftError(f"run folder {run} not found")
    if not (run / "config.json").is_file():
        raise VitftError(f"{run} has no config.json; pass a run folder written by `vitft finetune` "
                         "(or any folder written by save_pretrained)")
    return run


def _read_json(path: Path) -> Optional[dict]:
    """An optional JSON file of the run: None when absent or unreadable (with a warning)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        log.warning("ignoring %s: cannot read it (%s)", path, err)
        return None
    if not isinstance(value, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return None
    return value


def _read_report(run: Path):
    """The run's evaluation report (report.json), if it has a readable one."""
    from .evaluate import EvalReport

    if not (run / "report.json").is_file():
        return None
    try:
        return EvalReport.load(run / "report.json")
    except VitftError as err:
        log.warning("ignoring %s", err)
        return None


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _run_info(run: Path) -> dict:
    """The defensive view of the run's "vitft" config key: train, data, best (each possibly empty)."""
    config = _read_json(run / "config.json") or {}
    info = _dict(config.get("vitft"))
    return {"config": config, "train": _dict(info.get("train")), "data": _dict(info.get("data")),
            "best": _dict(info.get("best"))}


def _torch_dtype(dtype: str):
    import torch

    name = DTYPES.get(str(dtype).lower())
    if name is None:
        raise VitftError(f"unknown dtype {dtype!r}; use fp32, fp16 or bf16")
    return getattr(torch, name)


def _is_local_path(value: Any) -> bool:
    return isinstance(value, str) and parse_ref(value).is_local


def _public_weights(value: Any) -> bool:
    """Whether a `pretrained`/`model` value may be published: none/true, hf-hub:ID or a timm name or alias.

    Anything else is a local file or folder (`weights/private.pth`, `./runs/x`), whose path stays private.
    """
    ref = parse_ref(value)
    if ref.kind in (RefKind.NONE, RefKind.DEFAULT):
        return True
    if ref.kind is RefKind.HUB:
        return _REPO_ID.fullmatch(ref.target) is not None
    if ref.kind is not RefKind.NAME:
        return False
    try:
        ref.arch_tag
    except VitftError:
        return False
    return True


def _hyperparameters(train: dict) -> dict:
    """The recipe part of the training config: no machine settings, no local paths."""
    from .config import TrainConfig

    recipe_keys = TrainConfig.hyperparameters()
    out = {}
    for key, value in train.items():
        if key not in recipe_keys or value is None or _is_local_path(value) or (
                key in _WEIGHT_NAMES and not _public_weights(value)):
            continue
        if isinstance(value, (str, int, float, bool)) or (
                isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float, bool)) for v in value)):
            out[key] = list(value) if isinstance(value, tuple) else value
        elif isinstance(value, dict) and value and all(isinstance(v, (str, int, float, bool)) for v in value.values()):
            out[key] = dict(value)
    return out


def base_model(train: dict) -> Optional[str]:
    """The Hub repo id of the weights a run was fine-tuned from; None from scratch or from local weights."""
    ref, model = parse_ref(train.get("pretrained")), train.get("model")
    if ref.kind is RefKind.DEFAULT:
        ref = parse_ref(model or "")
    if ref.kind is RefKind.NONE or not _public_weights(ref.text):
        return None
    if ref.kind is RefKind.HUB:
        return ref.target or None
    from .weights.sources import resolve

    try:
        source = resolve(str(model), ref.text) if model and ref.text != model else resolve(ref.text, True)
    except Exception:  # noqa: BLE001 - an unknown name only costs the card its base_model line
        return None
    hub_id = source.pretrained_cfg.get("hf_hub_id")
    if hub_id and hub_id.endswith("/"):
        tag = source.pretrained_cfg.get("tag")
        hub_id += f"{source.arch}.{tag}" if tag else source.arch
    return hub_id or None


def _start_weights(train: dict, base: Optional[str]) -> str:
    """The weights a run started from, for the card: a Hub link, local weights (their path stays private), or ''
    from scratch."""
    if base:
        return f"[`{base}`](https://huggingface.co/{base})"
    ref = parse_ref(train.get("pretrained"))
    if ref.kind is RefKind.NONE:
        return ""
    return "local pretrained weights (their path is not published)" if ref.is_local else f"`{ref.text}`"


def _hub_dataset(*values: Any) -> Optional[str]:
    """A Hub dataset id from an explicit value or a data root written as hf-hub:ID / hf://datasets/ID."""
    for value in values:
        if not isinstance(value, str) or not value:
            continue
        for prefix in ("hf-hub:", "hf://datasets/", "datasets/"):
            if value.startswith(prefix):
                value = value[len(prefix):]
        value = value.split("@", 1)[0]
        if _REPO_ID.fullmatch(value) and not Path(value).exists():
            return value
    return None


def _dataset_name(root: Any) -> Optional[str]:
    """A readable dataset name from a local data root (its folder name, skipping split folders)."""
    if not isinstance(root, str) or not root:
        return None
    path = Path(root.rstrip("/\\"))
    while path.name.lower() in _SPLIT_NAMES and path.parent.name:
        path = path.parent
    return path.name or None


# ---- the model card -----------------------------------------------------------------------------------
def _md(value: Any) -> str:
    """A value as one markdown table cell."""
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, tuple)):
        text = ", ".join(_md(v) for v in value)
    elif isinstance(value, dict):
        text = ", ".join(f"{k}={_md(v)}" for k, v in value.items())
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def _eval_results(report, best: dict, dataset_id: Optional[str], dataset_name: Optional[str]) -> list:
    """The card's model-index: the evaluation report's metrics, else the run's best validation top-1."""
    from huggingface_hub import EvalResult

    if report is not None:
        split = report.data.get("split")
        metrics = [("accuracy", report.accuracy, "Accuracy", None),
                   ("top_5_accuracy", report.top5, "Top-5 Accuracy", None),
                   ("f1", report.macro_f1, "Macro F1", {"average": "macro"}),
                   ("f1", report.weighted_f1, "Weighted F1", {"average": "weighted"})]
    elif best.get("val_top1") is not None:
        split, metrics = "validation", [("accuracy", best["val_top1"], "Accuracy", None)]
    else:
        return []
    return [EvalResult(task_type="image-classification", task_name="Image Classification",
                       dataset_type=dataset_id or "imagefolder",
                       dataset_name=dataset_id or dataset_name or "custom image folder", dataset_split=split,
                       metric_type=kind, metric_value=round(float(value), 6), metric_name=label, metric_args=args)
            for kind, value, label, args in metrics if value is not None]


def _resized_note(config: dict, size: tuple[int, int]) -> str:
    """For an export at another input size than the run's (--img-size): say so on the card's size line."""
    trained = _dict(config.get("pretrained_cfg")).get("input_size")
    if not isinstance(trained, list) or len(trained) != 3 or tuple(trained[-2:]) == tuple(size):
        return ""
    return f" (trained at {trained[1]} x {trained[2]}; position embedding resized for this export)"


def _architecture_args(model) -> str:
    """The architecture hyperparameters that differ from the named architecture's, e.g. 'depth=6, patch_size=8'.

    Dropout rates are left out: they change training, not the network.
    """
    args = {k: v for k, v in model.model_args.items() if not k.endswith("_rate")}
    show = lambda v: "x".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)  # noqa: E731
    return ", ".join(f"{k}={show(v)}" for k, v in sorted(args.items()))


def model_card(run_dir: PathLike, repo_id: Optional[str] = None, *, model=None, dtype: str = "fp32",
               dataset: Optional[str] = None, images: tuple[str, ...] = (), onnx: bool = False) -> str:
    """The README.md text for a run: YAML metadata (the Hub's model card format), then the card itself.

    `repo_id` is the repo the card will live in (a placeholder in the usage snippets without it);
    `model` the loaded model (read from the run when None); `images` the card images next to it;
    `onnx` whether a model.onnx is next to it (an onnxruntime usage snippet).
    The model-index holds the evaluation report's results, else the run's best validation top-1 (as the
    split "validation"). Names that are not UTF-8 (file names read as surrogates) are written as \\xNN.
    """
    from huggingface_hub import ModelCard, ModelCardData

    from .files import printable

    run = _check_run(run_dir)
    info = _run_info(run)
    train, data, best = info["train"], info["data"], info["best"]
    if model is None:
        from .weights.loading import load_model

        model = load_model(str(run))
    cfg = dict(model.pretrained_cfg)
    report = _read_report(run)
    repo = repo_id or PLACEHOLDER_REPO
    name = repo_id.split("/")[-1] if repo_id else run.resolve().name
    base = base_model(train)
    dataset_id = _hub_dataset(dataset, data.get("root"), train.get("data"))
    dataset_name = dataset_id or _dataset_name(report.data.get("root") if report else None) \
        or _dataset_name(data.get("root")) or _dataset_name(train.get("data"))
    labels = list(cfg.get("label_names") or data.get("classes") or [])
    hyper = _hyperparameters(train)

    license_ = str(cfg.get("license") or "apache-2.0")
    results = _eval_results(report, best, dataset_id, dataset_name and printable(dataset_name))
    card_data = ModelCardData(
        library_name="timm", pipeline_tag="image-classification", license=license_, tags=list(TAGS),
        base_model=base, datasets=[dataset_id] if dataset_id else None,
        metrics=["accuracy"] if results else None, model_name=printable(name) if results else None,
        eval_results=results or None)

    arch = cfg.get("architecture", "vit")
    overrides = _architecture_args(model)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    size = model.patch_embed.img_size
    start = _start_weights(train, base)
    origin = f"fine-tuned from {start}" if start else "trained from scratch"
    on = f" on {f'[`{dataset_id}`](https://huggingface.co/datasets/{dataset_id})' if dataset_id else dataset_name}" \
        if dataset_name else ""
    out = [f"# {name}\n",
           f"A Vision Transformer image classifier ({len(labels) or model.num_classes} classes), {origin}{on} with "
           f"[vitft](https://pypi.org/project/vit-finetune/). The weights are in timm's format: timm and vitft "
           f"both load them by name.\n",
           "## Model details\n",
           f"- **Architecture:** `{arch}` (timm){f' with {overrides}' if overrides else ''}, "
           f"{params:.1f} M parameters",
           f"- **Fine-tuned from:** {start or 'none (random init)'}",
           f"- **Input size:** {size[0]} x {size[1]}" + _resized_note(info["config"], size),
           f"- **Preprocessing:** mean {_md(cfg.get('mean', '-'))}, std {_md(cfg.get('std', '-'))}, "
           f"{cfg.get('interpolation', 'bicubic')} resize, crop_pct {cfg.get('crop_pct', '-')}",
           f"- **Weights:** model.safetensors ({DTYPES.get(str(dtype).lower(), dtype)})"
           + (", model.onnx (float32, verified against PyTorch)" if onnx else ""),
           f"- **License:** {license_}"]
    if dataset_name:
        out.append(f"- **Dataset:** {dataset_name}")
    out.append("")
    if labels:
        out += ["## Labels\n", "| index | label |", "| ---: | --- |"]
        out += [f"| {i} | {_md(label)} |" for i, label in enumerate(labels)]
        out.append("")
    if hyper or best or data.get("counts") or "curves.png" in images:
        out.append("## Training\n")
        if data.get("layout"):
            out.append(f"Data layout: {_md(data['layout'])}.\n")
        counts = data.get("counts")
        if counts:
            splits = list(counts)
            out += ["| class | " + " | ".join(splits) + " |", "| --- |" + " ---: |" * len(splits)]
            for label in labels or sorted({c for v in counts.values() for c in v}):
                out.append(f"| {_md(label)} | " + " | ".join(str(counts[s].get(label, 0)) for s in splits) + " |")
            out.append("")
        if best:
            out.append(f"Best validation top-1: {_pct(best.get('val_top1'))} (epoch {best.get('epoch', '-')}).\n")
        if hyper:
            out += ["| hyperparameter | value |", "| --- | --- |"]
            out += [f"| {_md(k)} | {_md(v)} |" for k, v in hyper.items()]
            out.append("")
        if "curves.png" in images:
            out.append("![Training curves](curves.png)\n")
    if report or "confusion_matrix.png" in images:
        out.append("## Evaluation\n")
    if report:
        where = " ".join(x for x in (
            f"on {dataset_name}" if dataset_name else "",
            f"split `{report.data['split']}`" if report.data.get("split") else "",
            f"({report.num_images} images)") if x)
        out.append(f"Evaluated {where}.\n")
        out += ["| metric | value |", "| --- | ---: |"]
        for label, value in (("top-1 accuracy", _pct(report.accuracy)), ("top-5 accuracy", _pct(report.top5)),
                             ("macro F1", f"{report.macro_f1:.4f}"), ("weighted F1", f"{report.weighted_f1:.4f}"),
                             ("loss", f"{report.loss:.4f}")):
            out.append(f"| {label} | {value} |")
        out.append("")
        columns = ("precision", "recall", "f1", "support")
        out += ["| class | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
        for label, metrics in report.per_class.items():
            cells = ["-" if metrics[c] is None else _md(metrics[c]) for c in columns]
            out.append(f"| {_md(label)} | " + " | ".join(cells) + " |")
        out.append("")
    if "confusion_matrix.png" in images:
        out.append("![Confusion matrix](confusion_matrix.png)\n")
    k = min(5, model.num_classes)
    out += ["## Usage\n", "### timm\n", "```python", "import timm", "import torch", "from PIL import Image", "",
            f'model = timm.create_model("hf-hub:{repo}", pretrained=True).eval()',
            "data_config = timm.data.resolve_model_data_config(model)",
            "transforms = timm.data.create_transform(**data_config, is_training=False)", "",
            'image = Image.open("image.jpg").convert("RGB")',
            "with torch.no_grad():",
            "    probs = model(transforms(image).unsqueeze(0)).softmax(dim=-1)",
            f"top = probs.topk({k})",
            'labels = model.pretrained_cfg["label_names"]',
            "for p, i in zip(top.values[0], top.indices[0]):",
            '    print(f"{labels[i]}: {p:.3f}")', "```", "",
            "### vitft\n", "```bash", "pip install vit-finetune",
            f"vitft predict hf-hub:{repo} images/", "```", "", "```python", "import vit_finetune", "",
            f'model = vit_finetune.create_model("hf-hub:{repo}", pretrained=True).eval()', "```", ""]
    if onnx:
        from .onnx_export import onnx_usage

        out += onnx_usage(repo, cfg, size, k)
    body = printable("\n".join(out))
    return str(ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}"))


# ---- export -------------------------------------------------------------------------------------------
def _small_vitft_info(info: dict) -> dict:
    """What the exported config keeps of the run's "vitft" key: the recipe and the best epoch, no paths."""
    small: dict[str, Any] = {}
    hyper = _hyperparameters(info["train"])
    if hyper:
        small["train"] = hyper
    if info["best"]:
        small["best"] = {k: v for k, v in info["best"].items() if isinstance(v, (int, float, str))}
    return small


def _staging_dir(out: Path) -> Path:
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as err:
        raise VitftError(f"cannot write to {out.parent}: {err}") from err


def _install(staging: Path, out: Path) -> None:
    """Move the finished export into place: a rename for a new folder, file by file over an old export.

    Over an old export every file is renamed over its old version (none is ever missing), config.json before
    model.safetensors as save_pretrained does, then the old export's files that the new one lacks are removed.
    """
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(staging, out)
        return
    for name in EXPORT_FILES:
        if (staging / name).exists():
            os.replace(staging / name, out / name)
        else:
            (out / name).unlink(missing_ok=True)


def _check_img_size(config: dict, img_size: Optional[int]) -> None:
    """An --img-size must hold at least one patch (checked before anything is loaded)."""
    if img_size is None:
        return
    from .models.archs import get_arch, split_name
    from .models.pos_embed import to_int_pair

    patch = _dict(config.get("model_args")).get("patch_size")
    if patch is None:
        try:
            patch = get_arch(split_name(str(config.get("architecture")))[0]).kwargs.get("patch_size", 1)
        except Exception:  # noqa: BLE001 - an unknown architecture is reported by load_model itself
            patch = 1
    patch = max(to_int_pair(patch))
    if img_size < patch:
        raise VitftError(f"--img-size {img_size} is smaller than the model's patch size {patch}; pass a multiple "
                         f"of {patch}")


def export(run_dir: PathLike, out_dir: PathLike, dtype: str = "fp32", *, overwrite: bool = False,
           repo_id: Optional[str] = None, dataset: Optional[str] = None, onnx: bool = False,
           img_size: Optional[int] = None) -> Path:
    """Write the folder `push` uploads: timm-format config.json + model.safetensors, README.md, images.

    `dtype` (fp32, fp16, bf16) is the saved weights' precision; `repo_id` the repo the card's usage
    snippets name (a `<user>/<repo>` placeholder without it); `dataset` a Hub dataset id for the card's
    metadata. A non-empty `out_dir` is an error unless `overwrite`, which replaces only the files an
    export writes. Everything is written to a staging folder first: a new `out_dir` appears complete
    or not at all.

    `onnx` also writes model.onnx (float32 whatever `dtype`), checked against PyTorch with onnxruntime
    (see onnx_export); `img_size` exports everything (weights, config.json, model.onnx) at that input
    size, the position embedding resized.
    """
    if onnx:
        from .onnx_export import require_onnx

        require_onnx()  # before any work
    run = _check_run(run_dir)
    torch_dtype = _torch_dtype(dtype)
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise VitftError(f"{out} exists and is not a folder")
    if out.resolve() == run.resolve():
        raise VitftError(f"export into a new folder, not into the run folder {run} itself")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise VitftError(f"{out} already exists and is not empty; pass --overwrite to replace the exported files "
                         "in it, or pick another folder")
    replaced = [name for name in EXPORT_FILES if (out / name).exists()]
    if replaced and not all((out / name).is_file() for name in ("config.json", "model.safetensors")):
        # a folder without an earlier export (a project's root, a data folder): its README.md is the user's own
        raise VitftError(f"{out} holds {', '.join(replaced)} but no exported model (config.json + model.safetensors): "
                         "--overwrite only replaces an earlier export's files; pick another folder")
    from .files import plain_permissions
    from .weights.loading import load_model
    from .weights.saving import save_pretrained

    info = _run_info(run)
    _check_img_size(info["config"], img_size)
    model = load_model(str(run), img_size=img_size)
    staging = _staging_dir(out)
    try:
        save_pretrained(model, staging, extra_config={"vitft": _small_vitft_info(info)} if info["train"] else None,
                        dtype=torch_dtype)
        images = tuple(name for name in CARD_IMAGES if (run / name).is_file())
        for name in images:
            shutil.copyfile(run / name, staging / name)
        if onnx:
            from .onnx_export import export_onnx

            export_onnx(model, staging)
        card = model_card(run, repo_id, model=model, dtype=dtype, dataset=dataset, images=images, onnx=onnx)
        (staging / "README.md").write_text(card, encoding="utf-8")
        plain_permissions(staging)
        _install(staging, out)
    except OSError as err:
        raise VitftError(f"cannot write the export to {out}: {err}") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.debug("exported %s to %s (%s weights)", run, out, DTYPES[str(dtype).lower()])
    return out


# ---- push ---------------------------------------------------------------------------------------------
def resolve_token(token: Optional[str] = None) -> str:
    """The Hub token: `token`, else HF_TOKEN, else the cached login; a VitftError when there is none.

    The trainer calls this before training when --push-to-hub is set, so a missing token fails early.
    """
    if token and token.strip():
        return token.strip()
    env = os.environ.get("HF_TOKEN", "").strip()
    if env:
        return env
    try:
        from huggingface_hub import get_token

        cached = get_token()
    except Exception as err:  # noqa: BLE001 - e.g. a failed OIDC exchange: say so, without the details
        raise VitftError(f"cannot read the cached Hugging Face login ({type(err).__name__}); pass --token "
                         "or set HF_TOKEN") from None
    if cached and cached.strip():
        return cached.strip()
    raise VitftError("no Hugging Face token: pass --token, set HF_TOKEN, or log in once with `hf auth login` "
                     "(a token with write access, from https://huggingface.co/settings/tokens)")


def _check_repo_id(repo_id: str) -> str:
    repo_id = str(repo_id).strip().removeprefix("hf-hub:")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise VitftError(f"invalid repo id {repo_id!r}: use 'user/name' or 'org/name' "
                         f"({str(err).splitlines()[0]})") from None
    return repo_id


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exception types of whichever HTTP client huggingface_hub uses."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        mod = sys.modules.get(module)
        for name in names:
            exc = getattr(getattr(mod, "exceptions", mod), name, None) if mod else None
            if isinstance(exc, type) and issubclass(exc, BaseException):
                errors.append(exc)
    return tuple(errors)


def _http_message(err: Exception, action: str, repo_id: str) -> str:
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    namespace = repo_id.split("/")[0]
    if status == 401:
        text = (f"authentication failed (401) while {action}: the Hub rejected the token; it may be invalid or "
                "expired; create a new one at https://huggingface.co/settings/tokens")
    elif status == 403:
        text = (f"permission denied (403) while {action}: the token cannot write to {namespace!r}; use a token "
                f"with write access to {repo_id}")
    elif status == 404:
        text = (f"not found (404) while {action}: {repo_id} (or the revision) does not exist, or the token "
                "cannot see it")
    elif status == 429:
        text = f"rate limited (429) by the Hub while {action}, even after retries; wait a few minutes and push again"
    elif isinstance(status, int) and status >= 500:
        text = f"the Hub failed (HTTP {status}) while {action}, even after retries; try again later"
    else:
        text = f"HTTP {status or 'error'} while {action}"
    detail = getattr(err, "server_message", None)
    if detail:
        detail = " ".join(str(detail).split())[:200]
        text += f" (server: {detail})"
    return text


@contextlib.contextmanager
def _hub_step(action: str, repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub's errors during `action` into one clear VitftError."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HfHubHTTPError

    try:
        yield
    except HfHubHTTPError as err:
        raise VitftError(_http_message(err, action, repo_id)) from err
    except _transport_errors() as err:
        if type(err).__name__ == "OfflineModeIsEnabled":
            raise VitftError(f"cannot push while HF_HUB_OFFLINE is set ({action}); unset it") from err
        raise VitftError(f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} while {action} "
                         f"({type(err).__name__}); check the network connection, proxy settings or HF_ENDPOINT") \
            from err
    except ValueError as err:  # huggingface_hub's own checks, e.g. invalid card metadata
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VitftError(f"{action} failed: {first}") from err


def _plain_branch(revision: Optional[str]) -> bool:
    """A branch name push may create (not main, a PR ref or a commit hash)."""
    return bool(revision) and revision != "main" and not revision.startswith("refs/") \
        and not re.fullmatch(r"[0-9a-f]{40}", revision)


def push(run_dir: PathLike, repo_id: str, token: Optional[str] = None, private: bool = False,
         revision: Optional[str] = None, create_pr: bool = False, commit_message: Optional[str] = None,
         overwrite_card: bool = False, *, dtype: str = "fp32", dataset: Optional[str] = None) -> PushResult:
    """Export `run_dir` and upload it to the Hub model repo `repo_id` (created when missing).

    The repo's existing README.md is kept unless `overwrite_card`. `revision` commits to that branch
    (created from main when missing); `create_pr` opens a pull request against main instead. The
    export lives in a temporary folder that is always removed.
    """
    run = _check_run(run_dir)
    from .weights.sources import weights_in

    weights_in(run)  # the cheap local checks first: nothing is created on the Hub for a broken run
    repo_id = _check_repo_id(repo_id)
    _torch_dtype(dtype)
    if create_pr and revision not in (None, "main"):
        raise VitftError("--create-pr opens a pull request against main; drop --revision (or drop --create-pr "
                         "to commit to that branch)")
    token = resolve_token(token)  # before any work: no token, no export and no request

    from huggingface_hub import HfApi

    from . import __version__

    api = HfApi(token=token, library_name="vitft", library_version=__version__)
    message = commit_message or f"Upload {run.resolve().name} with vitft"
    # the Hub first (auth, permission and network problems show before the export's work) ...
    with _hub_step(f"creating the repo {repo_id}", repo_id):
        repo_url = api.create_repo(repo_id, private=True if private else None, exist_ok=True)
    repo_id = getattr(repo_url, "repo_id", None) or repo_id  # a bare name lands in the token's namespace
    if _plain_branch(revision) and not create_pr:
        with _hub_step(f"creating the branch {revision} of {repo_id}", repo_id):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    keep_card = False
    if not overwrite_card:
        with _hub_step(f"checking {repo_id} for a README.md", repo_id):
            keep_card = api.file_exists(repo_id, "README.md", revision=None if create_pr else revision)
        if keep_card:
            log.info("keeping the model card (README.md) already in %s; --overwrite-card replaces it", repo_id)
    # ... then the export, in a temporary folder that is removed whatever happens
    with tempfile.TemporaryDirectory(prefix="vitft-push-") as tmp:
        folder = export(run, Path(tmp) / "export", dtype=dtype, repo_id=repo_id, dataset=dataset)
        # card images the new card no longer shows are removed from the repo (not when the old card stays)
        stale = [] if keep_card else [n for n in CARD_IMAGES if not (folder / n).is_file()]
        with _hub_step(f"uploading to {repo_id}", repo_id):
            info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=message,
                                     revision=revision, create_pr=create_pr,
                                     ignore_patterns=["README.md"] if keep_card else None,
                                     delete_patterns=stale or None)
    return PushResult(url=str(repo_url), commit=str(info.oid), commit_url=str(info.commit_url or ""),
                      pr_url=str(info.pr_url) if getattr(info, "pr_url", None) else None)


def push_run(run_dir: PathLike, repo_id: str, **options: Any) -> PushResult:
    """`vitft finetune --push-to-hub REPO_ID`: push the finished run and log where it went."""
    result = push(run_dir, repo_id, **options)
    log.info("pushed %s to %s (commit %s)", run_dir, result.pr_url or result.url, result.commit[:12])
    return result

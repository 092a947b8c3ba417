"""The model card of an export: README.md with the Hub's metadata, the labels, the training hyperparameters, the
evaluation results and usage snippets, and what of a run may be published on it (no local paths, ever)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from .. import __url__
from ..errors import VitftError
from ..run_folder import CURVES, as_dict
from ..weights.refs import RefKind, parse_ref
from .onnx import onnx_usage
from .run import PathLike, check_run, read_report

PLACEHOLDER_REPO = "<user>/<repo>"
TAGS = ["image-classification", "timm", "vitft", "vision-transformer"]
# TrainConfig fields that name weights or an architecture: public only as a Hub id or a timm name, never a path
_WEIGHT_NAMES = ("pretrained", "model")
_PATH_NAMES = (*_WEIGHT_NAMES, "val_data")  # the recipe options whose values are files or folders
_SPLIT_NAMES = {"train", "val", "valid", "validation", "test", "seg_train", "seg_test", "seg_pred", "images", "data"}
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


# ---- what of a run is published ----------------------------------------------------------------------
def is_local_path(value: Any) -> bool:
    return isinstance(value, str) and parse_ref(value).is_local


def is_private_path(key: str, value: Any) -> bool:
    """Whether recipe option `key`'s value is a local path: any local file or folder for the options that take one;
    for the others only a value written as a path (a choice such as `sampler` or `adamw` stays public when the
    current folder happens to hold a file or folder of that name)."""
    return is_local_path(value) and (key in _PATH_NAMES or "/" in value or "\\" in value or value.startswith("~"))


def public_weights(value: Any) -> bool:
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


def hyperparameters(train: dict) -> dict:
    """The recipe part of the training config: no machine settings, no local paths."""
    from ..config import TrainConfig

    recipe_keys = TrainConfig.hyperparameters()
    out = {}
    for key, value in train.items():
        if key not in recipe_keys or value is None or is_private_path(key, value) or (
                key in _WEIGHT_NAMES and not public_weights(value)):
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
    if ref.kind is RefKind.NONE or not public_weights(ref.text):
        return None
    if ref.kind is RefKind.HUB:
        return ref.target or None
    from ..weights.sources import resolve

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
    elif best.get("val_mAP") is not None:  # multi-label
        split, metrics = "validation", [("mAP", best["val_mAP"], "mAP", {"average": "macro"})]
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
    trained = as_dict(config.get("pretrained_cfg")).get("input_size")
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


def model_card(run_dir: PathLike, repo_id: Optional[str] = None, *, model=None, dtype: str = "float32",
               dataset: Optional[str] = None, images: tuple[str, ...] = (), onnx: bool = False) -> str:
    """The README.md text for a run: YAML metadata (the Hub's model card format), then the card itself.

    `repo_id` is the repo the card will live in (a placeholder in the usage snippets without it);
    `model` the loaded model (read from the run when None); `dtype` the saved weights' torch dtype name;
    `images` the card images next to it;
    `onnx` whether a model.onnx is next to it (an onnxruntime usage snippet).
    The model-index holds the evaluation report's results, else the run's best validation top-1 (as the
    split "validation"). Names that are not UTF-8 (file names read as surrogates) are written as \\xNN.
    """
    from huggingface_hub import ModelCard, ModelCardData

    from ..files import printable

    run = check_run(run_dir)
    info = run.vitft_info()
    train, data, best = info["train"], info["data"], info["best"]
    if model is None:
        from ..weights.loading import load_model

        model = load_model(str(run))
    cfg = dict(model.pretrained_cfg)
    report = read_report(run)
    repo = repo_id or PLACEHOLDER_REPO
    name = repo_id.split("/")[-1] if repo_id else run.path.resolve().name
    base = base_model(train)
    dataset_id = _hub_dataset(dataset, data.get("root"), train.get("data"))
    dataset_name = dataset_id or _dataset_name(report.data.get("root") if report else None) \
        or _dataset_name(data.get("root")) or _dataset_name(train.get("data"))
    labels = list(cfg.get("label_names") or data.get("classes") or [])
    hyper = hyperparameters(train)

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
    multi_label = bool(cfg.get("multi_label"))
    kind = "multi-label " if multi_label else ""
    task = (" It is multi-label: a sigmoid per class, and a label applies when its probability reaches the class's "
            "threshold (config.json's `thresholds`, chosen on the validation images for the best F1).") \
        if multi_label else ""
    out = [f"# {name}\n",
           f"A {kind}Vision Transformer image classifier ({len(labels) or model.num_classes} classes), {origin}{on} "
           f"with"
           f" [vitft]({__url__}). The weights are in timm's format: timm and vitft "
           f"both load them by name.{task}\n",
           "## Model details\n",
           f"- **Architecture:** `{arch}` (timm){f' with {overrides}' if overrides else ''}, "
           f"{params:.1f} M parameters",
           f"- **Fine-tuned from:** {start or 'none (random init)'}",
           f"- **Input size:** {size[0]} x {size[1]}" + _resized_note(info["config"], size),
           f"- **Preprocessing:** mean {_md(cfg.get('mean', '-'))}, std {_md(cfg.get('std', '-'))}, "
           f"{cfg.get('interpolation', 'bicubic')} resize, crop_pct {cfg.get('crop_pct', '-')}",
           f"- **Weights:** model.safetensors ({dtype})"
           + (", model.onnx (float32, verified against PyTorch)" if onnx else ""),
           f"- **License:** {license_}"]
    if dataset_name:
        out.append(f"- **Dataset:** {dataset_name}")
    out.append("")
    if labels:
        out += ["## Labels\n", "| index | label |", "| ---: | --- |"]
        out += [f"| {i} | {_md(label)} |" for i, label in enumerate(labels)]
        out.append("")
    if hyper or best or data.get("counts") or CURVES in images:
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
            metric, key = ("mAP", "val_mAP") if "val_mAP" in best else ("top-1", "val_top1")
            out.append(f"Best validation {metric}: {_pct(best.get(key))} (epoch {best.get('epoch', '-')}).\n")
        if hyper:
            out += ["| hyperparameter | value |", "| --- | --- |"]
            out += [f"| {_md(k)} | {_md(v)} |" for k, v in hyper.items()]
            out.append("")
        if CURVES in images:
            out.append(f"![Training curves]({CURVES})\n")
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
    out += ["## Usage\n", "### timm\n", "```python", *(["import json", ""] if multi_label else []), "import timm",
            "import torch", *(["from huggingface_hub import hf_hub_download"] if multi_label else []),
            "from PIL import Image", "",
            f'model = timm.create_model("hf-hub:{repo}", pretrained=True).eval()',
            "data_config = timm.data.resolve_model_data_config(model)",
            "transforms = timm.data.create_transform(**data_config, is_training=False)", "",
            'image = Image.open("image.jpg").convert("RGB")',
            "with torch.no_grad():",
            *(_multi_label_timm(repo) if multi_label else [
                "    probs = model(transforms(image).unsqueeze(0)).softmax(dim=-1)",
                f"top = probs.topk({k})",
                'labels = model.pretrained_cfg["label_names"]',
                "for p, i in zip(top.values[0], top.indices[0]):",
                '    print(f"{labels[i]}: {p:.3f}")']), "```", "",
            "### vitft\n", "```bash", f"pip install git+{__url__}",
            f"vitft predict hf-hub:{repo} images/", "```", "", "```python", "import vit_finetune", "",
            f'model = vit_finetune.create_model("hf-hub:{repo}", pretrained=True).eval()', "```", ""]
    if onnx:
        out += onnx_usage(repo, cfg, size, k)
    body = printable("\n".join(out))
    return str(ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}"))


def adapter_card(run_dir: PathLike, adapter_config: dict, repo_id: Optional[str] = None) -> str:
    """The README.md of an exported LoRA adapter: peft's metadata (library_name peft, base_model the base weights)
    and a snippet that loads it with timm + peft, the base built as the run built it."""
    from huggingface_hub import ModelCard, ModelCardData

    from ..files import printable

    run = check_run(run_dir)
    info = run.vitft_info()
    config = info["config"]
    repo = repo_id or PLACEHOLDER_REPO
    base = adapter_config.get("base_model_name_or_path")
    public_base = base if base and base != "local" else None
    labels = list(config.get("label_names") or info["data"].get("classes") or [])
    num_classes = config.get("num_classes", len(labels))
    args = "".join(f", {k}={v!r}" for k, v in as_dict(config.get("model_args")).items())
    card_data = ModelCardData(library_name="peft", pipeline_tag="image-classification", base_model=public_base,
                              tags=[*TAGS, "lora", "peft"])
    method = "DoRA" if adapter_config.get("use_dora") else "LoRA"
    base_ref = f'"hf-hub:{public_base}"' if public_base else '"<the base weights it was trained on>"'
    out = [f"# {repo_id.split('/')[-1] if repo_id else run.path.resolve().name}\n",
           f"A {method} adapter (rank {adapter_config.get('r')}, alpha {adapter_config.get('lora_alpha')}, on "
           f"{', '.join(adapter_config.get('target_modules') or [])}; the head trained in full) for "
           f"{f'[`{public_base}`](https://huggingface.co/{public_base})' if public_base else 'local base weights'}, "
           f"a {num_classes}-class image classifier trained with [vitft]({__url__}).\n"]
    if labels:
        out += ["## Labels\n", ", ".join(f"{i}: {_md(label)}" for i, label in enumerate(labels)), ""]
    best = info["best"]
    if best:
        out.append(f"Best validation top-1: {_pct(best.get('val_top1'))} (epoch {best.get('epoch', '-')}).\n")
    out += ["## Usage\n", "### timm + peft\n", "```python", "import timm", "from peft import PeftModel", "",
            f"model = timm.create_model({base_ref}, pretrained=True, num_classes={num_classes}{args})",
            f'model = PeftModel.from_pretrained(model, "{repo}").eval()',
            "model = model.merge_and_unload()  # optional: one plain timm model", "```", ""]
    if public_base:  # vitft fetches the base weights by the name adapter_config.json gives
        out += ["### vitft\n", "```python", "import vit_finetune", "",
                f'model = vit_finetune.create_model("hf-hub:{repo}", pretrained=True).eval()  # merged', "```", ""]
    body = printable("\n".join(out))
    return str(ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n{body}"))


def _multi_label_timm(repo: str) -> list[str]:
    """The timm snippet's last lines for a multi-label model: a sigmoid per class, and its thresholds."""
    return ["    probs = model(transforms(image).unsqueeze(0)).sigmoid()[0]",
            "with open(hf_hub_download(\"" + repo + "\", \"config.json\")) as f:",
            '    thresholds = json.load(f)["thresholds"]',
            'labels = model.pretrained_cfg["label_names"]',
            "for i in probs.argsort(descending=True).tolist():",
            "    if probs[i] >= thresholds[i]:",
            '        print(f"{labels[i]}: {probs[i]:.3f}")']

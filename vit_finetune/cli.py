"""The `vitft` command line: thin Typer commands over the library functions."""
from __future__ import annotations

import fnmatch
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from .errors import VitftError

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune Vision Transformers on your own images.")
console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """Fine-tune Vision Transformers on your own images: finetune, evaluate, predict, export, push."""


def command(*args, **kwargs) -> Callable:
    """`app.command` that turns a VitftError into one red line and exit code 2, never a traceback."""

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            _setup_logging()
            try:
                return fn(*a, **kw)
            except VitftError as err:
                console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
                raise typer.Exit(2) from None

        return app.command(*args, **kwargs)(wrapper)

    return register


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (test runners swap it between commands)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging() -> None:
    logger = logging.getLogger("vitft")
    if not logger.handlers:
        handler = RichHandler(console=console, show_time=False, show_path=False) if sys.stderr.isatty() \
            else _StderrHandler()
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)


@command("models")
def models_cmd(pattern: str = typer.Argument("*", help="Glob over architecture names and aliases, e.g. '*base*'.")):
    """List the supported architectures and aliases."""
    from .archs import ALIASES, get_arch, list_archs

    table = Table(title="vitft models")
    for col in ("name", "params (M)", "img size", "patch", "default weights"):
        table.add_column(col, justify="right" if col in ("params (M)", "img size", "patch") else "left")
    for alias, target in ALIASES.items():
        if fnmatch.fnmatch(alias, pattern) or fnmatch.fnmatch(target, pattern):
            arch = get_arch(target.split(".")[0])
            table.add_row(f"{alias} -> {arch.name}", f"{arch.params_m:.1f}", _size(arch.img_size),
                          _size(arch.patch_size), target.split(".", 1)[1])
    for name in list_archs(pattern):
        arch = get_arch(name)
        table.add_row(name, f"{arch.params_m:.1f}", _size(arch.img_size), _size(arch.patch_size),
                      arch.default_tag or "-")
    Console().print(table)


def _size(hw) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


# Commands for finetune/demo, evaluate/predict and export/push are registered below.
# <finetune-commands>
def _parse_kwargs(pairs: list[str]) -> dict:
    """KEY=VALUE strings -> dict, values parsed as YAML scalars (8 -> int, 0.1 -> float, true -> bool)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise VitftError(f"--model-kwargs takes KEY=VALUE pairs, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


@command("finetune")
def finetune_cmd(
    data: Optional[str] = typer.Option(None, "--data", help="Image folder: class folders, train/ + val/, or the Intel layout."),
    pretrained: Optional[str] = typer.Option(None, help="Weights: vit_b_16, arch.tag, hf-hub:org/repo, a folder or file, or 'none'. (default: --model's default weights, else vit_b_16)"),
    model: Optional[str] = typer.Option(None, "--model", help="Architecture, where the weights do not imply it."),
    model_kwargs: Optional[list[str]] = typer.Option(None, "--model-kwargs", help="Architecture overrides KEY=VALUE (repeatable), e.g. patch_size=8."),
    recipe: Optional[Path] = typer.Option(None, help="YAML recipe; flags override it."),
    resume: Optional[Path] = typer.Option(None, help="Continue the run in this folder (needs no other option)."),
    epochs: Optional[int] = typer.Option(None, help="Epochs. (default: 10)"),
    batch_size: Optional[int] = typer.Option(None, help="Images per step per process. (default: 64)"),
    lr: Optional[float] = typer.Option(None, help="Base LR per 512 images (scaled by the effective batch). (default: 5e-4)"),
    img_size: Optional[int] = typer.Option(None, help="Training resolution (position embedding resized). (default: the weights')"),
    workers: Optional[int] = typer.Option(None, help="DataLoader worker processes. (default: chosen with torch's threads from the work and the cores; the start-up lines say which)"),
    seed: Optional[int] = typer.Option(None, help="Random seed. (default: 0)"),
    output: Optional[str] = typer.Option(None, help="Run folder. (default: runs/<date>-<model>)"),
    overwrite: Optional[bool] = typer.Option(None, "--overwrite", help="Replace an existing run folder."),
    val_split: Optional[float] = typer.Option(None, help="Validation fraction for a single folder of classes. (default: 0.1)"),
    layer_decay: Optional[float] = typer.Option(None, help="Layer-wise LR decay (1 = off). (default: 0.75 with pretrained weights, off from scratch)"),
    weight_decay: Optional[float] = typer.Option(None, help="AdamW weight decay. (default: 0.05)"),
    warmup_epochs: Optional[int] = typer.Option(None, help="Linear warmup epochs. (default: 1)"),
    accum_steps: Optional[int] = typer.Option(None, help="Gradient accumulation steps. (default: 1)"),
    clip_grad: Optional[float] = typer.Option(None, help="Gradient norm clip (0 = off). (default: 1.0)"),
    label_smoothing: Optional[float] = typer.Option(None, help="(default: 0.1)"),
    mixup: Optional[float] = typer.Option(None, help="Mixup alpha (0 = off)."),
    cutmix: Optional[float] = typer.Option(None, help="CutMix alpha (0 = off)."),
    drop_path: Optional[float] = typer.Option(None, help="Stochastic depth rate. (default: 0.1)"),
    ema: Optional[bool] = typer.Option(None, "--ema/--no-ema", help="Keep an EMA of the weights; saved when better."),
    freeze_backbone: Optional[bool] = typer.Option(None, "--freeze-backbone", help="Linear probe: train the head only."),
    unfreeze_after: Optional[int] = typer.Option(None, help="With --freeze-backbone: train everything from this epoch."),
    feature_views: Optional[int] = typer.Option(None, help="With --freeze-backbone: compute the pooled features once, for N views of each image (1: un-augmented; 0: recompute every epoch), and train the head on them. (default: 1)"),
    head_lr: Optional[float] = typer.Option(None, help="Base LR per 512 images while the backbone is frozen. (default: --lr)"),
    color_jitter: Optional[float] = typer.Option(None, help="Colour jitter strength (0 = off)."),
    strong_aug: Optional[bool] = typer.Option(None, "--strong-aug", help="TrivialAugment-like policy + random erasing."),
    cache: Optional[bool] = typer.Option(None, "--cache", help="Decode every image once and keep it in memory."),
    precision: Optional[str] = typer.Option(None, help="bf16, fp16, fp32 or auto (bf16 on CUDA). (default: auto)"),
    compile: Optional[bool] = typer.Option(None, "--compile", help="torch.compile the model."),
    grad_checkpointing: Optional[bool] = typer.Option(None, "--grad-checkpointing", help="Trade compute for memory."),
    device: Optional[str] = typer.Option(None, help="auto, cpu, cuda or mps. (default: auto)"),
    save_every: Optional[int] = typer.Option(None, help="Also checkpoint every N optimizer steps."),
    max_steps_per_epoch: Optional[int] = typer.Option(None, help="Cap the optimizer steps per epoch (quick looks, smoke tests)."),
    tensorboard: Optional[bool] = typer.Option(None, "--tensorboard", help="Write TensorBoard logs."),
    push_to_hub: Optional[str] = typer.Option(None, help="Push the best model to this Hub repo when training ends."),
    quiet: Optional[bool] = typer.Option(None, "--quiet", help="Log lines only, no progress bars."),
):
    """Fine-tune a ViT on an image folder: `vitft finetune --pretrained vit_b_16 --data ./intel`."""
    from .train import finetune, load_recipe

    flags = {k: v for k, v in locals().items() if v is not None and k not in ("recipe", "resume", "finetune", "load_recipe")}
    if "model_kwargs" in flags:
        flags["model_kwargs"] = _parse_kwargs(flags["model_kwargs"])
    if resume is not None:
        if recipe:
            raise VitftError("--recipe is for new runs; with --resume, pass changed options as flags")
        result = finetune(resume=resume, **flags)
    else:
        config = load_recipe(recipe) if recipe else {}
        if recipe and "model_kwargs" in flags:
            flags["model_kwargs"] = {**config.get("model_kwargs", {}), **flags["model_kwargs"]}
        result = finetune({**config, **flags})
    _summary(result)


@command("demo")
def demo_cmd(
    output: Path = typer.Option(Path("vitft-demo"), help="Folder for the generated data, the run and the export."),
    epochs: int = typer.Option(10, help="Training epochs."),
):
    """Offline end-to-end demo: generate images, fine-tune a tiny ViT on the CPU, evaluate, export."""
    from .demo import demo

    paths = demo(output, epochs=epochs)
    table = Table(title="vitft demo outputs")
    table.add_column("what")
    table.add_column("where")
    for what, where in paths.items():
        table.add_row(what, str(where))
    console.print(table)


def _summary(result) -> None:
    if result.interrupted:
        console.print(f"[yellow]interrupted[/] after {result.epochs_done} epochs; continue with "
                      f"`vitft finetune --resume {result.run_dir}`")
    table = Table(title="run summary")
    table.add_column("")
    table.add_column("")
    table.add_row("run folder", str(result.run_dir))
    table.add_row("epochs done", str(result.epochs_done))
    if result.best_epoch > 0:
        table.add_row("best val top-1", f"{100 * result.best_top1:.1f}% (epoch {result.best_epoch})")
    last = result.metrics[-1] if result.metrics else None
    if last:
        table.add_row("last val top-1", f"{100 * last['val_top1']:.1f}%")
        table.add_row("last train loss", f"{last['train_loss']:.4f}")
    console.print(table)

# <evaluate-commands>
@command("evaluate")
def evaluate_cmd(
    model: str = typer.Argument(..., help="Run or model folder, weights file (with --model), hf-hub:org/repo, or a timm name (with --pretrained)."),
    data: str = typer.Option(..., "--data", help="Labelled images in any layout finetune accepts."),
    split: Optional[str] = typer.Option(None, help="train, val or test. (default: test if present, else val; a single folder is evaluated whole)"),
    arch: Optional[str] = typer.Option(None, "--model", help="Architecture of a bare weights file."),
    pretrained: bool = typer.Option(False, "--pretrained", help="MODEL is a timm name: evaluate its pretrained weights."),
    img_size: Optional[int] = typer.Option(None, help="Evaluate at this resolution (position embedding resized)."),
    tta: bool = typer.Option(False, "--tta", help="Average the predictions of each image and its mirror image."),
    batch_size: int = typer.Option(64, help="Images per batch."),
    workers: Optional[int] = typer.Option(None, help="DataLoader worker processes. (default: cores - 1, at most 8)"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    precision: str = typer.Option("fp32", help="fp32, bf16 or fp16."),
    output: Optional[str] = typer.Option(None, help="Folder for report.json and friends. (default: the run folder, else ./eval-<model>)"),
    explain: bool = typer.Option(False, "--explain", help="Overlay attention-rollout heat maps on mistakes.png (see `vitft explain`)."),
    val_split: Optional[float] = typer.Option(None, help="Split data without a validation folder, as finetune does, and evaluate its val part. (default: a run's own split on the data it trained on, else a single folder is evaluated whole)"),
    seed: Optional[int] = typer.Option(None, help="Seed of that split. (default: the run's, else 0)"),
):
    """Evaluate a model on labelled images: metrics, per-class table, confusion matrix, mistakes."""
    from .evaluate import evaluate_command

    evaluate_command(model, data, split=split, arch=arch, pretrained=pretrained, img_size=img_size, tta=tta,
                     batch_size=batch_size, workers=workers, device=device, precision=precision, output=output,
                     explain="rollout" if explain else None, val_split=val_split, seed=seed)


@command("predict")
def predict_cmd(
    model: str = typer.Argument(..., help="Run or model folder, weights file (with --model), hf-hub:org/repo, or a timm name (with --pretrained)."),
    inputs: list[str] = typer.Argument(..., help="Image files, folders (searched recursively) or globs."),
    arch: Optional[str] = typer.Option(None, "--model", help="Architecture of a bare weights file."),
    pretrained: bool = typer.Option(False, "--pretrained", help="MODEL is a timm name: use its pretrained weights."),
    top_k: int = typer.Option(3, help="Labels per image."),
    fmt: Optional[str] = typer.Option(None, "--format", help="csv or jsonl. (default: from --output's suffix, else csv)"),
    output: Optional[str] = typer.Option(None, help="Output file. (default: stdout)"),
    batch_size: int = typer.Option(64, help="Images per batch."),
    workers: Optional[int] = typer.Option(None, help="DataLoader worker processes. (default: cores - 1, at most 8)"),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    precision: str = typer.Option("fp32", help="fp32, bf16 or fp16."),
    img_size: Optional[int] = typer.Option(None, help="Predict at this resolution (position embedding resized)."),
    tta: bool = typer.Option(False, "--tta", help="Average the predictions of each image and its mirror image."),
):
    """Predict the top-k labels of images; unreadable files become rows with an error."""
    from .evaluate import predict_command

    predict_command(model, inputs, arch=arch, pretrained=pretrained, top_k=top_k, fmt=fmt, output=output,
                    batch_size=batch_size, workers=workers, device=device, precision=precision,
                    img_size=img_size, tta=tta)


@command("explain")
def explain_cmd(
    model: str = typer.Argument(..., help="Run or model folder, weights file (with --model), hf-hub:org/repo, or a timm name (with --pretrained)."),
    images: list[str] = typer.Argument(..., help="Image files, folders (searched recursively) or globs."),
    output: str = typer.Option(..., "--output", help="Folder for one PNG per image and index.html."),
    method: str = typer.Option("rollout", help="rollout (attention rollout), attention (last block) or gradcam (gradient-weighted, per class)."),
    target: Optional[str] = typer.Option(None, help="With --method gradcam: the label to explain. (default: the prediction)"),
    arch: Optional[str] = typer.Option(None, "--model", help="Architecture of a bare weights file."),
    pretrained: bool = typer.Option(False, "--pretrained", help="MODEL is a timm name: use its pretrained weights."),
    top_k: int = typer.Option(3, help="Labels shown per image."),
    img_size: Optional[int] = typer.Option(None, help="Run at this resolution (position embedding resized)."),
    batch_size: int = typer.Option(16, help="Images per batch."),
    device: str = typer.Option("auto", help="auto, cpu, cuda or mps."),
    precision: str = typer.Option("fp32", help="fp32, bf16 or fp16."),
):
    """Show where the model looked: a heat map over each image, with its top labels."""
    from .explain import explain_command

    explain_command(model, images, output, method=method, target=target, arch=arch, pretrained=pretrained,
                    top_k=top_k, img_size=img_size, batch_size=batch_size, device=device, precision=precision)
# <hub-commands>
@command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="Run folder written by `vitft finetune` (or any saved model folder)."),
    out_dir: Path = typer.Argument(..., help="Folder to write: config.json, model.safetensors, README.md, images."),
    dtype: str = typer.Option("fp32", "--dtype", help="Saved weights' precision: fp32, fp16 or bf16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the exported files in a non-empty OUT_DIR."),
    repo_id: Optional[str] = typer.Option(None, "--repo-id", help="Repo the card's usage snippets name (default: a <user>/<repo> placeholder)."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Hub dataset id trained on, for the card's metadata."),
    onnx: bool = typer.Option(False, "--onnx", help="Also write model.onnx (float32), checked against PyTorch with onnxruntime. Needs: pip install 'vit-finetune[onnx]'."),
    img_size: Optional[int] = typer.Option(None, "--img-size", help="Export everything at this input size (position embedding resized). (default: the run's)"),
):
    """Export a run as a Hub-ready model folder: timm format plus a model card (and model.onnx with --onnx)."""
    from .hub import export

    out = export(run_dir, out_dir, dtype=dtype, overwrite=overwrite, repo_id=repo_id, dataset=dataset, onnx=onnx,
                 img_size=img_size)
    typer.echo(f"exported {run_dir} to {out}")


@command("push")
def push_cmd(
    run_dir: Path = typer.Argument(..., help="Run folder written by `vitft finetune`."),
    repo_id: str = typer.Argument(..., help="Hub model repo, user/name or org/name (created when missing)."),
    token: Optional[str] = typer.Option(None, "--token", help="Hub token with write access (default: HF_TOKEN, else the cached `hf auth login`).", show_default=False),
    private: bool = typer.Option(False, "--private", help="Create the repo private (an existing repo keeps its visibility)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch to commit to, created from main when missing (default: main)."),
    create_pr: bool = typer.Option(False, "--create-pr", help="Open a pull request against main instead of committing to it."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", help="Commit title."),
    overwrite_card: bool = typer.Option(False, "--overwrite-card", help="Replace a README.md already in the repo."),
    dtype: str = typer.Option("fp32", "--dtype", help="Uploaded weights' precision: fp32, fp16 or bf16."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Hub dataset id trained on, for the card's metadata."),
):
    """Export a run and upload it to a Hugging Face Hub model repo."""
    from .hub import push

    result = push(run_dir, repo_id, token=token, private=private, revision=revision, create_pr=create_pr,
                  commit_message=commit_message, overwrite_card=overwrite_card, dtype=dtype, dataset=dataset)
    typer.echo(f"pushed to {result.url}")
    if result.pr_url:
        typer.echo(f"pull request: {result.pr_url}")
    typer.echo(f"commit: {result.commit}" + (f" ({result.commit_url})" if result.commit_url else ""))


def main() -> None:
    app()

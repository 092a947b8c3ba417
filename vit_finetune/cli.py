"""The `vitft` command line: thin Typer commands over the library functions.

Starting it imports neither torch nor timm nor albumentations: each command imports what it runs, so `vitft --help`
answers at once.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import os
import sys
import time
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .config import DEVICE_HELP, THREADS_DEFAULT, THREADS_HELP, WORKERS_DEFAULT, TrainConfig
from .errors import VitftError
from .hub.onnx import INSTALL as ONNX_INSTALL
from .terminal import Command, Group, console, print_report, setup_logging

# where a model comes from, as evaluate, predict and explain take it
MODEL_HELP = "Run or model folder, weights file (with --model), hf-hub:org/repo, or a timm name (with --pretrained)."
PRECISION_HELP = "auto, fp32, bf16 or fp16 (auto: bf16 on CUDA, or on a CPU where it measures faster)."
THRESHOLD_HELP = "Multi-label models: the probability a label needs, for every class."
THRESHOLD_DEFAULT = "each class's, chosen on the validation images"
INTERRUPTED_EXIT = 130  # what a shell reports for a program stopped by Ctrl-C (128 + SIGINT)

app = typer.Typer(cls=Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune Vision Transformers on your own images.")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"vitft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print vitft's version and exit.")] = False,
) -> None:
    """Fine-tune Vision Transformers on your own images: finetune, evaluate, predict, explain, export, push."""


def command(*args, **kwargs) -> Callable:
    """`app.command` that turns a VitftError into one red line and exit code 1 (2 stays Click's usage error),
    never a traceback."""

    def register(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            setup_logging()
            try:
                return fn(*a, **kw)
            except VitftError as err:
                console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
                raise typer.Exit(1) from None

        return app.command(*args, cls=Command, **kwargs)(wrapper)

    return register


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


# ----------------------------------------------------------------------------- models


def _matches(pattern: str, *names: str) -> bool:
    """A glob (`*base*`) matches whole names; plain text matches anywhere in a name. Case-insensitive."""
    pattern = pattern.lower()
    glob = any(c in pattern for c in "*?[")
    return any(fnmatch.fnmatch(n.lower(), pattern) if glob else pattern in n.lower() for n in names)


@command("models")
def models_cmd(pattern: str = typer.Argument(
        "*", help="Text found in the architecture or alias name (dinov2, deit), or a glob ('*base*').")):
    """List the supported architectures and aliases."""
    from .models.archs import ALIASES, get_arch, list_archs

    table = Table(title="vitft models")
    for col in ("name", "params (M)", "img size", "patch", "default weights"):
        table.add_column(col, justify="right" if col in ("params (M)", "img size", "patch") else "left")
    for alias, target in ALIASES.items():
        if _matches(pattern, alias, target):
            arch = get_arch(target.split(".")[0])
            table.add_row(f"{alias} -> {arch.name}", f"{arch.params_m:.1f}", _size(arch.img_size),
                          _size(arch.patch_size), target.split(".", 1)[1])
    for name in list_archs():
        if _matches(pattern, name):
            arch = get_arch(name)
            table.add_row(name, f"{arch.params_m:.1f}", _size(arch.img_size), _size(arch.patch_size),
                          arch.default_tag or "-")
    if not table.row_count:
        raise VitftError(f"no architecture or alias matches {pattern!r}; `vitft models` lists them all")
    Console().print(table)


def _size(hw) -> str:
    return str(hw[0]) if hw[0] == hw[1] else f"{hw[0]}x{hw[1]}"


def _finetune_parameter(option: dataclasses.Field) -> inspect.Parameter:
    """The Typer parameter of a TrainConfig option: its type, default, panel and help from the field, `--x/--no-x`
    for a boolean."""
    hint = typing.get_type_hints(TrainConfig)[option.name]
    default = option.default
    dashed = "--" + option.name.replace("_", "-")
    extra: dict[str, Any] = {"metavar": option.metadata["metavar"]}
    if option.name == "model_kwargs":
        hint, default = Optional[list[str]], None
    elif hint is bool:
        dashed = f"{dashed}/--no-{dashed[2:]}"
    elif default is None:
        extra["show_default"] = option.metadata["when_none"]
    info = typer.Option(dashed, help=option.metadata["help"], rich_help_panel=option.metadata["panel"], **extra)
    return inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[hint, info])


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


def finetune_cmd(ctx: typer.Context, recipe: Optional[Path], resume: Optional[Path], **options: Any) -> None:
    """Fine-tune a ViT on an image folder: `vitft finetune --pretrained vit_b_16 --data ./intel`.

    Options given on the command line override the recipe's; the others take the recipe's value, else the
    default shown.
    """
    from .engine.api import finetune
    from .engine.distributed import is_main_process

    flags = {name: value for name, value in options.items()
             if ctx.get_parameter_source(name).name == "COMMANDLINE"}  # not the defaults: the recipe's win
    if "model_kwargs" in flags:
        flags["model_kwargs"] = _parse_kwargs(flags["model_kwargs"])
    result = finetune(resume=resume, recipe=recipe, started=COMMAND_STARTED, **flags)
    if is_main_process():  # under torchrun, one summary: rank 0's
        _summary(result)
    if result.interrupted:  # as a shell reports Ctrl-C: `vitft finetune ... && vitft evaluate ...` stops here
        raise typer.Exit(INTERRUPTED_EXIT)


finetune_cmd.__signature__ = inspect.Signature([
    inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
    inspect.Parameter("recipe", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[Path], typer.Option(help="YAML recipe of options; options given here override it.",
                                     metavar="YAML")]),
    inspect.Parameter("resume", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Optional[Path], typer.Option(help="Continue the run in this folder (needs no other option; options given "
                                     "change it).", metavar="RUN")]),
    *(_finetune_parameter(option) for option in TrainConfig.options()),
])
command("finetune")(finetune_cmd)


def _run_data(run_dir: Path) -> Optional[str]:
    """The data a run folder trained on, from its train_config.json."""
    from .run_folder import RunFolder

    return RunFolder(run_dir).train_config().get("data")


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
    """The run's outcome, and the command to run next: resume an interrupted run, else evaluate the finished one."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("run folder", escape(_printable(result.run_dir)))
    table.add_row("epochs done", str(result.epochs_done))
    last = result.metrics[-1] if result.metrics else None
    metric, key = ("mAP", "val_mAP") if last and "val_mAP" in last else ("top-1", "val_top1")  # multi-label: mAP
    if result.best_epoch > 0:
        table.add_row(f"best val {metric}", f"{100 * result.best_top1:.1f}% (epoch {result.best_epoch})")
    if last:
        table.add_row(f"last val {metric}", f"{100 * last[key]:.1f}%")
        table.add_row("last train loss", f"{last['train_loss']:.4f}")
    console.print(table)
    if result.stop_reason:
        console.print(f"stopped before --epochs: {escape(result.stop_reason)}; the best model (epoch "
                      f"{result.best_epoch}) is kept", highlight=False, soft_wrap=True)
    if result.interrupted:
        console.print(f"[yellow]interrupted[/] after {_plural(result.epochs_done, 'epoch')}; continue with "
                      f"`vitft finetune --resume {escape(_quoted(result.run_dir))}`", highlight=False, soft_wrap=True)
    else:
        data = _run_data(result.run_dir)
        console.print(f"next: `vitft evaluate {escape(_quoted(result.run_dir))} --data "
                      f"{escape(_quoted(data) if data else 'DATA')}`", highlight=False, soft_wrap=True)


def _printable(path) -> str:
    """A path for the terminal: bytes that are not UTF-8 as \\xNN, never a UnicodeEncodeError."""
    from .files import printable

    return printable(str(path))


def _quoted(path) -> str:
    """`path` as a shell word to paste: quoted, and bytes that are not UTF-8 in bash's $'\\xNN' form."""
    import os
    import shlex

    text = str(path)
    if _printable(text) == text:
        return shlex.quote(text)
    escaped = "".join(chr(b) if 32 <= b < 127 and chr(b) not in "'\\" else f"\\x{b:02x}" for b in os.fsencode(text))
    return f"$'{escaped}'"



@command("evaluate")
def evaluate_cmd(
    model: str = typer.Argument(..., help=MODEL_HELP),
    data: str = typer.Option(..., "--data", help="Labelled images in any layout finetune accepts, or a label file "
                             "(.csv, .tsv, .jsonl).", metavar="DIR|FILE"),
    split: Optional[str] = typer.Option(None, help="train, val or test.", show_default=(
        "test if present, else val; a single folder is evaluated whole")),
    arch: Optional[str] = typer.Option(None, "--model", help="Architecture of a bare weights file.", metavar="ARCH"),
    pretrained: bool = typer.Option(False, "--pretrained", help="MODEL is a timm name: evaluate its pretrained "
                                    "weights."),
    img_size: Optional[int] = typer.Option(None, help="Evaluate at this resolution (position embedding resized).",
                                           show_default="the model's"),
    tta: bool = typer.Option(False, "--tta", help="Average the predictions of each image and its mirror image."),
    batch_size: int = typer.Option(64, help="Images per batch."),
    workers: Optional[int] = typer.Option(None, help="DataLoader worker processes.", show_default=WORKERS_DEFAULT),
    threads: Optional[int] = typer.Option(None, help=THREADS_HELP, metavar="N", show_default=THREADS_DEFAULT),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    precision: str = typer.Option("auto", help=PRECISION_HELP),
    output: Optional[str] = typer.Option(None, help="Folder for report.json and friends.", metavar="DIR",
                                         show_default="the run folder, else ./eval-<model>"),
    explain: bool = typer.Option(False, "--explain", help="Overlay attention-rollout heat maps on mistakes.png (see "
                                 "`vitft explain`)."),
    val_split: Optional[float] = typer.Option(None, help="Split data without a validation folder, as finetune does, "
                                              "and evaluate its val part.", show_default=(
                                                  "a run's own split on the data it trained on, else a single "
                                                  "folder is evaluated whole")),
    seed: Optional[int] = typer.Option(None, help="Seed of that split.", show_default="the run's, else 0"),
    threshold: Optional[float] = typer.Option(None, help=THRESHOLD_HELP, show_default=THRESHOLD_DEFAULT),
    image_column: Optional[str] = typer.Option(None, help="A label file's column of image paths.", metavar="NAME",
                                               show_default="path, image, file or filename"),
    label_column: Optional[str] = typer.Option(None, help="A label file's column of labels.", metavar="NAME",
                                               show_default="label, labels, class or category"),
):
    """Evaluate a model on labelled images: metrics, per-class table, confusion matrix, mistakes."""
    from .progress import ProgressBar
    from .tasks.evaluate import DEFAULT_OUTPUT, evaluate

    with ProgressBar("evaluating", min_total=128) as bar:
        report = evaluate(model, data, split=split, img_size=img_size, tta=tta, batch_size=batch_size,
                          workers=workers, threads=threads, device=device, precision=precision,
                          output=output or DEFAULT_OUTPUT,
                          arch=arch, progress=bar, val_split=val_split, seed=seed,
                          explain="rollout" if explain else None, pretrained=pretrained, threshold=threshold,
                          image_column=image_column, label_column=label_column)
    if hasattr(report, "summary_lines"):  # a multi-label report
        for line in report.summary_lines():
            console.print(escape(line), highlight=False, soft_wrap=True)
    else:
        print_report(report)


@command("shards")
def shards_cmd(
    src: str = typer.Argument(..., help="Data in any form finetune's --data takes: a folder, hf:NAME, a "
                              "save_to_disk or parquet dataset, tar shards."),
    out: Path = typer.Argument(..., help="Folder for the shards (train-000000.tar, val-..., ...) and classes.json."),
    shard_size: int = typer.Option(1000, help="Images per shard."),
    val_split: float = typer.Option(0.1, help="Validation fraction split off data without a validation split, "
                                    "as finetune splits it."),
    seed: int = typer.Option(0, help="Seed of that split."),
    data_config: Optional[str] = typer.Option(None, help="With hf:NAME: the dataset's configuration."),
    data_revision: Optional[str] = typer.Option(None, help="With hf:NAME: the dataset's branch, tag or commit."),
    label_names: Optional[str] = typer.Option(None, help="Class names of integer labels, comma-separated."),
    overwrite: bool = typer.Option(False, help="Replace the shards already in OUT (else they are refused)."),
):
    """Write WebDataset tar shards from any data --data takes, for streamed training at scale."""
    from .data.datasets import find_dataset
    from .data.shards import write_shards

    splits = find_dataset(src, val_split, seed, config=data_config, revision=data_revision, label_names=label_names)
    for split, shards in write_shards(splits, out, shard_size, overwrite).items():
        pattern = f"{split}-{{000000..{len(shards) - 1:06d}}}.tar" if len(shards) > 1 else shards[0].name
        typer.echo(f"{split}: {len(shards)} shard{'s' * (len(shards) != 1)}, {_printable(out / pattern)}")


@command("predict")
def predict_cmd(
    model: str = typer.Argument(..., help=MODEL_HELP),
    inputs: list[str] = typer.Argument(..., help="Image files, folders (searched recursively) or globs."),
    arch: Optional[str] = typer.Option(None, "--model", help="Architecture of a bare weights file.", metavar="ARCH"),
    pretrained: bool = typer.Option(False, "--pretrained", help="MODEL is a timm name: use its pretrained weights."),
    top_k: int = typer.Option(3, help="Labels per image."),
    fmt: Optional[str] = typer.Option(None, "--format", help="csv or jsonl.",
                                      show_default="from --output's suffix, else csv"),
    output: Optional[str] = typer.Option(None, help="Output file.", metavar="FILE", show_default="stdout"),
    batch_size: int = typer.Option(64, help="Images per batch."),
    workers: Optional[int] = typer.Option(None, help="DataLoader worker processes.", show_default=WORKERS_DEFAULT),
    threads: Optional[int] = typer.Option(None, help=THREADS_HELP, metavar="N", show_default=THREADS_DEFAULT),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    precision: str = typer.Option("auto", help=PRECISION_HELP),
    img_size: Optional[int] = typer.Option(None, help="Predict at this resolution (position embedding resized).",
                                           show_default="the model's"),
    tta: bool = typer.Option(False, "--tta", help="Average the predictions of each image and its mirror image."),
    threshold: Optional[float] = typer.Option(None, help=THRESHOLD_HELP, show_default=THRESHOLD_DEFAULT),
):
    """Predict the top-k labels of images (multi-label: those above threshold); unreadable files become rows with an
    error."""
    from .progress import ProgressBar
    from .tasks.predict import predict

    # a bar on a terminal only when the rows do not go to that same terminal
    with ProgressBar("predicting", enabled=bool(output) or not sys.stdout.isatty(), min_total=128) as bar:
        rows = predict(model, inputs, top_k=top_k, img_size=img_size, tta=tta, batch_size=batch_size,
                       workers=workers, threads=threads, device=device, precision=precision, arch=arch, progress=bar,
                       pretrained=pretrained, output=output or sys.stdout, fmt=fmt, threshold=threshold)
    bad = sum(row.error is not None for row in rows)
    good = rows.total - bad
    if output:
        console.print(f"wrote {good} prediction(s) to {escape(_printable(output))}", highlight=False,
                      soft_wrap=True)
    if bad and not good:
        raise VitftError(f"none of the {bad} file(s) could be read as an image; their rows have an error field")
    if bad:
        console.print(f"[yellow]warning:[/] {bad} of {good + bad} file(s) could not be read; their rows have an "
                      f"error field", highlight=False, soft_wrap=True)


@command("explain")
def explain_cmd(
    model: str = typer.Argument(..., help=MODEL_HELP),
    images: list[str] = typer.Argument(..., help="Image files, folders (searched recursively) or globs."),
    output: str = typer.Option(..., "--output", help="Folder for one PNG per image and index.html.", metavar="DIR"),
    method: str = typer.Option("rollout", help="rollout (attention rollout), attention (last block) or gradcam "
                               "(gradient-weighted, per class)."),
    target: Optional[str] = typer.Option(None, help="With --method gradcam: the label to explain.",
                                         show_default="the prediction"),
    arch: Optional[str] = typer.Option(None, "--model", help="Architecture of a bare weights file.", metavar="ARCH"),
    pretrained: bool = typer.Option(False, "--pretrained", help="MODEL is a timm name: use its pretrained weights."),
    top_k: int = typer.Option(3, help="Labels shown per image."),
    img_size: Optional[int] = typer.Option(None, help="Run at this resolution (position embedding resized).",
                                           show_default="the model's"),
    batch_size: int = typer.Option(16, help="Images per batch."),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    precision: str = typer.Option("auto", help=PRECISION_HELP),
    keep_sinks: bool = typer.Option(False, "--keep-sinks", help="Rollout: keep the patches that take over a tenth "
                                    "of a layer's attention (left out by default on models without registers)."),
):
    """Show where the model looked: a heat map over each image, with its top labels."""
    from .progress import ProgressBar
    from .tasks.explain import explain

    with ProgressBar("explaining", min_total=8) as bar:
        results = explain(model, images, method=method, target=target, output=output, top_k=top_k,
                          img_size=img_size, batch_size=batch_size, device=device, precision=precision, arch=arch,
                          progress=bar, pretrained=pretrained, drop_sinks=False if keep_sinks else None)
    bad = sum(r.error is not None for r in results)
    if bad == len(results):
        raise VitftError(f"none of the {bad} file(s) could be read as an image: no heat maps (index.html lists "
                         f"them with the reason, in {_printable(Path(output).expanduser())})")
    console.print(f"wrote {len(results) - bad} heat map(s) ({method}) and index.html to "
                  f"{escape(_printable(Path(output).expanduser()))}", highlight=False, soft_wrap=True)
    if bad:
        console.print(f"[yellow]warning:[/] {bad} of {len(results)} file(s) could not be read", highlight=False,
                      soft_wrap=True)


@command("env")
def env_cmd(as_json: bool = typer.Option(False, "--json", help="One JSON object, for machines.")):
    """Print versions, devices, the CPU's measured speed and what auto picks: paste it into a bug report."""
    import json

    from .env_report import collect, format_text

    report = collect()
    typer.echo(json.dumps(report, indent=1) if as_json else format_text(report))


ADAPTER_HELP = ("A --lora run's adapter alone (adapter_config.json + adapter_model.safetensors, loaded with timm + "
                "peft), not the merged model.")


@command("export")
def export_cmd(
    run_dir: Path = typer.Argument(..., help="Run folder written by `vitft finetune` (or any saved model folder)."),
    out_dir: Path = typer.Argument(..., help="Folder to write: config.json, model.safetensors, README.md, images."),
    dtype: str = typer.Option("fp32", "--dtype", help="Saved weights' precision: fp32, fp16 or bf16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the exported files in a non-empty OUT_DIR."),
    repo_id: Optional[str] = typer.Option(None, "--repo-id",
                                          help="Repo the card's usage snippets name.",
                                          show_default="a <user>/<repo> placeholder"),
    dataset: Optional[str] = typer.Option(None, "--dataset",
                                          help="Hub dataset id trained on, for the card's metadata."),
    onnx: bool = typer.Option(False, "--onnx",
                              help="Also write model.onnx (float32), checked against PyTorch with onnxruntime. Needs: "
                                   f"{ONNX_INSTALL}."),
    img_size: Optional[int] = typer.Option(None, "--img-size",
                                           help="Export everything at this input size (position embedding resized).",
                                           show_default="the run's"),
    adapter: bool = typer.Option(False, "--adapter", help=ADAPTER_HELP),
):
    """Export a run as a Hub-ready model folder: timm format plus a model card (and model.onnx with --onnx)."""
    from .hub.export import export

    out = export(run_dir, out_dir, dtype=dtype, overwrite=overwrite, repo_id=repo_id, dataset=dataset, onnx=onnx,
                 img_size=img_size, adapter=adapter)
    typer.echo(f"exported {_printable(run_dir)} to {_printable(out)}")


@command("push")
def push_cmd(
    run_dir: Path = typer.Argument(..., help="Run folder written by `vitft finetune`."),
    repo_id: str = typer.Argument(..., help="Hub model repo, user/name or org/name (created when missing)."),
    token: Optional[str] = typer.Option(None, "--token",
                                        help="Hub token with write access.",
                                        show_default="HF_TOKEN, else the cached `hf auth login`"),
    private: bool = typer.Option(False, "--private",
                                 help="Create the repo private (an existing repo keeps its visibility)."),
    revision: Optional[str] = typer.Option(None, "--revision",
                                           help="Branch to commit to, created from main when missing.",
                                           show_default="main"),
    create_pr: bool = typer.Option(False, "--create-pr",
                                   help="Open a pull request against main instead of committing to it."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", help="Commit title."),
    overwrite_card: bool = typer.Option(False, "--overwrite-card", help="Replace a README.md already in the repo."),
    dtype: str = typer.Option("fp32", "--dtype", help="Uploaded weights' precision: fp32, fp16 or bf16."),
    dataset: Optional[str] = typer.Option(None, "--dataset",
                                          help="Hub dataset id trained on, for the card's metadata."),
    adapter: bool = typer.Option(False, "--adapter", help=ADAPTER_HELP),
):
    """Export a run and upload it to a Hugging Face Hub model repo."""
    from .hub.push import push

    result = push(run_dir, repo_id, token=token, private=private, revision=revision, create_pr=create_pr,
                  commit_message=commit_message, overwrite_card=overwrite_card, dtype=dtype, dataset=dataset,
                  adapter=adapter)
    typer.echo(f"pushed to {result.url}")
    if result.pr_url:
        typer.echo(f"pull request: {result.pr_url}")
    typer.echo(f"commit: {result.commit}" + (f" ({result.commit_url})" if result.commit_url else ""))


def main() -> None:
    global COMMAND_STARTED
    COMMAND_STARTED = time.monotonic() - command_age()
    app()


COMMAND_STARTED: Optional[float] = None  # time.monotonic() when the command started, for --time-budget


def command_age() -> float:
    """Seconds since the command started (Linux's /proc; 0 elsewhere): a --time-budget counts the imports too, and
    under torchrun (TORCHELASTIC_RUN_ID) the launcher's start-up before it started this worker, its parent."""
    process = str(os.getppid()) if os.environ.get("TORCHELASTIC_RUN_ID") else "self"
    try:
        with open(f"/proc/{process}/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            return max(0.0, float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0

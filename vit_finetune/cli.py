"""The `vitft` command line: thin Typer commands over the library functions."""
from __future__ import annotations

import fnmatch
import functools
import logging
import os
import sys
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
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
                console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
                raise typer.Exit(2) from None

        return app.command(*args, **kwargs)(wrapper)

    return register


def _setup_logging(quiet: bool = False) -> None:
    logger = logging.getLogger("vitft")
    if not logger.handlers:
        handler = RichHandler(console=console, show_time=False, show_path=False) if sys.stderr.isatty() \
            else logging.StreamHandler()
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


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
# <evaluate-commands>
# <hub-commands>


def main() -> None:
    app()

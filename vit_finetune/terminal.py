"""What the `vitft` command line shows on a terminal: its help layout, the log handler, the console for messages
and the tables of an evaluation report. Light: no torch, no timm."""
from __future__ import annotations

import contextlib
import inspect
import logging
import re
import sys
from typing import Iterator, Optional

import typer.rich_utils
from rich import box
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperArgument, TyperCommand, TyperGroup

from .files import printable

console = Console(stderr=True)  # messages and logs; results that a pipe may want go to stdout


def _plain_flags(command) -> None:
    """Flags show no '<bool>' type; arguments are named in capitals (MODEL), as in the usage line."""
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif isinstance(param, TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper()


class _OptionsTable(Table):
    """typer's table of options whose name and type columns never wrap: at 80 columns the help column gives way,
    so `--max-steps-per-epoch` shows whole (rich would cut every column alike), and a long word in the help
    folds rather than ending in an ellipsis."""

    def add_row(self, *renderables, **kwargs) -> None:
        super().add_row(*renderables, **kwargs)
        for column in self.columns[:-1]:
            column.no_wrap = True
        help_cell = renderables[-1] if renderables else None
        for text in getattr(help_cell, "renderables", [help_cell]):  # typer's help cell: Columns of Text
            if isinstance(text, Text) and text.overflow is None:
                text.overflow = "fold"


def _unwrapped(text: str) -> str:
    """Paragraphs as single lines: typer keeps a docstring's line breaks after its first paragraph, and the
    terminal wraps them again, leaving a short line at every break of the source."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in inspect.cleandoc(text).split("\n\n"))


@contextlib.contextmanager
def _help_as_written(command) -> Iterator[None]:
    """While `command`'s help is shown: its help, its parameters' and its subcommands' unwrapped and with rich
    markup escaped (typer reads them as markup: `pip install 'vit-finetune[onnx]'` lost `[onnx]`), in typer's
    tables of options with whole names. The texts are given back as they were after."""
    texts = [command, *command.params, *getattr(command, "commands", {}).values()]
    written = [item.help for item in texts]
    for item in texts:
        item.help = escape(_unwrapped(item.help)) if item.help else item.help
    table, typer.rich_utils.Table = typer.rich_utils.Table, _OptionsTable
    try:
        yield
    finally:
        typer.rich_utils.Table = table
        for item, text in zip(texts, written):
            item.help = text


class _PlainFlags:
    """Help that shows flags (--help included) without a type, and every help text as written."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _plain_flags(self)

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def format_help(self, ctx, formatter) -> None:
        with _help_as_written(self):
            super().format_help(ctx, formatter)


class Command(_PlainFlags, TyperCommand):
    """A command whose usage line reads `MODEL INPUTS...`, not `{model} {inputs}...`."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [re.sub(r"\{([^}]*)\}", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


class Group(_PlainFlags, TyperGroup):
    """The `vitft` group: its --help shows flags without a type too."""


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (test runners swap it between commands)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging() -> None:
    """vitft's INFO logs on stderr: rich on a terminal, plain lines when piped (one handler, however many commands
    run in one process)."""
    logger = logging.getLogger("vitft")
    if not logger.handlers:
        handler = RichHandler(console=console, show_time=False, show_path=False) if sys.stderr.isatty() \
            else _StderrHandler()
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)


def print_report(report, out: Optional[Console] = None) -> None:
    """An EvalReport as rich tables on a terminal, as plain aligned text when piped."""
    def shown(text: str) -> str:  # rich markup escaped, undecodable file name bytes as \xNN
        return escape(printable(text))

    out = out or Console()
    style = box.SIMPLE_HEAD if out.is_terminal else None
    data = report.data
    out.print(f"evaluated {shown(str(report.model['source'] or report.model['architecture']))} on "
              f"{shown(data['root'])} (split: {data['split']}, layout: {shown(data['layout'])}): "
              f"{report.num_images} images", highlight=False, soft_wrap=True)
    summary = Table.grid(padding=(0, 2))
    summary.add_column()
    summary.add_column(justify="right")
    summary.add_row("top-1 accuracy", f"{100 * report.accuracy:.1f}%")
    summary.add_row("balanced accuracy", f"{100 * report.balanced_accuracy:.1f}%")
    if report.top5 is not None:
        summary.add_row("top-5 accuracy", f"{100 * report.top5:.1f}%")
    summary.add_row("loss", f"{report.loss:.4f}")
    summary.add_row("macro F1", f"{report.macro_f1:.3f}")
    summary.add_row("weighted F1", f"{report.weighted_f1:.3f}")
    summary.add_row("images/s", f"{report.images_per_s:.1f}")
    out.print(summary, highlight=False)

    per_class = Table(title="per class", box=style, title_justify="left", highlight=False)
    per_class.add_column("class")
    for col in ("precision", "recall", "F1", "support"):
        per_class.add_column(col, justify="right")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for name, row in report.per_class.items():
        per_class.add_row(shown(name), fmt(row["precision"]), fmt(row["recall"]), fmt(row["f1"]),
                          str(row["support"]))
    out.print()
    out.print(per_class)
    if report.confused_pairs:
        pairs = Table(title="most confused (true -> predicted)", box=style, title_justify="left", highlight=False)
        for col in ("true", "predicted", "count", "% of true"):
            pairs.add_column(col, justify="right" if col in ("count", "% of true") else "left")
        for p in report.confused_pairs[:5]:
            pairs.add_row(shown(p["true"]), shown(p["predicted"]), str(p["count"]),
                          f"{100 * p['fraction_of_true']:.1f}%")
        out.print()
        out.print(pairs)
    if report.absent_classes:
        out.print(f"\nmodel classes not in the data (support 0): {shown(', '.join(report.absent_classes))}",
                  highlight=False, soft_wrap=True)
    if report.skipped:
        out.print(f"\n{len(report.skipped)} file(s) skipped (not readable images): "
                  f"{shown(', '.join(report.skipped[:3]))}" + (" ..." if len(report.skipped) > 3 else ""),
                  highlight=False, soft_wrap=True)
    if report.output is not None:
        out.print(f"\nwrote report.json, predictions.csv, confusion_matrix.png, mistakes.png to "
                  f"{shown(str(report.output))}", highlight=False, soft_wrap=True)

"""The one progress bar of training, evaluate, predict and explain: rich, on stderr, drawn only on a terminal."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn


class ProgressBar:
    """Rich progress bars on stderr, removed when done. Training adds, updates and removes a task per epoch; called
    as `bar(done, total)` (a ProgressFn), it is the one bar of evaluate, predict and explain, drawn for at least
    `min_total` items.

    Log lines written to stderr meanwhile appear above the bars; stdout (predict's rows) is left alone.
    """

    def __init__(self, description: str = "", enabled: bool = True, min_total: int = 0):
        console = Console(stderr=True)
        self.description, self.min_total = description, min_total
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console,
                                  disable=not (enabled and console.is_terminal), transient=True,
                                  redirect_stdout=False, redirect_stderr=True)
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def add_task(self, description: str, total: float, completed: float = 0, info: str = "") -> TaskID:
        return self._progress.add_task(description, total=total, completed=completed, info=info)

    def update(self, task: TaskID, **changes: Any) -> None:
        """rich's Progress.update: advance=, completed=, info= (the text after the bar)."""
        self._progress.update(task, **changes)

    def remove_task(self, task: TaskID) -> None:
        self._progress.remove_task(task)

    def __call__(self, done: int, total: int) -> None:
        if total < self.min_total:
            return
        if self._task is None:
            self._task = self.add_task(self.description, total)
        self.update(self._task, completed=done)

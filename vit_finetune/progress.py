"""The one progress bar of training, evaluate, predict and explain: rich, on stderr, drawn on a terminal; off a
terminal (output redirected to a file, a batch job), a log line per task at least every `interval` seconds."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

log = logging.getLogger("vitft")
LINE_INTERVAL_S = 30.0  # off a terminal: the most seconds a long pass goes without a line


class ProgressBar:
    """Rich progress bars on stderr, removed when done. Training adds, updates and removes a task per pass; called
    as `bar(done, total)` (a ProgressFn), it is the one bar of evaluate, predict and explain, drawn for at least
    `min_total` items.

    Log lines written to stderr meanwhile appear above the bars; stdout (predict's rows) is left alone. When stderr
    is not a terminal, each task logs "description: done/total unit, rate/s, time left" once `interval` seconds
    (LINE_INTERVAL_S by default) have passed since its start or its last line (`clock` is for tests).
    """

    def __init__(self, description: str = "", enabled: bool = True, min_total: int = 0,
                 interval: Optional[float] = None, clock: Callable[[], float] = time.monotonic):
        console = Console(stderr=True)
        self.description, self.min_total = description, min_total
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console,
                                  disable=not (enabled and console.is_terminal), transient=True,
                                  redirect_stdout=False, redirect_stderr=True)
        self._lines = enabled and not console.is_terminal
        self.interval = LINE_INTERVAL_S if interval is None else interval
        self.clock = clock
        self._timing: dict[TaskID, tuple[float, float, float, str]] = {}  # start, first completed, last line, unit
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def add_task(self, description: str, total: float, completed: float = 0, info: str = "",
                 unit: str = "") -> TaskID:
        """`unit` names what `total` counts (" images"), for the lines written off a terminal."""
        task = self._progress.add_task(description, total=total, completed=completed, info=info)
        now = self.clock()
        self._timing[task] = (now, completed, now, unit)
        return task

    def update(self, task: TaskID, **changes: Any) -> None:
        """rich's Progress.update: advance=, completed=, info= (the text after the bar)."""
        self._progress.update(task, **changes)
        if self._lines:
            self._maybe_line(task)

    def remove_task(self, task: TaskID) -> None:
        self._progress.remove_task(task)
        self._timing.pop(task, None)

    def counter(self, description: str, unit: str = "") -> Callable[[int, int], None]:
        """A ProgressFn `(done, total)` for one pass: its task appears on the first call and goes when done."""
        task: Optional[TaskID] = None

        def progress(done: int, total: int) -> None:
            nonlocal task
            if task is None:
                task = self.add_task(description, total, unit=unit)
            self.update(task, completed=done)
            if done >= total:
                self.remove_task(task)
                task = None

        return progress

    def _maybe_line(self, task: TaskID) -> None:
        start, first, last, unit = self._timing[task]
        now = self.clock()
        if now - last < self.interval:
            return
        self._timing[task] = (start, first, now, unit)
        state = next(t for t in self._progress.tasks if t.id == task)
        rate = (state.completed - first) / max(now - start, 1e-9)
        left = f", {format_seconds((state.total - state.completed) / rate)} left" if rate > 0 and state.total else ""
        info = f" ({state.fields['info']})" if state.fields.get("info") else ""
        log.info("%s: %d/%d%s, %s%s/s%s%s", state.description, state.completed, state.total or 0, unit,
                 format_rate(rate), unit, left, info)

    def __call__(self, done: int, total: int) -> None:
        if total < self.min_total:
            return
        if self._task is None:
            self._task = self.add_task(self.description, total)
        self.update(self._task, completed=done)


def format_rate(per_second: float) -> str:
    """One decimal under 10 (a short run's 0.4 img/s is not 0), none above."""
    return f"{per_second:.1f}" if per_second < 10 else f"{per_second:.0f}"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"

"""Writing files safely and naming them printably: the helpers every module that writes or reports files shares.

Nothing here imports torch, so plotting and reporting stay light.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def plain_permissions(path: Path) -> None:
    """The modes open() / mkdir() would give, for a file, or a folder and the files in it, made private
    (0600 / 0700) by mkstemp / mkdtemp."""
    mask = os.umask(0)  # the only way to read the umask is to set it
    os.umask(mask)
    if path.is_dir():
        path.chmod(0o777 & ~mask)
        for item in path.iterdir():
            item.chmod(0o666 & ~mask)
    else:
        path.chmod(0o666 & ~mask)


def write_temp(path: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` on a temporary file next to `path` and flush it to disk; returns tmp (removed on error)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        plain_permissions(Path(tmp))  # mkstemp makes 0600, and so does a writer that replaces tmp (safetensors)
        with open(tmp, "rb+") as f:  # on disk before the rename: a crash leaves the old file, not an empty one
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` then rename over `path`: readers never see a half-written file."""
    tmp = write_temp(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def printable(text: str) -> str:
    """`text` with the bytes of a file name that are not UTF-8 written as \\xNN, as `ls -b` shows them.

    Python reads such names as lone surrogates ('caf\\udce9.jpg' for the bytes b'caf\\xe9.jpg'), which no
    UTF-8 file or terminal can take: every report, CSV, JSONL and model card writes names through this.
    """
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that is not an escaped byte (e.g. from JSON): its code point
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def printable_tree(value):
    """`printable` applied to every string (and dict key) in nested dicts and lists, for JSON outputs."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_tree(v) for v in value]
    return value

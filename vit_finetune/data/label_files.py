"""Label files: a .csv, .tsv or .jsonl with one row per image (a path and its label or labels, optionally a split),
as labelling tools export them. Reads the file and the image headers only.

Paths are relative to the file's folder, or absolute. A relative path that leads out of that folder (`../x.jpg`)
(by its text: symlinks inside the folder may point anywhere) is a bad row, as are a missing file, an empty label,
an unreadable image, a JSONL line that is no JSON object and a second row of the same image: each is skipped,
counted and reported by line number, and none stops the run. Several labels in a row (`a|b`, `a;b`, or a JSON
list in JSONL) make the task multi-label. Labels that are all numbers are taken as class names (with a warning),
ordered by value.
"""
from __future__ import annotations

import csv
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from ..errors import VitftError
from .images import few, probe

log = logging.getLogger("vitft")

LABEL_FILE_SUFFIXES = (".csv", ".tsv", ".jsonl")
IMAGE_COLUMNS = ("path", "image", "file", "filename")
LABEL_COLUMNS = ("label", "labels", "class", "category")
SPLIT_NAMES = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "test"}
LABEL_SEPARATORS = ("|", ";")

Row = tuple[int, Path, tuple[str, ...], Optional[str]]  # (line number, path, label names, split)


def is_label_file(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(LABEL_FILE_SUFFIXES)


def read_label_file(path: str | os.PathLike, image_column: Optional[str] = None,
                    label_column: Optional[str] = None) -> tuple[list[str], list[Row], bool]:
    """(class names, good rows, multi-label?) of a label file; bad rows are skipped with one warning."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise VitftError(f"label file {path} {'is not a file' if path.exists() else 'does not exist'}; pass a "
                         f".csv, .tsv or .jsonl with one row per image")
    records, broken = _records(path)
    if not records and not broken:
        raise VitftError(f"label file {path} has no rows; add one row per image (a path and a label)")
    if not records:
        raise VitftError(f"label file {path} has no usable row among {len(broken)}: {few(broken)}")
    columns = list(dict.fromkeys(k for _, record in records[:100] for k in record))
    image_key = _column(columns, image_column, IMAGE_COLUMNS, "image", path)
    label_key = _column(columns, label_column, LABEL_COLUMNS, "label", path)
    split_key = next((c for c in columns if c.lower() == "split"), None)
    root, rows, bad, first_line = path.parent.resolve(), [], list(broken), {}
    for line, record in records:
        split = _split_name(record.get(split_key), line, path) if split_key else None
        labels = _labels(record.get(label_key))
        image = str(record.get(image_key) or "").strip()
        file = Path(image).expanduser()
        if not image:
            bad.append(f"line {line} (no path)")
        elif not labels:
            bad.append(f"line {line} (no label)")
        elif not file.is_absolute() and not Path(os.path.normpath(root / file)).is_relative_to(root):
            bad.append(f"line {line} ({image} is outside {root}: give it as an absolute path)")
        elif (seen := first_line.setdefault(os.path.normpath(root / file), line)) != line:
            # an image listed twice would count twice, and could be trained on and validated on
            bad.append(f"line {line} ({image} repeats line {seen}: give each image one row, with all its labels "
                       f"as a|b)")
        else:
            rows.append((line, file if file.is_absolute() else root / file, labels, split))
    with ThreadPoolExecutor(8) as pool:  # header reads only, threads hide the latency of network file systems
        found = list(pool.map(probe, [p for _, p, _, _ in rows]))
    bad += [f"line {line} ({p.name}: {'missing' if not p.exists() else why})"
            for (line, p, _, _), why in zip(rows, found) if isinstance(why, str)]
    rows = [row for row, why in zip(rows, found) if not isinstance(why, str)]
    if bad:
        log.warning("%s: skipped %d of %d rows: %s", path.name, len(bad), len(records) + len(broken),
                    few(sorted(bad, key=_line)))
    if not rows:
        raise VitftError(f"label file {path} has no usable row among {len(records) + len(broken)}: "
                         f"{few(sorted(bad, key=_line))}")
    names = {name for _, _, labels, _ in rows for name in labels}
    numeric = all(_is_number(n) for n in names)
    if numeric:
        log.warning("%s: the labels are all numbers; they are used as class names (%s), ordered by value",
                    path.name, few(sorted(names, key=float)))
    classes = sorted(names, key=float if numeric else str)
    multi_label = any(len(labels) > 1 for _, _, labels, _ in rows)
    return classes, rows, multi_label


def _line(text: str) -> int:
    return int(text.split()[1])


def _records(path: Path) -> tuple[list[tuple[int, dict]], list[str]]:
    """(line number, {column: value}) of each non-empty row, and the JSONL lines that are no JSON object (bad
    rows, as "line N (why)": one broken line of a long export should not stop the run)."""
    if path.suffix.lower() == ".jsonl":
        records, broken = [], []
        with open(path, encoding="utf-8-sig") as f:
            for line, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as err:
                    broken.append(f"line {line} (not JSON: {err.msg})")
                    continue
                if isinstance(record, dict):
                    records.append((line, record))
                else:
                    broken.append(f"line {line} (not a JSON object)")
        return records, broken
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
        return [(reader.line_num, record) for record in reader if any((v or "").strip() for v in record.values())], []


def _column(columns: list[str], given: Optional[str], candidates: tuple[str, ...], what: str, path: Path) -> str:
    """The column that holds the images (or labels): the one given, else the first candidate name present."""
    if given is not None:
        if given in columns:
            return given
        found = next((c for c in columns if c.lower() == given.lower()), None)
        if found is None:
            raise VitftError(f"{path} has no column {given!r} (its columns: {', '.join(columns)}); fix "
                             f"--{what}-column")
        return found
    found = next((c for name in candidates for c in columns if c.lower() == name), None)
    if found is None:
        raise VitftError(f"{path} has no {what} column ({'/'.join(candidates)}); its columns are "
                         f"{', '.join(columns) or 'none'}: name the right one with --{what}-column")
    return found


def _split_name(value, line: int, path: Path) -> str:
    name = str(value or "").strip().lower()
    if name not in SPLIT_NAMES:
        raise VitftError(f"{path} line {line}: unknown split {value!r}; use train, val (valid, validation) or test")
    return SPLIT_NAMES[name]


def _labels(value) -> tuple[str, ...]:
    """The label names of a cell: a JSON list, or text with | or ; between labels; sorted, without repeats."""
    if isinstance(value, (list, tuple)):
        names = [str(v).strip() for v in value]
    else:
        text = "" if value is None else str(value)
        for separator in LABEL_SEPARATORS[1:]:
            text = text.replace(separator, LABEL_SEPARATORS[0])
        names = [n.strip() for n in text.split(LABEL_SEPARATORS[0])]
    return tuple(sorted({n for n in names if n}))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

"""Label files (--data labels.csv|.tsv|.jsonl): column detection, split column, bad rows counted by line, the
errors for bad files, training on a CSV of real photos and evaluating on one."""
from __future__ import annotations

import csv
import json
import logging
import random
from collections import Counter
from pathlib import Path

import pytest
from conftest import CLASSES

from vit_finetune.data.datasets import find_dataset
from vit_finetune.data.loaders import ImageDataset
from vit_finetune.engine.api import finetune
from vit_finetune.errors import VitftError
from vit_finetune.tasks.evaluate import evaluate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def photos(intel_dir: Path, per_class: int, seed: int = 0) -> list[tuple[Path, str]]:
    """A seeded subset of the real photos: (path, class) pairs."""
    rng = random.Random(seed)
    chosen = []
    for name in CLASSES:
        files = sorted((intel_dir / name).glob("*.jpg"))
        chosen += [(p, name) for p in rng.sample(files, per_class)]
    return chosen


def write_csv(path: Path, header: list[str], rows: list[list], delimiter: str = ",") -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def linked(folder: Path, pairs: list[tuple[Path, str]]) -> list[tuple[str, str]]:
    """Symlinks to the photos under folder/img/, as (path relative to folder, class) rows."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (photo, name) in enumerate(pairs):
        link = folder / "img" / f"{i:03d}_{photo.name}"
        link.symlink_to(photo)
        rows.append((f"img/{link.name}", name))
    return rows


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_the_three_formats_give_the_same_stratified_seeded_split(intel_dir, tmp_path, fmt):
    rows = linked(tmp_path, photos(intel_dir, 10))
    if fmt == "jsonl":
        path = tmp_path / "labels.jsonl"
        path.write_text("".join(json.dumps({"Image": p, "Category": c}) + "\n" for p, c in rows))
    else:
        path = write_csv(tmp_path / f"labels.{fmt}", ["Image", "Category"], rows, "\t" if fmt == "tsv" else ",")
    splits = find_dataset(path, val_split=0.2, seed=3)
    assert splits.classes == CLASSES and not splits.multi_label and splits.test is None
    assert splits.class_counts()["val"] == {c: 2 for c in CLASSES}
    everything = sorted((str(p.relative_to(tmp_path)), CLASSES[label]) for p, label in splits.train + splits.val)
    assert everything == sorted(rows)
    assert splits.val == find_dataset(path, val_split=0.2, seed=3).val
    assert "label file" in splits.layout and "split 80/20 (seed 3)" in splits.layout


def test_bad_rows_are_skipped_and_reported_by_line_number(intel_dir, tmp_path, caplog):
    rows = linked(tmp_path / "data", photos(intel_dir, 2))
    outside = tmp_path / "elsewhere.jpg"
    outside.symlink_to(photos(intel_dir, 1)[0][0])
    (tmp_path / "data" / "img" / "broken.jpg").write_text("not a jpeg")
    bad = [["img/missing.jpg", "forest"], [rows[0][0], ""], ["../elsewhere.jpg", "sea"], ["img/broken.jpg", "sea"]]
    path = write_csv(tmp_path / "data" / "labels.csv", ["path", "label"], [*map(list, rows), *bad,
                                                                          [str(outside), "sea"]])
    with caplog.at_level(logging.WARNING, logger="vitft"):
        splits = find_dataset(path, val_split=0.25)
    assert len(splits.train) + len(splits.val) == len(rows) + 1  # the absolute path outside the folder is fine
    warning = next(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    first = len(rows) + 2  # the header is line 1
    assert f"skipped 4 of {len(rows) + 5} rows" in warning
    assert f"line {first} (missing.jpg: missing)" in warning and f"line {first + 1} (no label)" in warning
    assert f"line {first + 2} (../elsewhere.jpg is outside" in warning and "and 1 more" in warning



def test_broken_jsonl_lines_are_skipped_and_reported_by_line_number(intel_dir, tmp_path, caplog):
    rows = linked(tmp_path, photos(intel_dir, 2))
    lines = [json.dumps({"path": path, "label": name}) for path, name in rows]
    lines[2:2] = ['{"path": "img/x.jpg", "label": ', '["not", "an", "object"]']  # lines 3 and 4 (an export cut short)
    (tmp_path / "labels.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="vitft"):
        splits = find_dataset(tmp_path / "labels.jsonl", val_split=0.25)
    assert len(splits.train) + len(splits.val) == len(rows)
    warning = next(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert f"skipped 2 of {len(rows) + 2} rows: line 3 (not JSON: Expecting value), line 4 (not a JSON object)" \
        in warning
    (tmp_path / "broken.jsonl").write_text(lines[2] + "\n")
    with pytest.raises(VitftError, match=r"has no usable row among 1: line 1 \(not JSON: Expecting value\)"):
        find_dataset(tmp_path / "broken.jsonl")


def test_a_second_row_of_the_same_image_is_skipped_and_reported(intel_dir, tmp_path, caplog):
    """Counted twice, an image could land in both the training and the validation split."""
    rows = linked(tmp_path, photos(intel_dir, 2))
    again = [[rows[0][0], rows[0][1]], ["./" + rows[1][0], "sea"]]  # the same file, by the same or another path text
    path = write_csv(tmp_path / "labels.csv", ["path", "label"], [*map(list, rows), *again])
    with caplog.at_level(logging.WARNING, logger="vitft"):
        splits = find_dataset(path, val_split=0.25)
    assert sorted(p for p, _ in splits.train + splits.val) == sorted(tmp_path / p for p, _ in rows)
    warning = next(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert f"skipped 2 of {len(rows) + 2} rows: line {len(rows) + 2} ({rows[0][0]} repeats line 2: give each image " \
           f"one row, with all its labels as a|b), line {len(rows) + 3} (./{rows[1][0]} repeats line 3" in warning

@pytest.mark.parametrize("header, rows, options, message", [
    (["file", "tag"], [["a.jpg", "x"]], {}, r"has no label column \(label/labels/class/category\); its columns are "
                                           r"file, tag: name the right one with --label-column"),
    (["path", "label"], [["a.jpg", "x"]], {"label_column": "tag"},
     r"has no column 'tag' \(its columns: path, label\); fix --label-column"),
    (["photo", "label"], [["a.jpg", "x"]], {}, r"has no image column .* --image-column"),
    (["path", "label", "split"], [["a.jpg", "x", "train"], ["a.jpg", "x", "dev"]], {},
     r"line 3: unknown split 'dev'; use train, val \(valid, validation\) or test"),
    (["path", "label"], [], {}, r"has no rows; add one row per image"),
    (["path", "label"], [["nowhere.jpg", "x"]], {}, r"has no usable row among 1: line 2 \(nowhere.jpg: missing\)"),
])
def test_bad_label_files_are_one_line_errors(tmp_path, header, rows, options, message):
    path = write_csv(tmp_path / "labels.csv", header, rows)
    with pytest.raises(VitftError, match=message):
        find_dataset(path, **options)


def test_numeric_labels_are_class_names_ordered_by_value(intel_dir, tmp_path, caplog):
    rows = linked(tmp_path, photos(intel_dir, 2)[:8])
    path = write_csv(tmp_path / "labels.csv", ["path", "class"],
                     [[p, n] for (p, _), n in zip(rows, [0, 1, 2, 10] * 2)])
    with caplog.at_level(logging.WARNING, logger="vitft"):
        splits = find_dataset(path, val_split=0.5)
    assert splits.classes == ["0", "1", "2", "10"]
    assert any("the labels are all numbers" in r.getMessage() for r in caplog.records)


def test_training_on_a_csv_sees_each_training_image_once_per_epoch_with_its_label(intel_dir, tiny_model_dir,
                                                                                 tmp_path, monkeypatch):
    chosen = photos(intel_dir, 8, seed=1)
    rows = linked(tmp_path, chosen)
    split = ["val" if i % 4 == 0 else "train" for i in range(len(rows))]  # 36 train, 12 val
    path = write_csv(tmp_path / "labels.csv", ["path", "label", "split"], [[p, c, s] for (p, c), s in zip(rows, split)])
    seen: list[tuple[str, int]] = []
    original = ImageDataset.__getitem__

    def recording(self, index):
        item = original(self, index)
        if self.name == "train":
            seen.append((self.paths[item[2] if self.return_index else index].name, int(item[1])))
        return item

    monkeypatch.setattr(ImageDataset, "__getitem__", recording)
    result = finetune(data=str(path), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"), epochs=2,
                      batch_size=12, workers=0, warmup_epochs=0, quiet=True, device="cpu", precision="fp32")
    assert result.epochs_done == 2
    expected = Counter((Path(p).name, CLASSES.index(c)) for (p, c), s in zip(rows, split) if s == "train")
    assert len(seen) == 2 * 36
    assert Counter(seen[:36]) == expected and Counter(seen[36:]) == expected


def test_evaluate_on_a_label_file_takes_every_row_or_its_test_rows(intel_dir, tiny_model_dir, tmp_path):
    rows = linked(tmp_path, photos(intel_dir, 3, seed=2))
    whole = write_csv(tmp_path / "all.csv", ["path", "label"], rows)
    report = evaluate(tiny_model_dir, whole, output=None, workers=0, device="cpu", precision="fp32")
    assert report.num_images == len(rows) and report.data["split"] == "all"
    split = ["test" if i % 3 == 0 else "train" for i in range(len(rows))]
    by_row = write_csv(tmp_path / "split.csv", ["path", "label", "split"],
                       [[p, c, s] for (p, c), s in zip(rows, split)])
    report = evaluate(tiny_model_dir, by_row, output=None, workers=0, device="cpu", precision="fp32")
    assert report.num_images == split.count("test") and report.data["split"] == "test"

"""The run folder's format: RunFolder checks, creates, reads and writes it, and is the only code that names its
files."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from vit_finetune.errors import VitftError
from vit_finetune.run_folder import RunFolder

PACKAGE = Path(__file__).resolve().parents[1] / "vit_finetune"
RUN_FILES = {"train_config.json", "metrics.csv", "curves.png", "report.json", "checkpoint.pt", "last", "mlruns"}


def test_a_new_run_replaces_only_a_run_folder_and_moves_it_aside(tmp_path):
    folder = RunFolder(tmp_path / "run")
    folder.check_new(overwrite=False)  # absent: fine
    assert folder.start() is None and folder.path.is_dir()
    folder.write_train_config({"data": "images", "epochs": 3})
    with pytest.raises(VitftError, match="already exists; pass --overwrite to replace it, or --resume"):
        folder.check_new(overwrite=False)
    folder.check_new(overwrite=True)
    replaced = folder.start()
    assert json.loads((replaced / "train_config.json").read_text())["epochs"] == 3
    assert folder.is_empty() and folder.train_config() == {}
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    for overwrite in (True, False):  # no advice that cannot work: neither --overwrite nor --resume takes it
        with pytest.raises(VitftError, match=r"notes already exists and is not a vitft run folder \(neither "
                                             r"--overwrite nor --resume applies to it\); pick another --output"):
            RunFolder(tmp_path / "notes").check_new(overwrite=overwrite)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"


def test_a_run_is_never_written_into_a_file_or_inside_its_data(tmp_path):
    (tmp_path / "afile.txt").write_text("x")
    for overwrite in (True, False):
        with pytest.raises(VitftError, match=r"--output .*afile.txt is a file, not a folder; pick another --output"):
            RunFolder(tmp_path / "afile.txt").check_new(overwrite)
    data = tmp_path / "data"
    (data / "cats").mkdir(parents=True)
    for inside in (data / "myrun", data, data / "cats" / "deeper"):
        with pytest.raises(VitftError, match=r"is inside --data .*: the run's files would be read as images"):
            RunFolder(inside).check_new(False, data)
    RunFolder(tmp_path / "elsewhere").check_new(False, data)
    (tmp_path / "link").symlink_to(data)  # the same folder by another name
    with pytest.raises(VitftError, match="is inside --data"):
        RunFolder(tmp_path / "link" / "run").check_new(False, data)


def test_metrics_and_options_round_trip(tmp_path):
    folder = RunFolder(tmp_path)
    folder.write_metrics([{"epoch": 1, "train_loss": 0.5, "val_top1": 0.75, "ema": True}])  # ema: not a column
    [row] = folder.read_metrics()
    assert (row["epoch"], row["train_loss"], row["val_top1"], row["val_loss"]) == ("1", "0.5", "0.75", "")
    assert "ema" not in row
    folder.write_train_config({"data": "x"})
    assert folder.train_config() == {"data": "x"} and folder.is_run()


def test_a_missing_or_foreign_checkpoint_and_a_broken_config_are_reported(tmp_path, caplog):
    folder = RunFolder(tmp_path)
    with pytest.raises(VitftError, match=r"has no last/checkpoint.pt to resume from; is it a vitft run folder\?"):
        folder.read_checkpoint()
    folder.checkpoint_file.parent.mkdir()
    folder.checkpoint_file.write_bytes(b"not a checkpoint")
    with pytest.raises(VitftError, match="cannot read .* as a checkpoint of tensors and plain values"):
        folder.read_checkpoint()
    folder.model_config_file.write_text("{broken")
    assert folder.vitft_info() == {"config": {}, "train": {}, "data": {}, "best": {}}
    assert "cannot read it" in caplog.text
    with pytest.raises(VitftError, match="run folder .* not found"):
        RunFolder(tmp_path / "absent").require_model()


def test_only_run_folder_names_the_run_folder_files():
    """Every other module reads and writes a run folder through RunFolder: none spells its file names."""
    naming = {}
    for path in PACKAGE.rglob("*.py"):
        names = {node.value for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Constant) and node.value in RUN_FILES}
        if names:
            naming[path.relative_to(PACKAGE).as_posix()] = names
    assert list(naming) == ["run_folder.py"], naming

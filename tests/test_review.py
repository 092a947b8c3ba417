"""Regression tests for defects found by the review of the round's changes (odd names, file modes)."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from conftest import TINY
from PIL import Image

from vit_finetune import create_model, load_model, save_pretrained

NOT_UTF8 = os.fsdecode(b"caf\xe9 run")  # a folder name with a Latin-1 byte, as Linux hands it to Python


def _tiny(classes=("a", "b")):
    model = create_model("vit_tiny_patch16_224", num_classes=len(classes), **TINY)
    model.pretrained_cfg["label_names"] = list(classes)
    return model


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_saved_weights_get_the_umasks_mode_not_a_private_one(tmp_path):
    folder = save_pretrained(_tiny(), tmp_path / "model")
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o666 & ~_umask(), name


def test_weights_load_from_a_folder_whose_name_is_not_utf8(tmp_path):
    model = _tiny()
    folder = save_pretrained(model, tmp_path / NOT_UTF8)
    loaded = load_model(str(folder))
    for key, value in model.state_dict().items():
        assert loaded.state_dict()[key].equal(value), key


def test_explain_writes_names_that_are_not_utf8(tmp_path):
    from vit_finetune.tasks.explain import explain

    images = tmp_path / NOT_UTF8
    images.mkdir()
    Image.fromarray(np.full((40, 40, 3), 128, np.uint8)).save(images / os.fsdecode(b"photo \xff.png"))
    model = _tiny(classes=(os.fsdecode(b"cl\xe9 a"), "b"))
    out = tmp_path / "explained"
    explain(model, str(images), output=str(out))
    page = (out / "index.html").read_text(encoding="utf-8")
    assert r"photo \xff.png" in page and r"cl\xe9 a" in page
    assert len(list(out.glob("*.png"))) == 1


def test_onnx_export_into_a_folder_whose_name_is_not_utf8(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vit_finetune.onnx_export import export_onnx

    export_onnx(_tiny(), tmp_path / NOT_UTF8, batch_sizes=(1,))
    assert (tmp_path / NOT_UTF8 / "model.onnx").stat().st_size > 0


def test_export_overwrite_never_replaces_files_of_a_folder_that_is_not_an_export(tmp_path):
    from vit_finetune import export
    from vit_finetune.errors import VitftError

    run = save_pretrained(_tiny(), tmp_path / "run")
    project = tmp_path / "project"  # `vitft export runs/x . --overwrite` typed in a project's root
    project.mkdir()
    (project / "README.md").write_text("my project")
    with pytest.raises(VitftError, match="no exported model"):
        export(run, project, overwrite=True)
    assert (project / "README.md").read_text() == "my project"
    assert sorted(p.name for p in project.iterdir()) == ["README.md"]
    out = export(run, tmp_path / "out")
    (out / "notes.txt").write_text("kept")
    export(run, out, overwrite=True)  # an earlier export is replaced, files of the user's own are kept
    assert (out / "notes.txt").read_text() == "kept"

"""The one reading of a model reference, and the errors each caller gives for each kind."""
from __future__ import annotations

from pathlib import Path

import pytest

from vit_finetune import VitftError
from vit_finetune.hub.card import base_model, is_local_path, public_weights
from vit_finetune.tasks.inference import check_model_source
from vit_finetune.weights.refs import RefKind, parse_ref


def test_every_kind_of_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "w.pth").write_bytes(b"")
    kinds = {
        None: RefKind.NONE, False: RefKind.NONE, "": RefKind.NONE, "none": RefKind.NONE, " False ": RefKind.NONE,
        True: RefKind.DEFAULT, "true": RefKind.DEFAULT,
        "hf-hub:org/repo@v2": RefKind.HUB, "local-dir:somewhere": RefKind.LOCAL_DIR,
        "run": RefKind.FOLDER, str(tmp_path / "run"): RefKind.FOLDER, "w.pth": RefKind.FILE,
        "weights/private.pth": RefKind.MISSING_PATH, "gone.safetensors": RefKind.MISSING_PATH,
        "~/nothing": RefKind.MISSING_PATH,
        "vit_b_16": RefKind.NAME, "vit_small_patch16_224.augreg_in21k": RefKind.NAME, "no_such_model": RefKind.NAME,
    }
    for value, kind in kinds.items():
        assert parse_ref(value).kind is kind, value
    hub = parse_ref("hf-hub:org/repo@v2")
    assert (hub.target, hub.revision, hub.is_model_folder, hub.is_local) == ("org/repo", "v2", True, False)
    assert parse_ref("local-dir:~/x").path == Path.home() / "x"
    assert parse_ref("vit_b_16").arch_tag == ("vit_base_patch16_224", "augreg2_in21k_ft_in1k")
    with pytest.raises(VitftError, match=r"unknown model 'no_such_model'.*`vitft models` lists the supported names"):
        parse_ref("no_such_model").arch_tag


def test_callers_read_references_alike(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    for private in ("run", "./x", "weights/private.pth", "local-dir:run"):
        assert is_local_path(private) and not public_weights(private), private
    for public in ("vit_b_16", "hf-hub:someone/my-vit", "none", None, True):
        assert public_weights(public) and not is_local_path(public), public
    assert not public_weights("no_such_model") and not public_weights("hf-hub:not a repo")
    assert base_model({"pretrained": "hf-hub:someone/my-vit@v2"}) == "someone/my-vit"
    assert base_model({"pretrained": True}) is None  # no model named: no lineage
    assert base_model({"pretrained": "run"}) is None
    with pytest.raises(VitftError, match="model no/such/run not found"):
        check_model_source("no/such/run", None, False)
    with pytest.raises(VitftError, match="add --pretrained"):
        check_model_source("vit_b_16", None, False)
    for fine in ("run", "hf-hub:org/repo", "local-dir:run"):
        check_model_source(fine, None, False)
    check_model_source("no/such.pth", "vit_b_16", True)  # --model with --pretrained: create_model reports

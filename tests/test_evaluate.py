"""vitft evaluate / predict on generated class images with a tiny model trained for a few steps."""
from __future__ import annotations

import csv
import json
import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CLASSES, TINY, invoke_cli, make_images, make_subset
from PIL import Image

from vit_finetune import create_model, save_pretrained
from vit_finetune.data.datasets import find_dataset
from vit_finetune.data.loaders import ImageDataset
from vit_finetune.data.transforms import build_transforms
from vit_finetune.errors import VitftError
from vit_finetune.tasks.evaluate import evaluate
from vit_finetune.tasks.predict import Prediction, predict
from vit_finetune.tasks.report import EvalReport

BOX_CHARS = "─│┃━┏┓┗┛┡┩╇╷╵"


invoke = invoke_cli  # `vitft ARGS`


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def run_dir(small_images, tmp_path_factory) -> Path:
    """A run-like folder (config.json with a 'vitft' key + model.safetensors) of a tiny model trained for 60 steps,
    so that its predictions vary from image to image."""
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=len(CLASSES), **TINY)
    model.pretrained_cfg["label_names"] = list(CLASSES)
    splits = find_dataset(small_images)
    ds = ImageDataset(splits.train + splits.val, build_transforms(model.pretrained_cfg, 32, train=False))
    x = torch.stack([ds[i][0] for i in range(len(ds))])
    y = torch.tensor(ds.labels)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(60):
        idx = torch.randint(len(x), (64,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_pretrained(model.eval(), tmp_path_factory.mktemp("run"), extra_config={"vitft": {"steps": 60}})


@pytest.fixture(scope="module")
def eval_data(class_images, tmp_path_factory) -> Path:
    """8 images per class, a single folder of class folders (evaluated whole). The last 2 of each class are images
    of the next class (mislabelled), so that the trained model makes mistakes to count."""
    data = make_subset(class_images, tmp_path_factory.mktemp("eval8"), 6)
    for i, name in enumerate(CLASSES):
        for image in sorted((class_images / CLASSES[(i + 1) % len(CLASSES)]).iterdir())[50:52]:
            (data / name / image.name).symlink_to(image)
    return data


@pytest.fixture(scope="module")
def cli_eval(run_dir, eval_data):
    """`vitft evaluate RUN --data DIR` once, output in the run folder (the default for a local folder)."""
    return invoke("evaluate", run_dir, "--data", eval_data, "--workers", 0, "--batch-size", 16, "--device", "cpu",
                  "--precision", "fp32")


def image_key(path) -> str:
    """class/file name: how a test names an image whatever the folder it was reached through."""
    return "/".join(Path(path).parts[-2:])


@pytest.fixture(scope="module")
def timm_reference(run_dir, eval_data) -> dict:
    """What evaluate must find, computed without vitft: the run folder loaded by timm.create_model('local-dir:'),
    each image through timm's own eval transform (resolve_model_data_config + create_transform, PIL), softmax on
    the CPU. 'tta': the mean of the softmax of the image and of its horizontal mirror (the model input flipped)."""
    import timm

    model = timm.create_model(f"local-dir:{run_dir}", pretrained=True).eval()
    assert type(model).__module__ == "timm.models.vision_transformer"
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)
    paths = sorted(eval_data.glob("*/*"))
    x = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    with torch.no_grad():
        plain = model(x).softmax(dim=-1)
        mirrored = model(x.flip(dims=[-1])).softmax(dim=-1)
    labels = torch.tensor([CLASSES.index(p.parent.name) for p in paths])
    return {"keys": [image_key(p) for p in paths], "labels": labels, "plain": plain, "tta": (plain + mirrored) / 2}


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_evaluate_writes_all_files_in_the_run_folder(cli_eval, run_dir):
    assert cli_eval.exit_code == 0, cli_eval.output
    for name in ("report.json", "predictions.csv", "confusion_matrix.png", "mistakes.png"):
        assert (run_dir / name).stat().st_size > 0
    for name in ("confusion_matrix.png", "mistakes.png"):
        with Image.open(run_dir / name) as im:
            assert im.format == "PNG" and min(im.size) > 100
    assert not list(run_dir.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_printed_and_saved_numbers_match_a_hand_count(cli_eval, run_dir, eval_data, timm_reference):
    """The predictions come from timm's own pipeline (timm_reference); every number is counted from them."""
    assert cli_eval.exit_code == 0, cli_eval.output
    rows = _read_csv(run_dir / "predictions.csv")
    report = json.loads((run_dir / "report.json").read_text())
    n = len(rows)
    assert n == 8 * len(CLASSES) == report["num_images"] == report["data"]["num_images"]
    expected = {key: (CLASSES[label], CLASSES[int(probs.argmax())]) for key, label, probs in zip(
        timm_reference["keys"], timm_reference["labels"], timm_reference["plain"])}
    assert {image_key(r["path"]): (r["true_label"], r["predicted_label"]) for r in rows} == expected
    assert len({predicted for _, predicted in expected.values()}) > 1  # the trained model does not predict a constant
    correct = int((timm_reference["plain"].argmax(dim=1) == timm_reference["labels"]).sum())
    assert 0 < correct < n and report["accuracy"] == pytest.approx(correct / n)
    assert 0 <= report["accuracy"] <= 1
    out = cli_eval.stdout
    assert re.search(r"top-1 accuracy\s+([\d.]+)%", out).group(1) == f"{100 * correct / n:.1f}"
    assert re.search(r"top-5 accuracy\s+[\d.]+%", out)  # 6 classes > 5
    assert not any(c in out for c in BOX_CHARS)  # piped: plain text
    support = Counter(r["true_label"] for r in rows)
    hits = Counter(r["true_label"] for r in rows if r["true_label"] == r["predicted_label"])
    for name in CLASSES:
        recall = hits[name] / support[name]
        assert report["per_class"][name]["support"] == support[name] == 8
        assert report["per_class"][name]["recall"] == pytest.approx(recall)
        line = next(ln.split() for ln in out.splitlines() if ln.split()[:1] == [name])
        assert line[2] == f"{recall:.3f}" and line[4] == str(support[name])  # class precision recall F1 support
    cm = np.array(report["confusion"])
    assert cm.shape == (6, 6) and cm.sum() == n and report["classes"] == CLASSES
    hand = Counter((r["true_label"], r["predicted_label"]) for r in rows)
    assert all(cm[i, j] == hand[(t, p)] for i, t in enumerate(CLASSES) for j, p in enumerate(CLASSES))
    assert report["macro_f1"] == pytest.approx(np.mean([report["per_class"][c]["f1"] for c in CLASSES]))
    assert report["f1_macro"] == report["macro_f1"]
    balanced = np.mean([report["per_class"][c]["recall"] for c in CLASSES])  # 8 images per class: top-1's value
    assert report["balanced_accuracy"] == pytest.approx(balanced)
    assert re.search(r"balanced accuracy\s+([\d.]+)%", out).group(1) == f"{100 * balanced:.1f}"
    assert report["model"]["source"] == str(run_dir) and report["model"]["architecture"] == "vit_tiny_patch16_224"
    assert report["data"]["layout"] == "single folder" and report["data"]["split"] == "all"
    pre = report["preprocessing"]
    assert pre["img_size"] == [32, 32] and pre["tta"] is False and len(pre["mean"]) == 3 and pre["crop_pct"] > 0
    assert report["loss"] > 0 and report["images_per_s"] > 0
    pairs = report["confused_pairs"]
    assert pairs == sorted(pairs, key=lambda p: -p["count"])
    assert all(p["count"] == hand[(p["true"], p["predicted"])] for p in pairs)


@pytest.mark.parametrize("tta", [False, True])
def test_evaluate_gives_timms_probabilities(run_dir, eval_data, timm_reference, tta):
    """Per image, the predicted label and its probability are timm's (1e-5), and so is the loss; with TTA they are
    the flip average's, which moves the probabilities by far more than the tolerance."""
    report = evaluate(str(run_dir), eval_data, tta=tta, workers=0, device="cpu", precision="fp32", output=None)
    probs, labels = timm_reference["tta" if tta else "plain"], timm_reference["labels"]
    assert (timm_reference["tta"] - timm_reference["plain"]).abs().max() > 1e-3  # 100x the tolerance
    rows = {image_key(p["path"]): p for p in report.predictions}
    assert sorted(rows) == timm_reference["keys"]
    for key, row_probs in zip(timm_reference["keys"], probs):
        assert rows[key]["predicted_label"] == CLASSES[int(row_probs.argmax())]
        assert rows[key]["confidence"] == pytest.approx(float(row_probs.max()), abs=1e-5, rel=0)
    assert report.loss == pytest.approx(float(-probs[torch.arange(len(labels)), labels].log().mean()), abs=1e-5)
    assert report.accuracy == pytest.approx(float((probs.argmax(dim=1) == labels).float().mean()))


def test_tta_and_another_resolution(run_dir, eval_data, tmp_path):
    result = invoke("evaluate", run_dir, "--data", eval_data, "--workers", 0, "--tta", "--img-size", 48,
                    "--device", "cpu", "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["preprocessing"]["img_size"] == [48, 48] and report["preprocessing"]["tta"] is True
    assert np.array(report["confusion"]).sum() == report["num_images"] == 48
    rows = {r["path"]: float(r["confidence"]) for r in _read_csv(tmp_path / "out" / "predictions.csv")}
    assert len(rows) == 48
    for tta in (True, False):  # the flag reaches the computation: --tta is the library's tta=True, not tta=False
        library = evaluate(str(run_dir), eval_data, tta=tta, img_size=48, workers=0, device="cpu",
                           output=None).predictions
        differences = [abs(rows[p["path"]] - p["confidence"]) for p in library]
        assert max(differences) <= 1e-6 if tta else max(differences) > 1e-4  # the CSV rounds to 6 decimals


def test_library_evaluate_on_a_built_model(run_dir, eval_data, cli_eval, tmp_path):
    from vit_finetune import load_model

    model = load_model(str(run_dir))
    report = evaluate(model, eval_data, workers=0, device="cpu", output=None)
    assert isinstance(report, EvalReport) and report.output is None  # no output: nothing written
    saved = json.loads((run_dir / "report.json").read_text())
    assert report.accuracy == pytest.approx(saved["accuracy"])
    assert report.confusion.tolist() == saved["confusion"]
    assert report.to_dict()["per_class"] == saved["per_class"]
    assert json.loads(json.dumps(report.to_dict()))["classes"] == CLASSES


def test_model_classes_missing_from_the_data_are_reported(run_dir, class_images, tmp_path):
    data = make_subset(class_images, tmp_path / "two", 4, classes=["forest", "sea"])
    report = evaluate(str(run_dir), data, workers=0, output=None)
    assert report.num_images == 8
    assert report.absent_classes == ["buildings", "glacier", "mountain", "street"]
    assert report.per_class["glacier"]["support"] == 0 and report.per_class["glacier"]["recall"] is None
    assert report.confusion.sum() == 8


def test_unknown_data_class_is_a_clear_error(run_dir, class_images, tmp_path):
    data = make_subset(class_images, tmp_path / "lava", 3, classes=["forest"])
    (data / "lava").mkdir()
    for image in sorted((class_images / "sea").iterdir())[:3]:
        (data / "lava" / image.name).symlink_to(image)
    result = invoke("evaluate", run_dir, "--data", data, "--workers", 0, "--output", tmp_path / "out")
    assert result.exit_code == 1
    assert "'lava'" in result.output and "not known to the model" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_model_without_label_names(eval_data, class_images, tmp_path):
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=6, **TINY)
    assert "label_names" not in model.pretrained_cfg
    report = evaluate(model, eval_data, workers=0, output=None)  # 6 outputs, 6 classes: the data's names are used
    assert report.classes == CLASSES and report.model["label_names_from"] == "data"
    with pytest.raises(VitftError, match="no label names"):
        evaluate(model, make_subset(class_images, tmp_path / "two", 2, classes=["forest", "sea"]), workers=0,
                 output=None)


def test_split_selection(run_dir, class_images, tmp_path):
    root = tmp_path / "splits"
    for split, offset in (("train", 0), ("val", 2), ("test", 4)):
        for name in CLASSES:
            (root / split / name).mkdir(parents=True)
            for image in sorted((class_images / name).iterdir())[offset:offset + 2]:
                (root / split / name / image.name).symlink_to(image)
    report = evaluate(str(run_dir), root, workers=0, output=None)
    assert report.data["split"] == "test" and all("/test/" in p["path"] for p in report.predictions)
    assert evaluate(str(run_dir), root, split="val", workers=0, output=None).data["split"] == "val"
    with pytest.raises(VitftError, match="unknown split"):
        evaluate(str(run_dir), root, split="dev", workers=0, output=None)


@pytest.fixture
def messy_folder(class_images, tmp_path) -> Path:
    """Kaggle's seg_pred/seg_pred layout: 6 images, a truncated JPEG, an empty file and a text file."""
    folder = tmp_path / "seg_pred" / "seg_pred"
    folder.mkdir(parents=True)
    for name in CLASSES:
        image = sorted((class_images / name).iterdir())[20]
        (folder / f"{name}_{image.name}").symlink_to(image)
    whole = (sorted((class_images / "sea").iterdir())[21]).read_bytes()
    (folder / "truncated.jpg").write_bytes(whole[: len(whole) // 3])
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is not a picture\n")
    return tmp_path


def test_predict_csv_to_stdout_with_broken_files(run_dir, messy_folder):
    result = invoke("predict", run_dir, messy_folder, "--workers", 0, "--top-k", 2)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(result.stdout.splitlines()))
    assert len(rows) == 9
    assert list(rows[0]) == ["path", "label_1", "prob_1", "label_2", "prob_2", "error"]
    good = [r for r in rows if not r["error"]]
    bad = {Path(r["path"]).name: r for r in rows if r["error"]}
    assert len(good) == 6 and set(bad) == {"truncated.jpg", "empty.jpg", "notes.jpg"}
    assert all(r["label_1"] == "" for r in bad.values())
    assert "decoded" in bad["truncated.jpg"]["error"] and bad["empty.jpg"]["error"] == "empty file"
    for r in good:
        assert r["label_1"] in CLASSES and r["label_2"] in CLASSES and r["label_1"] != r["label_2"]
        assert 1 >= float(r["prob_1"]) >= float(r["prob_2"]) > 0
    assert "3 of 9 file(s) could not be read" in result.stderr


def test_predict_jsonl_file_with_workers(run_dir, messy_folder, tmp_path):
    out = tmp_path / "preds.jsonl"  # format from the suffix; a worker process decodes (and flags the truncated file)
    result = invoke("predict", run_dir, messy_folder, "--workers", 1, "--output", out)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9
    good = [r for r in rows if "error" not in r]
    assert len(good) == 6 and all(len(r["labels"]) == 3 and len(r["probs"]) == 3 for r in good)
    assert sorted(Path(r["path"]).name for r in rows if "error" in r) == ["empty.jpg", "notes.jpg", "truncated.jpg"]
    assert "wrote 6 prediction(s)" in result.stderr


def test_library_predict(run_dir, messy_folder, eval_data, cli_eval):
    rows = list(predict(str(run_dir), [messy_folder / "seg_pred"], top_k=10, workers=0, batch_size=4, device="cpu"))
    assert all(isinstance(r, Prediction) for r in rows) and len(rows) == 9
    assert [r.path for r in rows] == sorted(r.path for r in rows)
    good = [r for r in rows if r.error is None]
    assert len(good) == 6 and all(len(r.labels) == 6 and sum(r.probs) == pytest.approx(1, abs=1e-4) for r in good)
    # the same images get the same top-1 label and confidence as in evaluate's predictions.csv
    evaluated = {r["path"]: r for r in _read_csv(run_dir / "predictions.csv")}
    predicted = {r.path: r for r in predict(str(run_dir), str(eval_data), workers=0, device="cpu", precision="fp32")}
    assert set(predicted) == set(evaluated)
    for path, r in predicted.items():
        assert r.label == evaluated[path]["predicted_label"]
        assert r.probs[0] == pytest.approx(float(evaluated[path]["confidence"]), abs=1e-5)


def test_predictions_say_what_they_are_and_can_be_listed(tiny_model_dir, tmp_path):
    """`vf.predict` printed as `<...Predictions object at 0x...>`: its repr says what it holds and how to get it."""
    images = make_images(tmp_path, {"x": 3}, size=32)
    predictions = predict(str(tiny_model_dir), [images], top_k=3, workers=0, device="cpu", threads=1)
    assert repr(predictions) == ("Predictions(3 image(s), top-3 of 6 classes: buildings, forest, glacier, mountain, "
                                 "sea, ...; iterate or list() it for Prediction rows)")
    rows = list(predictions)
    assert len(rows) == 3 and all(isinstance(r, Prediction) and len(r.labels) == 3 and r.label == r.labels[0]
                                  and r.error is None for r in rows)
    assert list(predictions) == []  # an iterator: listed once


def test_bare_weights_file_with_model_arch(eval_data, tmp_path):
    """A .safetensors file has no config: --model names the arch, the head size comes from the file, and the data's
    class names are used (with a warning) since the counts match."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=6)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "w.safetensors"))
    result = invoke("evaluate", tmp_path / "w.safetensors", "--model", "vit_tiny_patch16_224", "--img-size", 32,
                    "--data", eval_data, "--workers", 0, "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "no label names" in result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"]["label_names_from"] == "data" and report["model"]["num_classes"] == 6
    assert report["preprocessing"]["img_size"] == [32, 32] and report["classes"] == CLASSES


def test_timm_name_needs_pretrained_flag(eval_data):
    result = invoke("evaluate", "vit_tiny_patch16_224", "--data", eval_data)
    assert result.exit_code == 1 and "--pretrained" in result.output and "Traceback" not in result.output
    assert "not found" in invoke("predict", "no/such/run", eval_data).output


# ---- names that are not UTF-8, worker errors, the run's own split ---------------------------------------------
def test_names_that_are_not_utf8_are_written_escaped(run_dir, class_images, tmp_path):
    """Linux file names are bytes: b'caf\\xe9' is not UTF-8 and reaches Python as 'caf\\udce9'. evaluate, predict
    --output (CSV and JSONL) and predict to stdout write such names as \\xe9 and never fail on one."""
    import os

    data = tmp_path / os.fsdecode(b"d\xe9j\xe0")
    for name in CLASSES:
        (data / name).mkdir(parents=True)
        for i, image in enumerate(sorted((class_images / name).iterdir())[:2]):
            (data / name / os.fsdecode(b"caf\xe9_%d.jpg" % i)).symlink_to(image)
    result = invoke("evaluate", run_dir, "--data", data, "--workers", 0, "--output", tmp_path / "eval")
    assert result.exit_code == 0, result.output
    csv_text = (tmp_path / "eval" / "predictions.csv").read_bytes().decode("utf-8")  # strict: valid UTF-8
    assert csv_text.count("caf\\xe9_") == 12 and "d\\xe9j\\xe0" in csv_text
    report = json.loads((tmp_path / "eval" / "report.json").read_bytes().decode("utf-8"))
    assert report["data"]["root"].endswith("d\\xe9j\\xe0") and report["num_images"] == 12
    assert (tmp_path / "eval" / "mistakes.png").stat().st_size > 0

    for out in (tmp_path / "p.csv", tmp_path / "p.jsonl"):
        result = invoke("predict", run_dir, data, "--workers", 0, "--output", out)
        assert result.exit_code == 0, result.output
        text = out.read_bytes().decode("utf-8")
        assert text.count("caf\\\\xe9_" if out.suffix == ".jsonl" else "caf\\xe9_") == 12
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert all(r["path"].endswith((r"caf\xe9_0.jpg", r"caf\xe9_1.jpg")) and r["labels"] for r in rows)
    result = invoke("predict", run_dir, data, "--workers", 0)
    assert result.exit_code == 0 and result.stdout.count("caf\\xe9_") == 12


def test_a_worker_error_keeps_its_message(run_dir, tmp_path, class_images):
    """An error raised in a DataLoader worker reaches the rows with its own message, not torch's wrapper."""
    for i in range(2):
        whole = sorted((class_images / "sea").iterdir())[i].read_bytes()
        (tmp_path / f"cut{i}.jpg").write_bytes(whole[: len(whole) // 3])  # headers fine, pixels missing
    rows = list(predict(str(run_dir), tmp_path, workers=1))
    assert len(rows) == 2
    for row in rows:
        assert "none of the 2 images can be decoded" in row.error and "Caught" not in row.error, row.error


@pytest.fixture(scope="module")
def own_run(run_dir, eval_data, tmp_path_factory) -> Path:
    """The tiny model as a run trained on eval_data with an 75/25 split, seed 3."""
    import shutil

    run = tmp_path_factory.mktemp("own") / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("*.csv", "*.json*", "*.png"))
    shutil.copy(run_dir / "config.json", run / "config.json")
    config = json.loads((run / "config.json").read_text())
    config["vitft"] = {"train": {"data": str(eval_data), "val_split": 0.25, "seed": 3}}
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_a_run_is_evaluated_on_its_own_validation_split(own_run, eval_data, class_images, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vitft")
    report = evaluate(str(own_run), eval_data, workers=0, output=None)
    expected = find_dataset(eval_data, 0.25, 3).val
    assert report.data["split"] == "val" and "split 75/25 (seed 3)" in report.data["layout"]
    assert sorted(p["path"] for p in report.predictions) == sorted(str(p) for p, _ in expected)
    assert "the run's own split" in caplog.text and "seed 3" in caplog.text
    # another folder (the same images, linked again) is not the run's data: evaluated whole, as before
    other = make_subset(class_images, tmp_path / "other", 8)
    assert evaluate(str(own_run), other, workers=0, output=None).data["split"] == "all"
    # a run trained on a train/ + val/ layout: its val folder, whatever the run's val_split says
    make_subset(class_images, tmp_path / "tv" / "train", 2)
    make_subset(class_images, tmp_path / "tv" / "val", 1)
    config = json.loads((own_run / "config.json").read_text())
    config["vitft"]["train"]["data"] = str(tmp_path / "tv")
    (own_run / "config.json").write_text(json.dumps(config))
    try:
        assert evaluate(str(own_run), tmp_path / "tv", workers=0, output=None).data == {
            "root": str(tmp_path / "tv"), "split": "val", "layout": "train/ + val/", "num_images": 6, "num_skipped": 0}
    finally:
        config["vitft"]["train"]["data"] = str(eval_data)
        (own_run / "config.json").write_text(json.dumps(config))


def test_evaluate_val_split_option(own_run, eval_data, run_dir, tmp_path):
    result = invoke("evaluate", own_run, "--data", eval_data, "--workers", 0, "--val-split", 0.5, "--seed", 1,
                    "--output", tmp_path / "half")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "half" / "report.json").read_text())
    expected = find_dataset(eval_data, 0.5, 1).val
    assert report["data"]["split"] == "val" and report["num_images"] == len(expected) == 24
    # no run config: the whole folder
    assert evaluate(str(run_dir), eval_data, workers=0, output=None).data["split"] == "all"


def test_predict_fails_when_no_file_is_an_image(run_dir, tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.jpg").write_text("not an image")
    (junk / "b.png").write_bytes(b"")
    result = invoke("predict", run_dir, junk, "--workers", 0, "--output", tmp_path / "p.csv")
    assert result.exit_code == 1 and "none of the 2 file(s) could be read" in result.output
    assert (tmp_path / "p.csv").read_text().count("\n") == 3  # the header, then one error row per file


# ---- the library applies the command line's rules ---------------------------------------------------------------
def test_library_refuses_a_timm_name_without_pretrained_as_the_cli_does(eval_data, tmp_path):
    from vit_finetune import explain

    for run in (lambda m: evaluate(m, eval_data, output=None), lambda m: list(predict(m, eval_data)),
                lambda m: explain(m, eval_data)):
        with pytest.raises(VitftError, match=r"add --pretrained \(pretrained=True in Python\)"):
            run("vit_tiny_patch16_224")
        with pytest.raises(VitftError, match="model no/such/run not found"):
            run("no/such/run")
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_library_predict_output_writes_the_files_the_cli_writes(run_dir, messy_folder, tmp_path):
    for name in ("cli.csv", "cli.jsonl"):
        assert invoke("predict", run_dir, messy_folder, "--workers", 0, "--output", tmp_path / name).exit_code == 0
    rows = predict(str(run_dir), messy_folder, workers=0, output=tmp_path / "lib.csv")
    predict(str(run_dir), messy_folder, workers=0, output=str(tmp_path / "lib.jsonl"))
    assert (tmp_path / "lib.csv").read_bytes() == (tmp_path / "cli.csv").read_bytes()
    assert (tmp_path / "lib.jsonl").read_bytes() == (tmp_path / "cli.jsonl").read_bytes()
    written = [json.loads(line) for line in (tmp_path / "lib.jsonl").read_text().splitlines()]
    assert [r.to_dict() for r in rows] == written and len(written) == 9
    with pytest.raises(VitftError, match="unknown --format 'xml'; use csv or jsonl"):
        predict(str(run_dir), messy_folder, output=tmp_path / "p.xml", fmt="xml")


def test_library_evaluate_writes_to_the_cli_default_output(run_dir, eval_data, tmp_path, monkeypatch):
    import shutil

    from vit_finetune import load_model
    from vit_finetune.tasks.evaluate import default_output

    run = shutil.copytree(run_dir, tmp_path / "run", ignore=shutil.ignore_patterns("report.json", "*.csv", "*.png"))
    monkeypatch.chdir(tmp_path)
    report = evaluate(str(run), eval_data, workers=0)  # a local folder: its own folder
    assert report.output == run and (run / "report.json").is_file() and (run / "mistakes.png").is_file()
    correct = sum(p["true_label"] == p["predicted_label"] for p in report.predictions)
    assert report.accuracy == correct / report.num_images == json.loads((run / "report.json").read_text())["accuracy"]
    evaluate(load_model(str(run)), eval_data, workers=0)  # a built model: ./eval-<architecture>
    assert (tmp_path / "eval-vit_tiny_patch16_224" / "predictions.csv").is_file()
    assert default_output("hf-hub:someone/my vit@v2") == Path("eval-my-vit")
    assert default_output(str(run / "model.safetensors")) == Path("eval-model")


def test_report_metrics_are_exact_ratios_of_counts(tmp_path):
    from vit_finetune.tasks.report import classification_metrics

    y = np.arange(2158) % 7
    pred = np.where(np.arange(2158) < 827, y, (y + 1) % 7)  # 827 right of 2,158
    m = classification_metrics(y, pred, 1500, [f"c{i}" for i in range(7)])
    assert m["accuracy"] == 827 / 2158 != float(np.float32(827) / np.float32(2158))
    assert m["top5"] == 1500 / 2158 and m["confusion"].trace() == 827
    support = np.bincount(y)
    assert all(m["per_class"][f"c{i}"]["recall"] == np.diag(m["confusion"])[i] / support[i] for i in range(7))

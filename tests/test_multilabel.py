"""Multi-label classification: AP/F1/threshold math against hand computations, multi-hot targets, and a short run
on two-scene images made from real Intel photos through training, evaluate, predict and the model card."""
from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CLASSES, REPO, tiny_classifier

from vit_finetune.config import TrainConfig
from vit_finetune.data.datasets import find_dataset
from vit_finetune.data.images import load_rgb
from vit_finetune.data.loaders import ImageDataset, build_loader
from vit_finetune.data.transforms import build_transforms
from vit_finetune.engine.api import finetune
from vit_finetune.engine.objective import losses
from vit_finetune.errors import VitftError
from vit_finetune.tasks.evaluate import evaluate
from vit_finetune.tasks.multilabel import average_precision, best_thresholds, multilabel_metrics
from vit_finetune.tasks.predict import predict
from vit_finetune.weights.loading import create_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _script():
    spec = importlib.util.spec_from_file_location("make_multilabel", REPO / "scripts" / "make_multilabel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scores, positives, expected", [
    ([0.9, 0.8, 0.7, 0.6, 0.5], [1, 0, 1, 0, 1], (1 + 2 / 3 + 3 / 5) / 3),  # precision at each positive's rank
    ([0.9, 0.9, 0.5], [1, 0, 1], 0.5 * 0.5 + 0.5 * 2 / 3),  # a tie counts as one step: P 1/2 at R 1/2
    ([0.1, 0.2, 0.3], [0, 0, 1], 1.0),
    ([0.3, 0.2], [0, 0], None),  # no positive: undefined
])
def test_average_precision_matches_hand_computation(scores, positives, expected):
    ap = average_precision(np.array(scores), np.array(positives, dtype=bool))
    assert ap == pytest.approx(expected, abs=1e-12) if expected is not None else ap is None


def test_f1_and_thresholds_match_hand_computation():
    probs = np.array([[0.9, 0.2], [0.6, 0.7], [0.4, 0.8], [0.1, 0.3]])
    targets = np.array([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=float)
    m = multilabel_metrics(probs, targets, [0.5, 0.5], ["a", "b"])
    # a: tp 2, fp 0, fn 0 -> F1 1; b: tp 2, fp 0, fn 0 -> F1 1 at 0.5; at 0.75 b would miss one
    assert m["f1_macro"] == 1.0 and m["f1_micro"] == 1.0 and m["mAP"] == 1.0 and m["exact_match"] == 1.0
    m = multilabel_metrics(probs, targets, [0.5, 0.75], ["a", "b"])
    assert m["per_class"]["b"] == {"ap": 1.0, "precision": 1.0, "recall": 0.5, "f1": 2 / 3, "support": 2,
                                   "threshold": 0.75}
    assert m["f1_macro"] == pytest.approx((1 + 2 / 3) / 2) and m["f1_micro"] == pytest.approx(2 * 3 / (2 * 3 + 1))
    # best F1: a between 0.6 (lowest positive) and 0.4; b between 0.7 and 0.3
    assert best_thresholds(probs, targets) == pytest.approx([0.5, 0.5])
    assert best_thresholds(probs, np.zeros_like(targets)) == [0.5, 0.5]  # no positives: the default


def test_multi_hot_targets_batch_as_a_float_matrix(class_images):
    samples = [(p, (0, 2)) for p in sorted((class_images / "forest").glob("*.jpg"))[:3]]
    samples.append((sorted((class_images / "sea").glob("*.jpg"))[0], 1))  # one label: one-hot
    transform = build_transforms({}, (32, 32), train=False)
    loader = build_loader(ImageDataset(samples, transform, img_size=32, num_classes=3), 4, train=False, workers=0)
    _, targets = next(iter(loader))
    assert targets.dtype == torch.float32
    assert targets.tolist() == [[1, 0, 1]] * 3 + [[0, 1, 0]]


def test_multi_label_losses_are_refused_for_single_label_data():
    with pytest.raises(VitftError, match="--loss asl is a multi-label loss but every row of x has one label"):
        losses(TrainConfig(data="x", loss="asl"), 3, multi_label=False)
    with pytest.raises(VitftError, match="unknown --loss 'focal'; use auto, bce, asl"):
        losses(TrainConfig(data="x", loss="focal"), 3, multi_label=True)


@pytest.fixture(scope="module")
def two_scenes(intel_dir, tmp_path_factory) -> Path:
    """Two-scene images from real photos (scripts/make_multilabel.py): 96 to train on, 36 to test on."""
    script, out = _script(), tmp_path_factory.mktemp("two_scenes")
    train, test = script.split_photos(intel_dir, held_out=0.5, seed=0)
    small = lambda photos: {c: files[:12] for c, files in photos.items()}  # noqa: E731
    script.make_images(small(train), out, "train", 96, same=0.25, seed=0)
    script.make_images(small(test), out, "test", 36, same=0.25, seed=1)
    return out


def test_two_scene_images_are_labelled_with_both_scenes(two_scenes):
    with open(two_scenes / "train.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 96 and {len(r["labels"].split("|")) for r in rows} == {1, 2}
    single = sum(len(r["labels"].split("|")) == 1 for r in rows)
    assert 10 <= single <= 40  # about a quarter show one scene twice
    assert load_rgb(two_scenes / rows[0]["path"]).shape == (150, 150, 3)
    splits = find_dataset(two_scenes / "train.csv", val_split=0.25)
    assert splits.multi_label and splits.classes == CLASSES
    assert all(isinstance(label, tuple) for _, label in splits.train + splits.val)


@pytest.fixture(scope="module")
def multilabel_run(two_scenes, tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ml") / "run"
    finetune(data=str(two_scenes / "train.csv"), pretrained=str(tiny_model_dir), output=str(out), epochs=2,
             batch_size=24, val_split=0.25, lr=0.02, mixup=0.2, warmup_epochs=0, workers=0, quiet=True, device="cpu",
             precision="fp32")
    return out


def test_thresholds_are_the_best_f1_ones_on_the_validation_images_and_saved(multilabel_run, two_scenes):
    config = json.loads((multilabel_run / "config.json").read_text())
    assert config["multi_label"] is True and config["label_names"] == CLASSES
    assert "val_mAP" in config["vitft"]["best"]
    model = create_model(f"local-dir:{multilabel_run}", pretrained=True).eval()
    assert model.pretrained_cfg["thresholds"] == config["thresholds"]
    val = find_dataset(two_scenes / "train.csv", val_split=0.25).val
    transform = build_transforms(model.pretrained_cfg, tuple(model.patch_embed.img_size), train=False)
    with torch.no_grad():
        probs = model(torch.stack([transform(image=load_rgb(p))["image"] for p, _ in val])).sigmoid().numpy()
    targets = np.zeros((len(val), len(CLASSES)))
    for row, (_, label) in enumerate(val):
        targets[row, list(label)] = 1
    assert config["thresholds"] == pytest.approx(best_thresholds(probs, targets), abs=1e-5)
    with open(multilabel_run / "metrics.csv") as f:
        assert all(float(r["val_mAP"]) > 0 for r in csv.DictReader(f))


def test_evaluate_writes_the_multi_label_report(multilabel_run, two_scenes):
    report = evaluate(multilabel_run, two_scenes / "test.csv", workers=0, device="cpu", precision="fp32")
    saved = json.loads((multilabel_run / "report.json").read_text())
    assert saved["task"] == "multi-label" and saved["num_images"] == 36
    assert saved["mAP"] == pytest.approx(report.mAP) and 0 < saved["mAP"] <= 1 and saved["f1_macro"] is not None
    assert set(saved["per_class"]) == set(CLASSES) and {"ap", "precision", "recall"} <= set(saved["per_class"]["sea"])
    assert saved["thresholds_from"] == "validation"
    assert (multilabel_run / "pr_curves.png").stat().st_size > 0
    with open(multilabel_run / "predictions.csv") as f:
        assert len(list(csv.DictReader(f))) == 36
    low = evaluate(multilabel_run, two_scenes / "test.csv", output=None, threshold=1e-6, workers=0, device="cpu")
    assert low.thresholds_from == "--threshold" and low.per_class["sea"]["recall"] == 1.0


def test_predict_gives_the_labels_over_their_thresholds(multilabel_run, two_scenes):
    images = sorted((two_scenes / "test").glob("*.jpg"))[:6]
    thresholds = json.loads((multilabel_run / "config.json").read_text())["thresholds"]
    for row in predict(multilabel_run, images, workers=0, device="cpu", precision="fp32"):
        assert all(p >= thresholds[CLASSES.index(label)] for label, p in zip(row.labels, row.probs))
        assert row.probs == sorted(row.probs, reverse=True)
    everything = list(predict(multilabel_run, images, threshold=1e-6, workers=0, device="cpu"))
    assert all(sorted(row.labels) == CLASSES for row in everything)
    assert all(row.labels == [] for row in predict(multilabel_run, images, threshold=1 - 1e-9, workers=0,
                                                   device="cpu"))


def test_the_card_says_multi_label_and_applies_a_sigmoid(multilabel_run):
    from vit_finetune.hub.card import model_card

    card = model_card(multilabel_run)
    assert "A multi-label Vision Transformer image classifier" in card
    assert ".sigmoid()[0]" in card and 'json.load(f)["thresholds"]' in card and ".softmax(" not in card
    assert "Best validation mAP" in card


def test_explain_gives_a_multi_label_model_its_sigmoid_probabilities(class_images):
    from vit_finetune.tasks.explain import explain

    model = tiny_classifier(("a", "b", "c"))
    model.pretrained_cfg["multi_label"] = True
    with torch.no_grad():  # constant logits 3, 2, 1: sigmoids 0.95, 0.88, 0.73 (a softmax would give 0.67, 0.24, 0.09)
        model.head.weight.zero_()
        model.head.bias.copy_(torch.tensor([3.0, 2.0, 1.0]))
    image = sorted((class_images / "forest").glob("*.jpg"))[0]
    for method in ("rollout", "gradcam"):
        [result] = explain(model, image, method=method, device="cpu", precision="fp32")
        assert result.labels == ["a", "b", "c"]
        assert result.probs == pytest.approx(torch.tensor([3.0, 2.0, 1.0]).sigmoid().tolist(), abs=1e-6)


def test_evaluating_a_label_file_with_an_unknown_class_says_which_rows_to_remove(class_images, tmp_path):
    model = tiny_classifier(("forest", "sea"))
    model.pretrained_cfg["multi_label"] = True
    forest = sorted((class_images / "forest").glob("*.jpg"))[:2]
    (tmp_path / "test.csv").write_text(f"path,labels\n{forest[0]},forest\n{forest[1]},forest|lava\n")
    with pytest.raises(VitftError, match=r"class 'lava' in the data is not known to the model \(its classes: forest, "
                                         r"sea\); remove its images \(class folders, or label-file rows\) from"):
        evaluate(model, tmp_path / "test.csv", output=None, workers=0, device="cpu")

"""Imbalanced classes: the class-balanced sampler (frequencies, seeding, DDP shards), the class-weighted loss against
a hand computation, balanced accuracy and macro F1 from a confusion matrix, the start-up warnings, --balance errors."""
from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_images

from vit_finetune.config import TrainConfig
from vit_finetune.data.balance import ClassBalancedSampler, check_balance, class_weights, imbalance_warnings
from vit_finetune.data.loaders import ImageDataset
from vit_finetune.data.transforms import build_transforms
from vit_finetune.engine.api import finetune
from vit_finetune.engine.features import FeatureSet
from vit_finetune.engine.phases import capped_feature_subset
from vit_finetune.engine.trainer import Trainer
from vit_finetune.engine.weighted_loss import WeightedCrossEntropy
from vit_finetune.errors import VitftError
from vit_finetune.hub.card import hyperparameters
from vit_finetune.progress import ProgressBar
from vit_finetune.run_folder import RunFolder
from vit_finetune.tasks.evaluate import evaluate
from vit_finetune.tasks.report import classification_metrics, confusion_scores

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LABELS = [0] * 200 + [1] * 40 + [2] * 10  # 20:4:1
TINIEST = dict(epochs=1, batch_size=4, lr=0.02, workers=0, warmup_epochs=0, quiet=True, device="cpu", precision="fp32")


def _within_binomial_tolerance(counts: torch.Tensor, p: float, sigmas: float = 4.0) -> bool:
    """Each count of a multinomial draw within `sigmas` standard deviations of n * p (4 sigma: 6e-5 two-sided per
    class; the draws are seeded, so a pass is a pass every time)."""
    n = int(counts.sum())
    return bool(((counts - n * p).abs() <= sigmas * math.sqrt(n * p * (1 - p))).all())


@pytest.fixture(scope="module")
def imbalanced(tmp_path_factory):
    """30 buildings, 6 forest: 5:1."""
    return make_images(tmp_path_factory.mktemp("imbalanced"), {"buildings": 30, "forest": 6})


def test_balanced_sampler_draws_each_class_equally_often():
    labels = torch.tensor(LABELS)
    sampler = ClassBalancedSampler(LABELS, seed=0)
    drawn = []
    for epoch in range(40):  # 40 x 250 = 10,000 draws
        sampler.set_epoch(epoch)
        epoch_draw = torch.tensor(list(sampler))
        assert len(epoch_draw) == len(sampler) == 250
        assert len(set(epoch_draw.tolist())) == 250  # a repeat is numbered (index + k * 250): its own augmentation
        drawn.append(epoch_draw % 250)
    counts = torch.bincount(labels[torch.cat(drawn)], minlength=3)
    assert _within_binomial_tolerance(counts, 1 / 3), counts  # plain shuffling: 8000 / 1600 / 400
    by_class = torch.bincount(torch.cat(drawn)[labels[torch.cat(drawn)] == 2], minlength=250)[240:]
    assert (by_class > 0).all()  # every image of the smallest class is drawn, not a few of them


def test_balanced_sampler_is_seeded_by_seed_and_epoch():
    def draw(seed: int, epoch: int) -> list[int]:
        sampler = ClassBalancedSampler(LABELS, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert draw(0, 3) == draw(0, 3)  # a resumed epoch repeats its order
    assert draw(0, 3) != draw(0, 4) and draw(0, 3) != draw(1, 3)
    assert draw(1, 2) == draw(0, 3)  # seed + epoch, as DistributedSampler seeds its shuffle


@pytest.mark.parametrize("n", [250, 251])
def test_two_ranks_together_draw_what_one_process_draws(n):
    labels = LABELS[:n] if n <= len(LABELS) else LABELS + [2]
    one = ClassBalancedSampler(labels, seed=5)
    ranks = [ClassBalancedSampler(labels, seed=5, rank=r, world=2) for r in (0, 1)]
    for sampler in (one, *ranks):
        sampler.set_epoch(2)
    shards = [list(r) for r in ranks]
    assert len(shards[0]) == len(shards[1]) == math.ceil(n / 2)
    interleaved = [i for pair in zip(*shards) for i in pair]
    assert interleaved[:n] == list(one)  # step by step, the two halves make up one process's batch
    assert interleaved[n:] == list(one)[:2 * math.ceil(n / 2) - n]  # padding repeats the start (DistributedSampler)


def test_a_repeated_image_is_the_same_image_augmented_anew(class_images):
    samples = [(p, 0) for p in sorted((class_images / "forest").iterdir())[:3]]
    transform = build_transforms({"mean": (0.5,) * 3, "std": (0.5,) * 3}, (32, 32), train=True)
    dataset = ImageDataset(samples, transform, img_size=32)
    dataset.set_epoch(0, 1)
    first, repeat, again = dataset[1], dataset[1 + 3], dataset[1]
    assert first[1] == repeat[1] and torch.equal(first[0], again[0])  # same label; the same draw, the same crop
    assert not torch.equal(first[0], repeat[0])  # the repeat's crop is its own


def test_head_phase_draws_cached_features_balanced():
    features = FeatureSet(torch.randn(250, 4), torch.tensor(LABELS))
    batches = features.batches(50, torch.Generator().manual_seed(0), steps=200, balanced=True)
    counts = torch.bincount(torch.cat([y for _, y in batches]), minlength=3)
    assert counts.sum() == 10_000 and _within_binomial_tolerance(counts, 1 / 3), counts


class _Labelled(list):
    """A training set as capped_feature_subset reads it: its length and its labels."""

    @property
    def labels(self) -> list[int]:
        return list(self)


def test_capped_head_phase_caches_a_balanced_subset():
    """--max-steps-per-epoch caches only the images one capped epoch takes; under --balance sampler those are drawn
    balanced (30:3, 8 of them: each class about half), not uniformly (forest 0.7 in expectation, none 39% of the
    time), or the head phase's balanced draws would rest on one forest image or none."""
    train_set = _Labelled([0] * 30 + [1] * 3)
    forest = []
    for seed in range(20):
        cfg = TrainConfig(balance="sampler", seed=seed, batch_size=4, max_steps_per_epoch=2)
        trainer = SimpleNamespace(cfg=cfg, ddp=SimpleNamespace(rank=0, world=1), steps_per_epoch=2,
                                  train_set=train_set)
        subset = capped_feature_subset(trainer)
        assert len(subset) == len(set(subset)) == 8  # distinct images: each is cached once
        forest.append(sum(train_set[i] for i in subset))
    assert sum(forest) / len(forest) >= 2.0 and min(forest) >= 1, forest


def test_class_weights_are_inverse_frequency_with_mean_one_over_the_images():
    labels = [0] * 6 + [1] * 3 + [2]
    loss, sqrt = class_weights(labels, 4, "loss"), class_weights(labels, 4, "sqrt")
    # 1/n scaled so that sum(n_c * w_c) = 10 images: w = 10 / (3 * n); class 3 has no images
    torch.testing.assert_close(loss, torch.tensor([10 / 18, 10 / 9, 10 / 3, 0.0]))
    s = math.sqrt(6) + math.sqrt(3) + 1  # sum of n_c / sqrt(n_c)
    torch.testing.assert_close(sqrt, torch.tensor([10 / s / math.sqrt(6), 10 / s / math.sqrt(3), 10 / s, 0.0]))
    assert class_weights(labels, 4, "none") is None and class_weights(labels, 4, "sampler") is None


def _log_softmax(row: list[float]) -> list[float]:
    total = math.log(sum(math.exp(v) for v in row))
    return [v - total for v in row]


LOGITS = [[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 1.0, 3.0], [1.0, -2.0, 0.0]]


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_weighted_loss_equals_a_hand_computation(eps):
    weights = [10 / 18, 10 / 9, 10 / 3]
    loss = WeightedCrossEntropy(torch.tensor(weights), label_smoothing=eps)
    labels = [0, 1, 2, 0]
    hand = 0.0
    for row, y in zip(LOGITS, labels):
        target = [(1 - eps) * (c == y) + eps / 3 for c in range(3)]
        logp = _log_softmax(row)
        hand += sum(t * w for t, w in zip(target, weights)) * -sum(t * lp for t, lp in zip(target, logp)) / 4
    got = loss(torch.tensor(LOGITS), torch.tensor(labels))
    assert got.item() == pytest.approx(hand, rel=1e-6)
    if eps == 0:  # torch's weighted cross-entropy, summed, over the batch size (not over the summed weights)
        torch_sum = torch.nn.functional.cross_entropy(torch.tensor(LOGITS), torch.tensor(labels),
                                                      weight=torch.tensor(weights), reduction="sum")
        assert got.item() == pytest.approx(torch_sum.item() / 4, rel=1e-6)


def test_weighted_loss_on_mixup_targets_weights_each_image_by_its_mix():
    weights = [0.5, 1.0, 4.0]
    targets = [[0.7, 0.3, 0.0], [0.0, 0.2, 0.8], [0.1, 0.1, 0.8], [1.0, 0.0, 0.0]]
    hand = sum(sum(t * w for t, w in zip(target, weights)) * -sum(t * lp for t, lp in zip(target, _log_softmax(r)))
               for r, target in zip(LOGITS, targets)) / 4
    got = WeightedCrossEntropy(torch.tensor(weights))(torch.tensor(LOGITS), torch.tensor(targets))
    assert got.item() == pytest.approx(hand, rel=1e-6)


def test_balance_reaches_the_losses_and_the_samplers(imbalanced, tiny_model_dir, tmp_path):
    common = dict(TINIEST, data=str(imbalanced), pretrained=str(tiny_model_dir), val_split=0.2, freeze_backbone=True,
                  unfreeze_after=1, epochs=2, mixup=0.8)
    trainer = Trainer(TrainConfig(balance="sqrt", output=str(tmp_path / "sqrt"), **common), tmp_path / "sqrt")
    counts = torch.bincount(torch.tensor(trainer.train_set.labels))  # 24 buildings, 5 forest after the split
    expected = counts.sum() / counts.sqrt().sum() / counts.sqrt()
    for loss in (trainer.train_loss_fn, trainer.head_loss_fn):  # mixup's soft targets and the head phase's labels
        assert isinstance(loss, WeightedCrossEntropy)
        torch.testing.assert_close(loss.weights, expected.float())
    assert any("class balance: cross-entropy weighted by 1/sqrt(count)" in line for line in trainer.describe())

    trainer = Trainer(TrainConfig(balance="sampler", output=str(tmp_path / "s"), **common), tmp_path / "s")
    assert isinstance(trainer.train_loader.sampler, ClassBalancedSampler)
    steps = trainer.phase.steps(trainer, ProgressBar(enabled=False))  # the head phase, on cached features
    labels = torch.cat([y for _, y in steps.batches])
    # 5 of 29 images are forest; drawn balanced, the epoch's 28 draws hold 14 in expectation (sd 2.6)
    assert len(labels) == 28 and int((labels == 1).sum()) >= 8, labels


def test_a_balanced_run_resumes_where_it_would_have_gone(imbalanced, tiny_model_dir, tmp_path):
    lr = 0.02 * 4 / 512
    options = dict(TINIEST, data=str(imbalanced), pretrained=str(tiny_model_dir), min_lr=lr, scale=(1.0, 1.0),
                   ratio=(1.0, 1.0), hflip=0.0, max_steps_per_epoch=3, balance="sampler", val_split=0.2)
    finetune(output=str(tmp_path / "a"), **options)
    finetune(resume=tmp_path / "a", epochs=2)
    finetune(output=str(tmp_path / "b"), **dict(options, epochs=2))
    resumed, straight = RunFolder(tmp_path / "a").read_checkpoint(), RunFolder(tmp_path / "b").read_checkpoint()
    for key, value in straight["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, atol=1e-6, rtol=1e-5, msg=key)
    assert hyperparameters(RunFolder(tmp_path / "b").vitft_info()["train"])["balance"] == "sampler"  # the card's


def test_the_card_lists_balance_beside_folders_of_the_same_name(tmp_path, monkeypatch):
    """The card hides local paths; a choice such as `sampler` is no path, even where the current folder holds a
    folder of that name (a path option's bare name there, and any value written as a path, stay hidden)."""
    monkeypatch.chdir(tmp_path)
    for name in ("sampler", "adamw", "weights"):
        (tmp_path / name).mkdir()
    (tmp_path / "val.tar").touch()
    train = {"balance": "sampler", "opt": "adamw", "pretrained": "weights", "val_data": "val.tar",
             "lora_method": "./sampler"}
    assert hyperparameters(train) == {"balance": "sampler", "opt": "adamw"}


def test_start_warns_about_imbalance_and_tiny_classes(tiny_model_dir, tmp_path, caplog):
    data = tmp_path / "data"
    make_images(data / "train", {"buildings": 21, "forest": 2})
    make_images(data / "val", {"buildings": 3, "forest": 2})
    caplog.set_level("INFO", logger="vitft")
    finetune(data=str(data), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"), max_steps_per_epoch=1,
             **TINIEST)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("imbalanced classes: buildings has 21 training images, 10x forest's 2" in w and "--balance sampler"
               in w for w in warnings), warnings
    assert any("fewer than 10 training images: forest (2)" in w and "--balance" in w for w in warnings), warnings
    assert any("buildings 21/3, forest 2/2" in r.getMessage() for r in caplog.records)  # the counts, as before
    # validation's balanced accuracy and macro F1 (metrics.csv) are evaluate's on the same images
    with open(tmp_path / "run" / "metrics.csv") as f:
        row = next(csv.DictReader(f))
    report = evaluate(str(tmp_path / "run"), str(data), split="val", workers=0, device="cpu", precision="fp32",
                      output=None)
    assert float(row["val_balanced_accuracy"]) == round(report.balanced_accuracy, 5)
    assert float(row["val_f1_macro"]) == round(report.macro_f1, 5)


def test_imbalance_warnings_thresholds():
    assert imbalance_warnings({"a": 100, "b": 10}, "none") == []  # 10x exactly, 10 images: no warning
    assert len(imbalance_warnings({"a": 101, "b": 10}, "none")) == 1
    assert imbalance_warnings({"a": 9, "b": 10}, "none")[0].startswith("class(es) with fewer than 10")
    balanced = imbalance_warnings({"a": 200, "b": 3}, "sampler")  # balancing is on: only the tiny class
    assert len(balanced) == 1 and "--balance sampler gives them their share, but cannot add variety" in balanced[0]



def test_multi_label_warnings_do_not_offer_the_balance_that_multi_label_refuses():
    warnings = imbalance_warnings({"a": 200, "b": 3}, "none", multi_label=True)
    assert len(warnings) == 2 and not any("--balance" in line for line in warnings)
    assert warnings[0].endswith("read per-class AP and macro F1, not mAP alone")

def test_a_class_without_training_images_is_not_promised_a_share():
    """A class that only the validation split holds (a dataset's ClassLabel names it): no --balance can help it."""
    for balance in ("none", "sampler"):
        warnings = imbalance_warnings({"a": 12, "b": 0, "c": 8}, balance)
        assert warnings[0].startswith("class(es) with no training images: b; the model cannot learn to predict them")
        assert "fewer than 10 training images: c (8);" in warnings[1] and "b (0)" not in warnings[1]


def test_bad_balance_is_one_line(imbalanced, tiny_model_dir, tmp_path):
    with pytest.raises(VitftError, match=r"unknown --balance 'sampel' \(did you mean sampler\?\); use one of none, "
                                         r"sampler, loss, sqrt"):
        finetune(data=str(imbalanced), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"),
                 balance="sampel", **TINIEST)
    assert not (tmp_path / "run").exists()  # refused before anything is written
    with pytest.raises(VitftError, match="--balance loss is for single-label data, and this data is multi-label"):
        check_balance("loss", multi_label=True)
    check_balance("none", multi_label=True)  # multi-label trains unbalanced
    with pytest.raises(VitftError, match="--balance sampler is for single-label data"):  # --multi-label, one label
        finetune(data=str(imbalanced), pretrained=str(tiny_model_dir), output=str(tmp_path / "ml"),
                 balance="sampler", multi_label=True, **TINIEST)


def test_balanced_accuracy_and_macro_f1_from_known_counts():
    confusion = np.array([[6, 2, 1, 1],
                          [1, 3, 0, 0],
                          [0, 1, 1, 0],
                          [0, 0, 0, 0]])  # class 3: no image (predicted once): left out of both means
    y, pred = np.nonzero(confusion)
    y, pred = np.repeat(y, confusion[y, pred]), np.repeat(pred, confusion[y, pred])
    metrics = classification_metrics(y, pred, None, ["a", "b", "c", "d"])
    assert (metrics["confusion"] == confusion).all()
    f1_macro = (2 * 6 / (10 + 7) + 2 * 3 / (4 + 6) + 2 * 1 / (2 + 2)) / 3  # 2 TP / (support + predicted)
    assert confusion_scores(confusion) == {"balanced_accuracy": pytest.approx((6 / 10 + 3 / 4 + 1 / 2) / 3, abs=1e-15),
                                           "f1_macro": pytest.approx(f1_macro, abs=1e-15)}
    assert metrics["macro_f1"] == pytest.approx(f1_macro, abs=1e-15) and metrics["accuracy"] == 10 / 16
    assert metrics["per_class"]["c"]["f1"] == 0.5 and metrics["per_class"]["d"]["f1"] is None

"""Partial fine-tuning (--train-blocks, issue 16): the top blocks train on the frozen lower blocks' cached token
activations, exactly as they would with the frozen blocks run at every step; generated images, a tiny 3-block ViT."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import timm
import torch
from conftest import TINY, make_images

from vit_finetune import create_model, save_pretrained
from vit_finetune.config import TrainConfig
from vit_finetune.engine import activations
from vit_finetune.engine.api import finetune
from vit_finetune.engine.phases import FineTuning, HeadOnFeatures, PartialOnActivations, trains
from vit_finetune.engine.trainer import Trainer
from vit_finetune.errors import VitftError
from vit_finetune.progress import ProgressBar
from vit_finetune.run_folder import RunFolder

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEPTH = 3
# no augmentation anywhere (feature view 1 is the eval transform), no stochastic depth, fp32: runs are exact.
# SGD, whose steps follow the gradients (Adam's first steps are about their signs), and one batch of all 16
# training images a step, so that the two paths see the same batches whatever order each draws
EXACT = dict(epochs=3, batch_size=16, opt="sgd", lr=5.0, warmup_epochs=0, drop_path=0.0, val_split=0.2, workers=0,
             quiet=True, device="cpu", precision="fp32", feature_views=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("two"), {"buildings": 10, "forest": 10})


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=2, **dict(TINY, depth=DEPTH))
    return save_pretrained(model, tmp_path_factory.mktemp("tiny3"))


def _train(out: Path, data: Path, weights: Path, eval_images: bool = False, **options) -> Trainer:
    """A finished run's trainer; `eval_images`: its training images go through the eval transform (unaugmented)."""
    cfg = TrainConfig(data=str(data), pretrained=str(weights), output=str(out), **{**EXACT, **options})
    trainer = Trainer(cfg, out)
    if eval_images:
        trainer.train_set.transform = trainer.eval_tf
    with ProgressBar(enabled=False) as progress:
        trainer.run(progress)
    return trainer


def _assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, atol=atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def cached_and_recomputed(data, weights, tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    cached = _train(root / "cached", data, weights, train_blocks=2)
    recomputed = _train(root / "recomputed", data, weights, eval_images=True, train_blocks=2, feature_views=0)
    return cached, recomputed


def test_the_model_splits_at_any_block():
    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=2, **dict(TINY, depth=DEPTH, reg_tokens=2)).eval()
    x = torch.randn(2, 3, 32, 32)
    for k in range(DEPTH + 1):
        torch.testing.assert_close(model.forward_from(model.forward_tokens(x, k), k), model(x), atol=1e-6, rtol=0)


def test_cached_activations_train_the_weights_that_running_the_frozen_blocks_does(cached_and_recomputed):
    cached, recomputed = cached_and_recomputed
    assert isinstance(cached.phase, PartialOnActivations) and type(recomputed.phase) is FineTuning
    _assert_same_weights(cached.model.state_dict(), recomputed.model.state_dict(), atol=1e-5)
    assert cached.state.rows[-1]["val_loss"] == pytest.approx(recomputed.state.rows[-1]["val_loss"], abs=1e-5)


def test_frozen_parameters_stay_bit_identical_and_out_of_the_optimizer(cached_and_recomputed, weights):
    cached, _ = cached_and_recomputed
    start = create_model(f"local-dir:{weights}", pretrained=True).state_dict()
    trained = cached.model.state_dict()
    frozen = [name for name in start if not trains(name, DEPTH, 2)]
    assert {"pos_embed", "cls_token", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight"} <= set(frozen)
    assert all(torch.equal(trained[name], start[name]) for name in frozen)
    for name in ("blocks.1.attn.qkv.weight", "blocks.2.mlp.fc2.weight", "norm.weight", "head.weight"):
        assert not torch.equal(trained[name], start[name]), name
    in_optimizer = {id(p) for group in cached.optimizer.param_groups for p in group["params"]}
    params = dict(cached.model.named_parameters())
    assert in_optimizer == {id(params[name]) for name in params if trains(name, DEPTH, 2)}
    # layer decay scales as in full fine-tuning: the head at full LR, the top block at 0.75, the next at 0.75^2
    scales = {name: group["lr_scale"] for group in cached.optimizer.param_groups for name in params
              if any(p is params[name] for p in group["params"])}
    assert [scales[name] for name in ("head.weight", "blocks.2.attn.qkv.weight", "blocks.1.attn.qkv.weight")] == \
        pytest.approx([1, 0.75, 0.75 ** 2])


def test_the_saved_model_loads_in_timm_with_equal_logits(cached_and_recomputed):
    cached, _ = cached_and_recomputed
    theirs = timm.create_model(f"local-dir:{cached.folder.path}", pretrained=True).eval()
    assert type(theirs).__module__ == "timm.models.vision_transformer"
    ours = create_model(f"local-dir:{cached.folder.path}", pretrained=True).eval()
    assert ours.state_dict().keys() == cached.model.state_dict().keys()  # complete: the frozen part too
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), atol=1e-5, rtol=0)


def test_zero_blocks_is_the_linear_probe_and_depth_is_full_fine_tuning(data, weights, tmp_path):
    quick = dict(epochs=2, opt="adamw", lr=0.02)
    probe = _train(tmp_path / "zero", data, weights, train_blocks=0, **quick)
    assert [type(phase) for _, phase in probe.plan.phases] == [HeadOnFeatures, FineTuning]
    assert probe.plan.head_epochs == 2  # every epoch: the fine-tuning phase never comes
    frozen = _train(tmp_path / "frozen", data, weights, freeze_backbone=True, **quick)
    _assert_same_weights(probe.model.state_dict(), frozen.model.state_dict(), atol=0)
    full = _train(tmp_path / "depth", data, weights, train_blocks=DEPTH, **quick)
    assert full.plan.phases == [(0, full.phase)] and full.phase.train_blocks is None
    everything = _train(tmp_path / "full", data, weights, **quick)
    _assert_same_weights(full.model.state_dict(), everything.model.state_dict(), atol=0)


@pytest.mark.parametrize("options, message", [
    (dict(train_blocks=DEPTH + 1), r"--train-blocks 4 is not a number of this model's 3 blocks; give 0 .* to 3"),
    (dict(train_blocks=-1), "--train-blocks must be 0"),
    (dict(train_blocks=1, freeze_backbone=True), "needs --unfreeze-after"),
    (dict(train_blocks=0, freeze_backbone=True, unfreeze_after=1), "nothing unfreezes"),
])
def test_a_bad_number_of_blocks_is_one_line(data, weights, tmp_path, options, message):
    with pytest.raises(VitftError, match=message):
        finetune(data=str(data), pretrained=str(weights), output=str(tmp_path / "run"), **{**EXACT, **options})
    assert not (tmp_path / "run").exists()


def test_a_memory_mapped_cache_trains_alike_and_is_deleted(data, weights, tmp_path, monkeypatch, caplog,
                                                           cached_and_recomputed):
    caplog.set_level(logging.INFO, logger="vitft")
    monkeypatch.setattr(activations, "available_memory", lambda: 0)  # nothing fits in memory: a file, on disk
    seen = []
    release = activations.ActivationBuffer.release

    def released(buffer):
        seen.append((buffer.file, Path(buffer.file).stat().st_size))
        release(buffer)

    monkeypatch.setattr(activations.ActivationBuffer, "release", released)
    on_file = _train(tmp_path / "file", data, weights, train_blocks=2)
    _assert_same_weights(on_file.model.state_dict(), cached_and_recomputed[0].model.state_dict(), atol=0)
    (path, size), = seen
    assert Path(path).parent == RunFolder(tmp_path / "file").scratch_dir
    assert size == 20 * (16 + 1) * 64 * 4  # 16 training + 4 validation images, 16 patches + the class token, fp32
    assert not Path(path).exists() and not Path(path).parent.exists()
    assert "0.08 MB float32 in a memory-mapped file" in caplog.text


def test_activations_that_fit_nowhere_are_recomputed(data, weights, tmp_path, monkeypatch, caplog,
                                                     cached_and_recomputed):
    caplog.set_level(logging.INFO, logger="vitft")
    monkeypatch.setattr(activations, "available_memory", lambda: 0)
    monkeypatch.setattr(RunFolder, "scratch_space", lambda self: 0)
    trainer = _train(tmp_path / "nowhere", data, weights, eval_images=True, train_blocks=2)
    assert "more than fits in memory or on disk: the frozen blocks run at every step instead" in caplog.text
    _assert_same_weights(trainer.model.state_dict(), cached_and_recomputed[1].model.state_dict(), atol=0)


def test_resume_equals_an_uninterrupted_run(data, weights, tmp_path):
    """2 epochs + a resume to 4 end where 4 straight epochs end: the cache (2 augmented views, drawn again on
    resume) and stochastic depth in the trained blocks come out the same. Constant LR: min_lr = the scaled LR."""
    lr = 0.02 * 8 / 512
    options = dict(data=str(data), pretrained=str(weights), train_blocks=1, feature_views=2, drop_path=0.2,
                   opt="adamw", lr=0.02, min_lr=lr, batch_size=8, val_split=0.2, warmup_epochs=0, workers=0,
                   quiet=True, device="cpu", precision="fp32")
    finetune(output=str(tmp_path / "a"), epochs=2, **options)
    finetune(resume=tmp_path / "a", epochs=4)
    finetune(output=str(tmp_path / "b"), epochs=4, **options)
    resumed, straight = RunFolder(tmp_path / "a").read_checkpoint(), RunFolder(tmp_path / "b").read_checkpoint()
    assert resumed["global_step"] == straight["global_step"] == 8
    _assert_same_weights(resumed["model"], straight["model"], atol=1e-6)


def test_head_phase_then_partial_fine_tuning_with_ema_and_a_step_cap(data, weights, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vitft")
    trainer = _train(tmp_path / "lp-ft", data, weights, freeze_backbone=True, unfreeze_after=1, train_blocks=1,
                     epochs=3, batch_size=4, opt="adamw", lr=0.02, ema=True, max_steps_per_epoch=2, mixup=0.2)
    assert [type(phase) for _, phase in trainer.plan.phases] == [HeadOnFeatures, PartialOnActivations]
    lines = trainer.describe()
    assert any("epochs 1-1" in line and "then the top 1 blocks train" in line for line in lines)
    assert any("the top 1 of 3 blocks, the final norm and the head train" in line and "in memory" in line
               for line in lines)
    assert "epoch 2: unfreezing the top 1 block" in caplog.text
    assert "activations for 8 of 16 training images (--max-steps-per-epoch 2" in caplog.text
    assert "mixup/cutmix mix images, not cached activations" in caplog.text
    assert len(trainer.state.rows) == 3 and trainer.state.global_step == 6
    ema = trainer.ema.module.state_dict()
    assert torch.equal(ema["blocks.0.attn.qkv.weight"], trainer.model.state_dict()["blocks.0.attn.qkv.weight"])
    assert not (tmp_path / "lp-ft" / "scratch").exists()

"""The phases of a run, as strategies: what trains, on which batches, and how often a checkpoint is written.

A run is a plan of phases (`PhasePlan`): full fine-tuning, or a head phase with the backbone frozen first (a
linear probe, or fastai's fine_tune when --unfreeze-after follows it with full fine-tuning). A phase says which
parameters train (`enter`), makes each epoch's `Steps` and validation logits, and throttles checkpoints; the head
phase on cached features also owns the cache. Partial fine-tuning on cached activations plugs in as a phase.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from ..config import TrainConfig
from ..data.loaders import build_loader, requested_batches
from ..progress import format_rate
from ..runtime import compute_context
from .distributed import all_sum, average_gradients
from .features import FeatureSet, extract_features
from .loop import Steps, timed

if TYPE_CHECKING:
    from ..progress import ProgressBar
    from .trainer import Trainer

log = logging.getLogger("vitft")

CHECKPOINT_INTERVAL_S = 60  # the most seconds of head-phase epochs on cached features left without a checkpoint
Logits = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (logits, targets) batches


def set_backbone_trainable(model: nn.Module, trainable: bool) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = trainable or name.startswith(("head.", "head_dist.", "fc_norm."))


class FineTuning:
    """Every parameter trains, on augmented images, through the DDP/compile wrapper."""

    backbone_trainable = True
    starts = "unfreezing the backbone"  # what the log says when a run enters this phase after another
    step_checkpoints = True  # whether --save-every applies (not to epochs of seconds)

    def enter(self, model: nn.Module) -> None:
        set_backbone_trainable(model, self.backbone_trainable)

    def leave(self) -> None:
        """The phase is over (the backbone trains next): drop what only it could use."""

    def steps(self, trainer: Trainer, progress: ProgressBar) -> Steps:
        return image_steps(trainer)

    def logits(self, trainer: Trainer, model: nn.Module) -> Logits:
        return image_logits(trainer, model)

    def wants_checkpoint(self, ends_phase: bool) -> bool:
        """Whether the epoch just done is checkpointed (an epoch on images takes long enough to be worth it)."""
        return True

    def checkpointed(self) -> None:
        """A checkpoint was just written."""


class FrozenBackbone(FineTuning):
    """The head trains, on freshly augmented images through the frozen backbone every epoch (--feature-views 0)."""

    backbone_trainable = False


class HeadOnFeatures(FrozenBackbone):
    """The head trains on the frozen backbone's pooled features, computed once on first use: epochs of seconds,
    so a checkpoint is written once a CHECKPOINT_INTERVAL_S at most, and when the phase ends."""

    step_checkpoints = False

    def __init__(self):
        self.features: Optional[tuple[FeatureSet, Optional[FeatureSet]]] = None  # (train, val) on this rank
        self._checkpointed = time.monotonic()  # when the last checkpoint was written (or the run started)

    def leave(self) -> None:
        self.features = None  # stale once the backbone trains

    def steps(self, trainer: Trainer, progress: ProgressBar) -> Steps:
        if self.features is None:
            self.features = cache_features(trainer, progress)
        return feature_steps(trainer, self.features[0])

    def logits(self, trainer: Trainer, model: nn.Module) -> Logits:
        if self.features is None or self.features[1] is None:  # a rank without validation images
            return
        for pooled, targets in self.features[1].batches(trainer.cfg.batch_size):
            with compute_context(trainer.device, trainer.precision):
                logits = getattr(model, "module", model).classify(pooled.to(trainer.device))
            yield logits, targets.to(trainer.device)

    def wants_checkpoint(self, ends_phase: bool) -> bool:
        # a crash loses those seconds, and the features are computed again on resume anyway
        return ends_phase or time.monotonic() - self._checkpointed > CHECKPOINT_INTERVAL_S

    def checkpointed(self) -> None:
        self._checkpointed = time.monotonic()


class PhasePlan:
    """The phases of a run by first epoch: fine-tuning alone, or a head phase then fine-tuning."""

    def __init__(self, cfg: TrainConfig):
        self.head_epochs = 0  # epochs with the backbone frozen
        phases: list[tuple[int, FineTuning]] = []
        if cfg.freeze_backbone:
            self.head_epochs = cfg.epochs if cfg.unfreeze_after is None else cfg.unfreeze_after
            phases.append((0, HeadOnFeatures() if cfg.feature_views > 0 else FrozenBackbone()))
        phases.append((self.head_epochs, FineTuning()))  # past a linear probe's end: validation on images
        self.phases = phases
        self.epochs = cfg.epochs  # the run's end: --epochs, or what a --time-budget planned

    def at(self, epoch: int) -> FineTuning:
        return next(phase for first, phase in reversed(self.phases) if epoch >= first)

    def resize(self, index: int, epochs: int) -> None:
        """Phase `index` lasts `epochs` epochs (a --time-budget plan): the phases after it and the run's end move."""
        end = self.phases[index + 1][0] if index + 1 < len(self.phases) else self.epochs
        shift = self.phases[index][0] + epochs - end
        self.phases = [(first + shift * (i > index), phase) for i, (first, phase) in enumerate(self.phases)]
        self.epochs += shift
        if self.head_epochs:
            self.head_epochs = self.phases[1][0]


# ---- batch sources --------------------------------------------------------------------------------
def image_steps(trainer: Trainer) -> Steps:
    """The training images through the wrapped model, with mixup, accumulation and DDP's gradient sync."""
    cfg, epoch, loader = trainer.cfg, trainer.state.epoch, trainer.train_loader
    trainer.net.train()
    # the epoch's order and augmentation depend on (seed, epoch) alone: a resume repeats them, and one process
    # takes DistributedSampler's permutation, whose interleaved shards make up the same global batches
    if trainer.ddp.enabled:
        loader.sampler.set_epoch(epoch)
    else:
        loader.sampler.generator.manual_seed(cfg.seed + epoch)
    trainer.train_set.set_epoch(cfg.seed, epoch)
    skip = trainer.state.step_in_epoch * cfg.accum_steps
    # run the loader to its end when uncapped, so that it reports the images it had to skip
    stop = trainer.batches_per_epoch if trainer.batches_per_epoch < len(loader) else None

    def forward(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        images = images.to(trainer.device, non_blocking=True)
        targets = targets.to(trainer.device, non_blocking=True)
        if trainer.mixup is not None:
            images, targets = trainer.mixup(images, targets)
        with compute_context(trainer.device, trainer.precision):
            return trainer.train_loss_fn(trainer.net(images), targets)

    no_sync = getattr(trainer.net, "no_sync", None) if trainer.ddp.enabled else None
    return Steps(timed(islice(loader, skip, stop), trainer.data_wait), forward, skip, cfg.accum_steps, no_sync)


def feature_steps(trainer: Trainer, features: FeatureSet) -> Steps:
    """Cached features through the head. One step takes a whole effective batch (features need no accumulation),
    so the schedule keeps its steps; the head runs outside DDP's wrapper, so its gradients are averaged here."""
    cfg, epoch = trainer.cfg, trainer.state.epoch
    trainer.model.train()
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
    batches = features.view(epoch).batches(cfg.batch_size * cfg.accum_steps, generator, trainer.steps_per_epoch)

    def forward(pooled: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with compute_context(trainer.device, trainer.precision):
            return trainer.head_loss_fn(trainer.model.classify(pooled.to(trainer.device)), targets.to(trainer.device))

    first = trainer.state.step_in_epoch  # steps done before the run was interrupted
    return Steps(islice(batches, first, None), forward, first,
                 sync_gradients=lambda: average_gradients(trainer.model, trainer.ddp))


def image_logits(trainer: Trainer, model: nn.Module) -> Logits:
    """The model's logits on this rank's validation images."""
    if trainer.val_set is None:  # a rank with no validation images (fewer than processes) adds nothing
        return
    for images, targets, _, keep in requested_batches(trainer.val_loader):  # keep: not replaced by another image
        if not keep.any():
            continue
        images, targets = images[keep].to(trainer.device), targets[keep].to(trainer.device)
        with compute_context(trainer.device, trainer.precision):
            logits = model(images)
        yield logits, targets


def cache_features(trainer: Trainer, progress: ProgressBar) -> tuple[FeatureSet, Optional[FeatureSet]]:
    """The frozen backbone's pooled features of this rank's training images (those the capped epochs use, with
    --max-steps-per-epoch) and validation slice (all of it: validation stays a real evaluation)."""
    cfg, start = trainer.cfg, time.perf_counter()
    views = cfg.feature_views
    dataset = trainer.train_set.with_transform(trainer.eval_tf if views == 1 else trainer.train_tf,
                                               return_index=True)
    subset = capped_feature_subset(trainer)
    loader = build_loader(dataset, cfg.batch_size, train=False, workers=cfg.workers, threads=cfg.threads,
                          device_type=trainer.device.type, distributed=trainer.ddp.enabled and subset is None,
                          seed=cfg.seed, indices=subset)
    train_images = views * len(loader.sampler)
    val_images = len(trainer.val_set) if trainer.val_set is not None else 0
    task = progress.add_task("pooled features", total=train_images + val_images, info="", unit=" images")
    train = extract_features(trainer.model, loader, trainer.device, trainer.precision, views,
                             lambda done, _: progress.update(task, completed=done), trainer.check_interrupt)
    val = None
    if trainer.val_set is not None:
        val = extract_features(trainer.model, trainer.val_loader, trainer.device, trainer.precision, 1,
                               lambda done, _: progress.update(task, completed=train_images + done),
                               trainer.check_interrupt)
    progress.remove_task(task)
    seconds = time.perf_counter() - start
    images = len(train) + (len(val) if val is not None else 0)
    counts = all_sum([images, seconds], trainer.ddp, trainer.device)
    if trainer.ddp.main:
        if subset is not None:
            log.info("features for %d of %d training images (--max-steps-per-epoch %d: what its steps use)",
                     len(subset) * trainer.ddp.world, len(trainer.train_set), cfg.max_steps_per_epoch)
        log.info("pooled features of %d images (%d view(s) of the training images, and the validation ones) "
                 "computed once in %.0fs (%s img/s); the head trains on them", counts[0], views, seconds,
                 format_rate(counts[0] / max(seconds, 1e-9)))
    return train, val


def capped_feature_subset(trainer: Trainer) -> Optional[list[int]]:
    """This rank's share of a seeded subset of the training images, as many as one capped epoch takes (each head
    epoch then draws all of them, shuffled); None when --max-steps-per-epoch leaves every image in use."""
    cfg, ddp = trainer.cfg, trainer.ddp
    needed = trainer.steps_per_epoch * cfg.batch_size * cfg.accum_steps * ddp.world
    if not cfg.max_steps_per_epoch or needed >= len(trainer.train_set):
        return None
    chosen = torch.randperm(len(trainer.train_set), generator=torch.Generator().manual_seed(cfg.seed))[:needed]
    return sorted(chosen[ddp.rank::ddp.world].tolist())

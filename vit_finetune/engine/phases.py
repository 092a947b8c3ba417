"""The phases of a run, as strategies: what trains, on which batches, and how often a checkpoint is written.

A run is a plan of phases (`PhasePlan`): full fine-tuning, or a head phase with the backbone frozen first (a
linear probe, or fastai's fine_tune when --unfreeze-after follows it with full fine-tuning), or partial fine-tuning
(--train-blocks N: the top N blocks, the final norm and the head), after a head phase or alone. A phase says which
parameters train (`enter`), makes each epoch's `Steps` and validation logits, and throttles checkpoints; the phases
on cached features (pooled, or the frozen blocks' token activations) also own their cache.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from ..config import TrainConfig
from ..data.balance import balanced_draw
from ..data.loaders import build_loader, requested_batches
from ..data.streams import stream_batches
from ..errors import VitftError
from ..progress import format_rate
from ..runtime import compute_context
from ..weights.adapters import adapter_keys, is_adapted
from .activations import RECOMPUTE, ActivationBuffer, plan_storage, row_shape
from .distributed import all_sum, average_gradients
from .features import FeatureSet, extract_features
from .loop import Steps, timed

if TYPE_CHECKING:
    from ..progress import ProgressBar
    from .trainer import Trainer

log = logging.getLogger("vitft")

CHECKPOINT_INTERVAL_S = 60  # the most seconds of head-phase epochs on cached features left without a checkpoint
Logits = Iterator[tuple[torch.Tensor, torch.Tensor]]  # (logits, targets) batches


HEAD = ("head.", "head_dist.", "fc_norm.")  # what reads pooled features: a linear probe's trainable parameters
TOP = ("norm.", "attn_pool.")  # what partial fine-tuning trains besides the top blocks and the head


def trains(name: str, depth: int, top_blocks: Optional[int]) -> bool:
    """Whether parameter `name` trains with the top `top_blocks` of `depth` blocks (None or depth: all of them;
    0: the head alone). The patch and position embeddings and the prefix tokens train only when everything does."""
    if top_blocks is None or top_blocks >= depth:
        return True
    if name.startswith(HEAD):
        return True
    if top_blocks == 0:
        return False
    return name.startswith(TOP) or (name.startswith("blocks.") and int(name.split(".")[1]) >= depth - top_blocks)


def set_trainable(model: nn.Module, top_blocks: Optional[int]) -> None:
    """requires_grad by trains(); with LoRA, of the adapter's parameters alone, never the frozen weights."""
    depth = len(model.blocks)
    adapter = set(adapter_keys(model)) if is_adapted(model) else None
    for name, param in model.named_parameters():
        param.requires_grad = trains(name, depth, top_blocks) and (adapter is None or name in adapter)


class FineTuning:
    """Every parameter trains (or, with `train_blocks`, the top blocks alone), on augmented images, through the
    DDP/compile wrapper: the frozen lower blocks then run at every step, without autograd."""

    backbone_trainable = True
    step_checkpoints = True  # whether --save-every applies (not to epochs of seconds)

    def __init__(self, train_blocks: Optional[int] = None):
        self.train_blocks = train_blocks  # None: every block

    @property
    def starts(self) -> str:
        """What the log says when a run enters this phase after another."""
        return "unfreezing the backbone" if self.train_blocks is None else f"unfreezing the top {self.train_blocks} " \
            f"block{'s' * (self.train_blocks != 1)}"

    def enter(self, model: nn.Module) -> None:
        set_trainable(model, self.train_blocks if self.backbone_trainable else 0)

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
        super().__init__()
        self.features: Optional[tuple[FeatureSet, Optional[FeatureSet]]] = None  # (train, val) on this rank
        self._checkpointed = time.monotonic()  # when the last checkpoint was written (or the run started)

    def leave(self) -> None:
        self.features = None  # stale once the backbone trains

    def steps(self, trainer: Trainer, progress: ProgressBar) -> Steps:
        if self.features is None:
            self.features = cache_features(trainer, progress)
        return feature_steps(trainer, self.features[0])

    def logits(self, trainer: Trainer, model: nn.Module) -> Logits:
        if self.features is not None:
            yield from cached_logits(trainer, self.features[1], getattr(model, "module", model).classify)

    def wants_checkpoint(self, ends_phase: bool) -> bool:
        # a crash loses those seconds, and the features are computed again on resume anyway
        return ends_phase or time.monotonic() - self._checkpointed > CHECKPOINT_INTERVAL_S

    def checkpointed(self) -> None:
        self._checkpointed = time.monotonic()


class PartialOnActivations(FineTuning):
    """The top `train_blocks` blocks, the final norm and the head train on the frozen lower blocks' token
    activations, computed once on first use (for --feature-views views of each training image, and the validation
    images): each step runs the top blocks alone. Where the activations fit neither in memory nor on disk, the
    frozen blocks run at every step instead (FineTuning with them frozen)."""

    def __init__(self, train_blocks: int):
        super().__init__(train_blocks)
        self.cache: Optional[tuple[ActivationBuffer, FeatureSet, Optional[FeatureSet]]] = None  # (buffer, train, val)
        self.recompute = False  # the activations did not fit

    def start(self, model: nn.Module) -> int:
        """The first trained block: activations are cached at its input."""
        return len(model.blocks) - self.train_blocks

    def leave(self) -> None:
        if self.cache is not None:
            buffer, self.cache = self.cache[0], None
            buffer.release()

    def steps(self, trainer: Trainer, progress: ProgressBar) -> Steps:
        if self.cache is None and not self.recompute:
            self.cache = cache_activations(trainer, progress, self.start(trainer.model))
            self.recompute = self.cache is None
        if self.cache is None:
            return image_steps(trainer)
        start, model = self.start(trainer.model), trainer.model
        return cached_steps(trainer, self.cache[1], lambda tokens: model.forward_from(tokens.float(), start),
                            trainer.cfg.batch_size, trainer.cfg.accum_steps)

    def logits(self, trainer: Trainer, model: nn.Module) -> Logits:
        if self.cache is None:  # recomputing, or asked after the run (the cache is gone)
            yield from image_logits(trainer, model)
            return
        start, model = self.start(trainer.model), getattr(model, "module", model)
        yield from cached_logits(trainer, self.cache[2], lambda tokens: model.forward_from(tokens.float(), start))


class PhasePlan:
    """The phases of a run by first epoch: fine-tuning (full, or the top --train-blocks) alone, or a head phase then
    fine-tuning; --train-blocks 0 is the head phase alone, as --freeze-backbone."""

    def __init__(self, cfg: TrainConfig, depth: int):
        if cfg.train_blocks is not None and not 0 <= cfg.train_blocks <= depth:
            raise VitftError(f"--train-blocks {cfg.train_blocks} is not a number of this model's {depth} blocks; "
                             f"give 0 (the head alone) to {depth} (everything)")
        # None: every block; the model's depth is full fine-tuning too
        self.train_blocks = cfg.train_blocks if cfg.train_blocks != depth else None
        self.head_epochs = 0  # epochs with the backbone frozen
        phases: list[tuple[int, FineTuning]] = []
        if cfg.freeze_backbone or self.train_blocks == 0:
            self.head_epochs = cfg.epochs if cfg.unfreeze_after is None else cfg.unfreeze_after
            phases.append((0, HeadOnFeatures() if cfg.feature_views > 0 else FrozenBackbone()))
        if self.train_blocks and cfg.feature_views > 0:
            phases.append((self.head_epochs, PartialOnActivations(self.train_blocks)))
        else:  # past a linear probe's end: validation on images
            phases.append((self.head_epochs, FineTuning(self.train_blocks or None)))
        self.phases = phases
        self.epochs = cfg.epochs  # the run's end: --epochs, or what a --time-budget planned

    def at(self, epoch: int) -> FineTuning:
        return next(phase for first, phase in reversed(self.phases) if epoch >= first)

    def freeze_for_the_run(self, model: nn.Module) -> None:
        """Freeze what no phase trains (the lower blocks under --train-blocks) before the optimizer is built, so
        that its groups (and weight decay) leave them out; what a later phase trains stays in them."""
        if self.train_blocks:
            set_trainable(model, self.train_blocks)

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
    skip = trainer.state.step_in_epoch * cfg.accum_steps
    if trainer.splits.streamed:  # passes over a stream (stream_data.py says what a resume reads again)
        batches, stop = stream_batches(loader, cfg.seed, epoch, trainer.batches_per_epoch), None
    else:
        # the epoch's order and augmentation depend on (seed, epoch) alone: a resume repeats them, and one process
        # takes DistributedSampler's permutation, whose interleaved shards make up the same global batches
        if hasattr(loader.sampler, "set_epoch"):  # DistributedSampler, ClassBalancedSampler: seeded by seed + epoch
            loader.sampler.set_epoch(epoch)
        else:
            loader.sampler.generator.manual_seed(cfg.seed + epoch)
        trainer.train_set.set_epoch(cfg.seed, epoch)
        # run the loader to its end when uncapped, so that it reports the images it had to skip
        batches, stop = loader, trainer.batches_per_epoch if trainer.batches_per_epoch < len(loader) else None

    def forward(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        images = images.to(trainer.device, non_blocking=True)
        targets = targets.to(trainer.device, non_blocking=True)
        if trainer.mixup is not None:
            images, targets = trainer.mixup(images, targets)
        with compute_context(trainer.device, trainer.precision):
            return trainer.train_loss_fn(trainer.net(images), targets)

    no_sync = getattr(trainer.net, "no_sync", None) if trainer.ddp.enabled else None
    return Steps(timed(islice(batches, skip, stop), trainer.data_wait), forward, skip, cfg.accum_steps, no_sync)


def feature_steps(trainer: Trainer, features: FeatureSet) -> Steps:
    """Cached features through the head. One step takes a whole effective batch (features need no accumulation),
    so the schedule keeps its steps."""
    cfg = trainer.cfg
    return cached_steps(trainer, features, trainer.model.classify, cfg.batch_size * cfg.accum_steps, 1)


def cached_steps(trainer: Trainer, features: FeatureSet, head, batch_size: int, accum_steps: int) -> Steps:
    """Cached rows through `head` (rows -> logits), `accum_steps` batches a step, in an order drawn from (seed,
    epoch) alone (a resume repeats it). No mixup: it mixes images. `head` runs outside DDP's wrapper, so the
    gradients are averaged here."""
    cfg, epoch = trainer.cfg, trainer.state.epoch
    trainer.model.train()
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
    batches = features.view(epoch).batches(batch_size, generator, trainer.steps_per_epoch * accum_steps,
                                           balanced=cfg.balance == "sampler")

    def forward(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with compute_context(trainer.device, trainer.precision):
            return trainer.head_loss_fn(head(rows.to(trainer.device, non_blocking=True)), targets.to(trainer.device))

    first = trainer.state.step_in_epoch * accum_steps  # batches done before the run was interrupted
    return Steps(islice(batches, first, None), forward, first, accum_steps,
                 sync_gradients=lambda: average_gradients(trainer.model, trainer.ddp))


def cached_logits(trainer: Trainer, features: Optional[FeatureSet], head) -> Logits:
    """`head`'s logits on this rank's cached validation rows (none on a rank without validation images)."""
    if features is None:
        return
    for rows, targets in features.batches(trainer.cfg.batch_size):
        with compute_context(trainer.device, trainer.precision):
            logits = head(rows.to(trainer.device))
        yield logits, targets.to(trainer.device)


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
    return cache_rows(trainer, progress, "pooled features", "the head trains on them")


def cache_activations(trainer: Trainer, progress: ProgressBar,
                      start: int) -> Optional[tuple[ActivationBuffer, FeatureSet, Optional[FeatureSet]]]:
    """The tokens that enter blocks[start], for the images cache_features would pool, stored as plan_storage says;
    None (on every rank) where they fit nowhere on some rank: the frozen blocks then run at every step."""
    ddp, model = trainer.ddp, trainer.model
    storage = plan_storage(cached_rows(trainer), row_shape(model), trainer.precision, trainer.folder, ddp.world)
    if all_sum([float(storage.where == RECOMPUTE)], ddp, trainer.device)[0]:
        if ddp.main:
            log.warning("activations of the frozen blocks: %s", storage.describe())
        return None
    buffer = ActivationBuffer(storage, trainer.folder, ddp.rank)
    if ddp.main and trainer.mixup is not None:
        log.warning("mixup/cutmix mix images, not cached activations: the top blocks train without them "
                    "(--feature-views 0 runs the frozen blocks at every step, with them)")
    trained = len(model.blocks) - start
    try:
        train, val = cache_rows(trainer, progress, "activations", f"the top {trained} block{'s' * (trained != 1)} "
                                f"train on them ({storage.describe()}{' per process' * ddp.enabled})",
                                lambda images: model.forward_tokens(images, start), buffer.tensor)
    except BaseException:
        buffer.release()
        raise
    return buffer, train, val


def cached_rows(trainer: Trainer) -> int:
    """The rows this rank caches: --feature-views views of its training images, and its validation images."""
    subset = capped_feature_subset(trainer)
    train = len(subset) if subset is not None else math.ceil(len(trainer.train_set) / trainer.ddp.world)
    return trainer.cfg.feature_views * train + (len(trainer.val_set) if trainer.val_set is not None else 0)


def cache_rows(trainer: Trainer, progress: ProgressBar, what: str, use: str, encode=None,
               into: Optional[torch.Tensor] = None) -> tuple[FeatureSet, Optional[FeatureSet]]:
    """`encode`'s rows (pooled features by default) of the training images and the validation slice, into `into`
    when given (training rows first). The pass draws from seeded generators of its own, not the run's random
    state: a resume, which runs it again where the run stopped, continues as the uninterrupted run does."""
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
    task = progress.add_task(what, total=train_images + val_images, info="", unit=" images")
    check_budget = trainer.budget.pass_check(what, train_images + val_images) if trainer.budget else None

    def shown(before: int):  # progress(done, total) of one of the two passes, `before` images done before it
        def show(done: int, _) -> None:
            progress.update(task, completed=before + done)
            if check_budget is not None:
                check_budget(before + done)
        return show

    train = extract_features(trainer.model, loader, trainer.device, trainer.precision, views, shown(0),
                             trainer.check_interrupt, encode, into)
    val = None
    if trainer.val_set is not None:
        val = extract_features(trainer.model, trainer.val_loader, trainer.device, trainer.precision, 1,
                               shown(train_images), trainer.check_interrupt, encode,
                               None if into is None else into[len(train):])
    progress.remove_task(task)
    seconds = time.perf_counter() - start
    images = len(train) + (len(val) if val is not None else 0)
    counts = all_sum([images, seconds], trainer.ddp, trainer.device)
    if trainer.ddp.main:
        if subset is not None:
            log.info("%s for %d of %d training images (--max-steps-per-epoch %d: what its steps use)", what,
                     len(subset) * trainer.ddp.world, len(trainer.train_set), cfg.max_steps_per_epoch)
        log.info("%s of %d images (%d view(s) of the training images, and the validation ones) computed once in "
                 "%.0fs (%s img/s); %s", what, counts[0], views, seconds, format_rate(counts[0] / max(seconds, 1e-9)),
                 use)
    return train, val


def capped_feature_subset(trainer: Trainer) -> Optional[list[int]]:
    """This rank's share of a seeded subset of the training images, as many as one capped epoch takes (each head
    epoch then draws all of them, shuffled); None when --max-steps-per-epoch leaves every image in use. Under
    --balance sampler the subset is drawn class-balanced too (without repeats), so that a small class is in it as
    a balanced epoch would draw it, not by the few of its images a uniform subset happens to hold."""
    cfg, ddp = trainer.cfg, trainer.ddp
    needed = trainer.steps_per_epoch * cfg.batch_size * cfg.accum_steps * ddp.world
    if not cfg.max_steps_per_epoch or needed >= len(trainer.train_set):
        return None
    generator = torch.Generator().manual_seed(cfg.seed)
    if cfg.balance == "sampler":
        chosen = balanced_draw(torch.as_tensor(trainer.train_set.labels), needed, generator, replacement=False)
    else:
        chosen = torch.randperm(len(trainer.train_set), generator=generator)[:needed]
    return sorted(chosen[ddp.rank::ddp.world].tolist())

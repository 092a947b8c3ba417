"""A run's data when it is streamed (--streaming, tar shards): the train and validation streams of this rank and
their loaders. An epoch is --steps-per-epoch steps (a stream has no length): image_steps cuts them out of
passes with data.streams.stream_batches.

Resume: a run stopped mid-epoch starts that epoch's passes again and reads (and drops) the batches it had
trained on, so it trains on the same images in the same order as an uninterrupted run, at the price of
reading those batches twice. Validation reads the whole validation split each epoch, split between the ranks
(each image once), in the source's order: keep it small enough to read every epoch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..data.loaders import build_loader
from ..data.streams import StreamDataset
from ..errors import VitftError

if TYPE_CHECKING:
    from .trainer import Trainer


def build_stream_data(trainer: Trainer) -> None:
    """Set the trainer's train/val sets and loaders and its steps per epoch from its streamed splits."""
    cfg, ddp, splits = trainer.cfg, trainer.ddp, trainer.splits
    if not cfg.steps_per_epoch:
        raise VitftError(f"{cfg.data} is read as a stream, which has no length: give --steps-per-epoch N (about "
                         f"the training images / (--batch-size x processes), {cfg.batch_size} x {ddp.world} here)")
    if (cfg.freeze_backbone or cfg.train_blocks is not None) and cfg.feature_views > 0:
        raise VitftError("cached features (--feature-views) need a list of images; with streamed data use "
                         "--feature-views 0, which runs the frozen backbone on the images every epoch")
    if cfg.balance != "none":
        raise VitftError(f"--balance {cfg.balance} needs the class counts of a list of images, which a stream does "
                         "not have; use --balance none, or --data without --streaming")
    targets = len(splits.classes) if trainer.multi_label else None  # multi-hot targets of this length
    trainer.train_set = StreamDataset(splits.train, trainer.train_tf, ddp.rank, ddp.world, "train", targets)
    trainer.val_set = StreamDataset(splits.val, trainer.eval_tf, ddp.rank, ddp.world, "val", targets)
    loader = dict(workers=cfg.workers, threads=cfg.threads, device_type=trainer.device.type, seed=cfg.seed)
    trainer.train_loader = build_loader(trainer.train_set, cfg.batch_size, train=True, **loader)
    trainer.val_loader = build_loader(trainer.val_set, cfg.batch_size, train=False, **loader)
    steps = cfg.steps_per_epoch if not cfg.max_steps_per_epoch else min(cfg.steps_per_epoch, cfg.max_steps_per_epoch)
    trainer.steps_per_epoch = steps
    trainer.batches_per_epoch = steps * cfg.accum_steps

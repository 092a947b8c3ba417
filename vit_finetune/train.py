"""The fine-tuning engine: one loop for CPU, one GPU or many (DDP under torchrun), resumable.

A run folder holds everything: the effective config (train_config.json), the best weights
(config.json + model.safetensors, loadable by timm and vitft), metrics.csv, curves.png and a
resumable checkpoint in last/ that is rewritten atomically at every epoch end, every
`save_every` steps, and on SIGINT/SIGTERM.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data.constants import DEFAULT_CROP_PCT

from .archs import get_arch
from .config import TrainConfig
from .data import DatasetSplits, ImageDataset, build_loader, build_transforms, find_dataset
from .errors import VitftError
from .evaluate import top_k_hits
from .features import FeatureSet, extract_features
from .files import atomic_write
from .progress import ProgressBar
from .refs import RefKind, parse_ref
from .runtime import check_precision, choose_precision, compute_context, model_widths, resolve_device
from .weights import create_model, describe_weights, save_pretrained

log = logging.getLogger("vitft")

CHECKPOINT = Path("last") / "checkpoint.pt"
CHECKPOINT_INTERVAL_S = 60  # the most seconds of head-phase epochs on cached features left without a checkpoint


@dataclass
class RunResult:
    run_dir: Path
    best_top1: float
    best_epoch: int
    epochs_done: int
    interrupted: bool
    metrics: list[dict]


# ---- distributed ----------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def _init_distributed(device_choice: str) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: join the group (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), resolve_device(device_choice)
    ddp = Dist(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_choice)
    if device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ddp, device


def _all_sum(values: list[float], ddp: Dist, device: torch.device) -> list[float]:
    if not ddp.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


# ---- building blocks ------------------------------------------------------------------------------
def build_model(cfg: TrainConfig, num_classes: int):
    """The model for a new run: weights from `cfg.pretrained`, head sized to the data."""
    overrides = dict(cfg.model_kwargs, drop_path_rate=cfg.drop_path)
    overrides.pop("num_classes", None)  # always the data's
    img_size = cfg.img_size or overrides.pop("img_size", None)
    pretrained = cfg.pretrained if cfg.pretrained is not None else _default_pretrained(cfg.model)
    if _scratch(cfg):
        name, weights = cfg.model or "vit_b_16", False
    else:
        name, weights = (cfg.model, pretrained) if cfg.model else (pretrained, True)
        if not cfg.model and parse_ref(pretrained).kind is RefKind.FILE:
            raise VitftError(f"--pretrained {pretrained} is a bare weights file: add --model ARCH")
    return create_model(name, pretrained=weights, num_classes=num_classes, img_size=img_size, **overrides)


def _scratch(cfg: TrainConfig) -> bool:
    return cfg.pretrained is not None and parse_ref(cfg.pretrained).kind is RefKind.NONE


def _default_pretrained(model: Optional[str]) -> str:
    """The weights a run uses when --pretrained is not given: the --model's own (its tag, else its
    architecture's default tag), or vit_b_16 when no model is named either."""
    if not model:
        return "vit_b_16"
    arch, tag = parse_ref(model).arch_tag
    tag = tag or get_arch(arch).default_tag
    if not tag:
        raise VitftError(f"{arch} has no pretrained weights; pass --pretrained none to train it from scratch, "
                         "or --pretrained with a weights file")
    return f"{arch}.{tag}"


def _default_run_dir(cfg: TrainConfig) -> Path:
    """runs/<date>-<model>, plus the overridden model args (or 'custom' when they are many): the name must not
    claim a stock architecture for a model with other depth, patch or input size."""
    name = Path((cfg.model or cfg.pretrained or "vit").replace("/", "_").replace(":", "_")).name
    overrides = {k: v for k, v in cfg.model_kwargs.items() if k != "num_classes"}
    if cfg.img_size:
        overrides["img_size"] = cfg.img_size
    if overrides:
        suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        plain = len(suffix) <= 40 and all(isinstance(v, (int, float, str)) for v in overrides.values())
        name += "-" + (suffix.replace("/", "_") if plain else "custom")
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{name}"


def _set_backbone_trainable(model: nn.Module, trainable: bool) -> None:
    for name, param in model.named_parameters():
        param.requires_grad = trainable or name.startswith(("head.", "head_dist.", "fc_norm."))


class Metrics:
    """metrics.csv and curves.png, rewritten atomically after every epoch (rank 0 only)."""

    FIELDS = ["epoch", "train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "seconds",
              "data_wait", "peak_mem_gb", "val_images"]

    def __init__(self, run_dir: Path, rows: list[dict]):
        self.path = run_dir / "metrics.csv"
        self.plot_path = run_dir / "curves.png"
        self.rows = rows

    def add(self, row: dict, plot: bool = True) -> None:
        self.rows.append(row)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write(self.path, lambda tmp: tmp.write_text(buf.getvalue()))
        if plot:
            self._plot()

    def _plot(self) -> None:
        from .plots import curves_figure, save_png

        save_png(curves_figure(self.rows), self.plot_path)


class PhasedSchedule:
    """timm schedulers that take turns, each counting steps from its own first one."""

    def __init__(self, phases: list[tuple[int, Any]]):
        self.phases = phases  # (first global step, scheduler), in order

    def step_update(self, step: int) -> None:
        first, scheduler = next((f, s) for f, s in reversed(self.phases) if step >= f)
        scheduler.step_update(step - first)


def _check_finite(loss: torch.Tensor, epoch: int, step: int) -> None:
    if not torch.isfinite(loss):
        raise VitftError(f"loss became {loss.item()} at epoch {epoch + 1} step {step}; lower --lr or use "
                         "--precision fp32/bf16")


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to checkpoint and stop at the next step, instead of dying mid-write."""

    def __init__(self):
        self.stop = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.stop:  # second signal: give up at once
            raise KeyboardInterrupt
        self.stop = True
        log.warning("%s received: saving a checkpoint to resume from, then stopping", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ---- the run ------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, resume_state: Optional[dict] = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.ddp, self.device = _init_distributed(cfg.device)
        torch.manual_seed(cfg.seed + self.ddp.rank)
        random.seed(cfg.seed + self.ddp.rank)
        np.random.seed(cfg.seed + self.ddp.rank)
        check_precision(self.device, cfg.precision)  # fail early; 'auto' is resolved once the model is built

        self.splits: DatasetSplits = find_dataset(cfg.data, cfg.val_split, cfg.seed)
        if not self.splits.val:
            raise VitftError(f"no validation images found in {cfg.data}; add a val/ folder or use --val-split")
        self.classes = self.splits.classes
        if len(self.classes) < 2:
            raise VitftError(f"{cfg.data} has {len(self.classes)} class ({', '.join(self.classes)}): a classifier "
                             "needs at least two class folders")
        self.resumed = resume_state is not None
        self.features: Optional[tuple[FeatureSet, Optional[FeatureSet]]] = None  # (train, val) in the frozen phase
        self._checkpointed = time.monotonic()  # when the last checkpoint was written (or the run started)
        if resume_state is None:
            self.model = build_model(cfg, len(self.classes))
        else:  # same architecture and hyperparameters; the weights come from the checkpoint
            trained_on = resume_state["pretrained_cfg"].get("label_names")
            if trained_on is not None and list(trained_on) != list(self.classes):
                raise VitftError(f"this run was trained on classes {', '.join(trained_on)} but {cfg.data} has "
                                 f"{', '.join(self.classes)}; resume with the same data")
            self.model = create_model(resume_state["pretrained_cfg"]["architecture"], num_classes=len(self.classes),
                                      **resume_state["model_args"])
            # the run's weights and preprocessing, before the data and the EMA copy are built from them
            self.model.load_state_dict(resume_state["model"])
            self.model.pretrained_cfg = dict(resume_state["pretrained_cfg"])
            self.model.model_args = resume_state["model_args"]
        self.model.pretrained_cfg["label_names"] = list(self.classes)
        self.img_size = tuple(self.model.patch_embed.img_size)
        self.model.to(self.device)
        self.precision_choice = choose_precision(self.device, cfg.precision, model_widths(self.model))
        self.precision = self.precision_choice.precision
        if cfg.grad_checkpointing:
            self.model.set_grad_checkpointing(True)

        self._build_data()
        self._build_optimization()
        self.epoch, self.step_in_epoch, self.global_step = 0, 0, 0
        self.best_top1, self.best_epoch, self.rows = -1.0, -1, []
        if resume_state is not None:
            self._restore(resume_state)
        elif cfg.freeze_backbone:
            _set_backbone_trainable(self.model, False)
        self._wrap()
        self.metrics = Metrics(run_dir, self.rows)
        # the writer is made when the run starts: nothing may be written into a run folder being replaced
        self._tb_writer = self._tensorboard_writer() if cfg.tensorboard and self.ddp.main else None
        self.tb = None

    # -- setup
    def _build_data(self) -> None:
        cfg, pcfg = self.cfg, self.model.pretrained_cfg
        self.train_tf = train_tf = build_transforms(
            pcfg, self.img_size, train=True, scale=cfg.scale, ratio=cfg.ratio, hflip=cfg.hflip,
            color_jitter=cfg.color_jitter, strong=cfg.strong_aug)
        self.eval_tf = eval_tf = build_transforms(pcfg, self.img_size, train=False)
        crop_pct = pcfg.get("crop_pct", DEFAULT_CROP_PCT)
        self.train_set = ImageDataset(self.splits.train, train_tf, cache=cfg.cache, img_size=self.img_size,
                                      crop_pct=crop_pct, name="train")
        # each rank evaluates its own slice of the validation set, so nothing is counted twice; a rank left
        # without images (fewer than processes) validates nothing and adds zeros to the sums
        val_part = self.splits.val[self.ddp.rank::self.ddp.world]
        self.val_set = ImageDataset(val_part, eval_tf, cache=cfg.cache, img_size=self.img_size, crop_pct=crop_pct,
                                    return_index=True, name="val") if val_part else None
        if len(self.train_set) < cfg.batch_size * self.ddp.world:
            raise VitftError(f"only {len(self.train_set)} training images for a batch of {cfg.batch_size}; "
                             "lower --batch-size")
        device_type = self.device.type
        self.train_loader = build_loader(self.train_set, cfg.batch_size, train=True, workers=cfg.workers,
                                         device_type=device_type, distributed=self.ddp.enabled, seed=cfg.seed)
        self.val_loader = build_loader(self.val_set, cfg.batch_size, train=False, workers=cfg.workers,
                                       device_type=device_type, seed=cfg.seed) if self.val_set is not None else ()
        if len(self.train_loader) < cfg.accum_steps:
            raise VitftError(f"an epoch has {len(self.train_loader)} batches, fewer than --accum-steps "
                             f"{cfg.accum_steps}; lower --accum-steps or --batch-size")
        steps = len(self.train_loader) // cfg.accum_steps
        if cfg.max_steps_per_epoch:
            steps = min(steps, cfg.max_steps_per_epoch)
        self.steps_per_epoch = steps
        self.batches_per_epoch = steps * cfg.accum_steps  # leftover micro-batches would leak into the next step

    def _build_optimization(self) -> None:
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy
        from timm.optim import create_optimizer_v2
        from timm.utils import ModelEmaV3

        cfg = self.cfg
        self.effective_batch = cfg.batch_size * cfg.accum_steps * self.ddp.world
        self.lr = cfg.lr * self.effective_batch / cfg.lr_base_size
        layer_decay = cfg.layer_decay if cfg.layer_decay is not None else (None if _scratch(cfg) else 0.75)
        self.layer_decay = layer_decay if layer_decay and layer_decay < 1 else None
        self.optimizer = create_optimizer_v2(self.model, opt=cfg.opt, lr=self.lr, weight_decay=cfg.weight_decay,
                                             layer_decay=self.layer_decay)
        self.scheduler = self._build_schedule()
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.mixup = None
        if cfg.mixup > 0 or cfg.cutmix > 0:
            self.mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.label_smoothing,
                               num_classes=len(self.classes))
            self.train_loss_fn = SoftTargetCrossEntropy()
        else:
            self.train_loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.head_loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)  # cached features: no mixup
        self.ema = ModelEmaV3(self.model, decay=cfg.ema_decay, use_warmup=True) if cfg.ema else None

    @property
    def head_epochs(self) -> int:
        """Epochs with the backbone frozen: all of them for a linear probe, else those before unfreeze_after."""
        if not self.cfg.freeze_backbone:
            return 0
        return self.cfg.epochs if self.cfg.unfreeze_after is None else self.cfg.unfreeze_after

    def _build_schedule(self) -> PhasedSchedule:
        """timm's warmup + cosine schedule. A head phase before unfreezing gets its own (no warmup, head_lr),
        and the full fine-tuning after it starts afresh, as fastai's fine_tune does."""
        from timm.scheduler import create_scheduler_v2

        cfg = self.cfg
        scale = self.effective_batch / cfg.lr_base_size
        self.head_lr = cfg.head_lr * scale if cfg.head_lr is not None else self.lr
        phases = []  # (first epoch, epochs, lr, warmup epochs)
        if 0 < self.head_epochs < cfg.epochs:
            phases.append((0, self.head_epochs, self.head_lr, 0))
        first = phases[0][1] if phases else 0
        epochs = cfg.epochs - first
        self.warmup_epochs = cfg.warmup_epochs
        if cfg.warmup_epochs * 2 > epochs:  # else the run is all warmup and ends by jumping to min_lr
            self.warmup_epochs = round(epochs * self.steps_per_epoch / 5) / self.steps_per_epoch
            if self.ddp.main:
                what = f"the {epochs} epochs after the head phase" if first else f"this {epochs}-epoch run"
                log.warning("--warmup-epochs %d would cover most of %s (ending it at min_lr, with no phase at full "
                            "LR); warming up for a fifth of it instead: %.3g epoch(s)", cfg.warmup_epochs, what,
                            self.warmup_epochs)
        phases.append((first, epochs, self.head_lr if self.head_epochs == cfg.epochs else self.lr,
                       self.warmup_epochs))
        schedulers = []
        for first_epoch, epochs, lr, warmup in phases:
            for group in self.optimizer.param_groups:
                group["initial_lr"] = lr  # what a timm scheduler takes as its base LR (times the layer's lr_scale)
            scheduler, _ = create_scheduler_v2(
                self.optimizer, sched="cosine", num_epochs=epochs, warmup_epochs=warmup, min_lr=cfg.min_lr,
                warmup_lr=min(1e-6, lr), step_on_epochs=False, updates_per_epoch=self.steps_per_epoch)
            schedulers.append((first_epoch * self.steps_per_epoch, scheduler))
        schedule = PhasedSchedule(schedulers)
        schedule.step_update(0)
        return schedule

    def _feature_phase(self) -> bool:
        """Whether this epoch trains the head on cached features of the frozen backbone."""
        return self.cfg.feature_views > 0 and self.epoch < self.head_epochs

    def _wrap(self) -> None:
        """DDP and/or torch.compile around the model; re-done when the trainable set changes."""
        module = self.model
        if self.ddp.enabled:
            module = nn.parallel.DistributedDataParallel(
                module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.cfg.compile:
            module = torch.compile(module)
        self.net = module

    @staticmethod
    def _tensorboard_writer():
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise VitftError("--tensorboard needs the tensorboard package: pip install tensorboard") from err
        return SummaryWriter

    # -- checkpoints
    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "pretrained_cfg": self.model.pretrained_cfg,
            "model_args": self.model.model_args,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema else None,
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "best_top1": self.best_top1, "best_epoch": self.best_epoch, "rows": self.rows,
            "rng": _rng_state(),
            "config": self.cfg.to_dict(),
        }

    def save_checkpoint(self) -> None:
        self._checkpointed = time.monotonic()
        if self.ddp.main:
            state = self._state()
            atomic_write(self.run_dir / CHECKPOINT, lambda tmp: torch.save(state, tmp))

    def _restore(self, state: dict) -> None:
        """The optimisation state; the model's weights and config were restored before anything was built."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema and state["ema"]:
            self.ema.load_state_dict(state["ema"])
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        # the schedule is a function of the step: rebuilt from this run's options, so more --epochs extend it
        self.scheduler.step_update(self.global_step)
        self.best_top1, self.best_epoch, self.rows = state["best_top1"], state["best_epoch"], state["rows"]
        _set_rng_state(state["rng"])
        if self.cfg.freeze_backbone:
            unfrozen = self.cfg.unfreeze_after is not None and self.epoch >= self.cfg.unfreeze_after
            _set_backbone_trainable(self.model, unfrozen)

    def _save_best(self, model: nn.Module, top1: float, epoch: int) -> None:
        info = {"train": self.cfg.to_dict(),
                "data": {"root": str(self.cfg.data), "layout": self.splits.layout, "classes": self.classes,
                         "counts": self.splits.class_counts()},
                "best": {"epoch": epoch, "val_top1": top1}}
        save_pretrained(model, self.run_dir, extra_config={"vitft": info})

    # -- loop
    def describe(self) -> list[str]:
        cfg = self.cfg
        counts = self.splits.class_counts()
        per_class = ", ".join(f"{c} {counts['train'].get(c, 0)}/{counts['val'].get(c, 0)}" for c in self.classes)
        weights = describe_weights(self.model)
        if self.resumed:  # the first line names the run's checkpoint, not the weights it started from
            weights[0] = (f"weights: this run's checkpoint {self.run_dir / CHECKPOINT} (the run started from "
                          f"{self.model.pretrained_cfg.get('source')})")
        plan = self.train_loader.cpu_plan
        warmup = f"{self.warmup_epochs:.3g}" + (f" (capped from {cfg.warmup_epochs})" if self.warmup_epochs !=
                                                cfg.warmup_epochs else "")
        lines = [
            *weights,
            f"data: {cfg.data} [{self.splits.layout}]: {len(self.classes)} classes, "
            f"{len(self.splits.train)} train / {len(self.splits.val)} val images (train/val per class: {per_class})",
            f"device: {self.device}{f' x{self.ddp.world} processes' if self.ddp.enabled else ''}, "
            f"{self.precision_choice.describe()}{', torch.compile' if cfg.compile else ''}; {plan.describe()}",
            f"optimizer: {cfg.opt}, effective batch {self.effective_batch} = {cfg.batch_size} x {cfg.accum_steps} "
            f"accum x {self.ddp.world} proc; lr {self.lr:.3g} = {cfg.lr:g} x {self.effective_batch}/"
            f"{cfg.lr_base_size}; layer decay {self.layer_decay or 'off'}; {cfg.epochs} epoch"
            f"{'s' * (cfg.epochs != 1)} x {self.steps_per_epoch} steps, warmup {warmup}",
        ]
        if self.head_epochs:
            lines.append(self._describe_head_phase())
        if getattr(self.model, "head_dist", None) is not None:
            lines.append("distilled model (DeiT): no teacher, so both heads (head, head_dist) are trained on the "
                         "labels through their mean, the model's output, as timm does")
        return lines

    def _describe_head_phase(self) -> str:
        cfg = self.cfg
        epochs = "every epoch" if self.head_epochs == cfg.epochs else f"epochs 1-{self.head_epochs}"
        if cfg.feature_views == 0:
            how = "the frozen backbone runs on freshly augmented images every epoch"
        else:
            views = "one un-augmented view" if cfg.feature_views == 1 else f"{cfg.feature_views} augmented views"
            how = (f"its pooled features ({views} of each image) are computed once and the head trains on them"
                   + (" (mixup/cutmix start with the backbone)" if self.mixup is not None else ""))
        then = "" if self.head_epochs == cfg.epochs else "; then everything trains, with a schedule of its own"
        return f"head phase, {epochs}: backbone frozen, head lr {self.head_lr:.3g}; {how}{then}"

    def train_epoch(self, progress) -> tuple[float, float, bool]:
        cfg, epoch = self.cfg, self.epoch
        self.net.train()
        if self.ddp.enabled:
            self.train_loader.sampler.set_epoch(epoch)
        else:
            self.train_loader.sampler.generator.manual_seed(cfg.seed * 1000 + epoch)  # same order on resume
        skip = self.step_in_epoch * cfg.accum_steps
        # run the loader to its end when uncapped, so that it reports the images it had to skip
        stop = self.batches_per_epoch if self.batches_per_epoch < len(self.train_loader) else None
        self.data_wait = [0.0]
        batches = _timed(islice(self.train_loader, skip, stop), self.data_wait)
        loss_sum, seen, t0 = 0.0, 0, time.perf_counter()
        task = progress.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=self.steps_per_epoch,
                                 completed=self.step_in_epoch, info="")
        for i, (images, targets) in enumerate(batches, start=skip):
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if self.mixup is not None:
                images, targets = self.mixup(images, targets)
            last_micro = (i + 1) % cfg.accum_steps == 0
            sync = last_micro or not self.ddp.enabled
            ctx = self.net.no_sync() if not sync and hasattr(self.net, "no_sync") else contextlib.nullcontext()
            with ctx:  # one context for forward and backward: a no_sync() context can be entered only once
                with compute_context(self.device, self.precision):
                    loss = self.train_loss_fn(self.net(images), targets)
                _check_finite(loss, epoch, i)
                self.scaler.scale(loss / cfg.accum_steps).backward()
            loss_sum += loss.item() * images.shape[0]
            seen += images.shape[0]
            if not last_micro:
                continue
            lr = self._optimizer_step()
            rate = seen / (time.perf_counter() - t0) * self.ddp.world
            progress.update(task, advance=1, info=f"loss {loss_sum / seen:.4f} lr {lr:.2e} {rate:.0f} img/s")
            if self.tb:
                self.tb.add_scalar("train/loss", loss.item(), self.global_step)
                self.tb.add_scalar("train/lr", lr, self.global_step)
            if cfg.save_every and self.global_step % cfg.save_every == 0:
                self.save_checkpoint()
            if self.step_in_epoch < self.steps_per_epoch and self._stop_requested():  # else: finish the epoch first
                progress.remove_task(task)
                return loss_sum / max(seen, 1), seen, True
        progress.remove_task(task)
        totals = _all_sum([loss_sum, seen], self.ddp, self.device)
        return totals[0] / max(totals[1], 1), totals[1], False

    def _optimizer_step(self) -> float:
        """Clip, step, schedule and average (EMA) after a full batch; returns the LR of the next step."""
        if self.cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.step_in_epoch += 1
        self.scheduler.step_update(self.global_step)
        if self.ema is not None:
            self.ema.update(self.model, step=self.global_step)
        return self.optimizer.param_groups[-1]["lr"]

    def train_head_epoch(self, progress) -> tuple[float, float, bool]:
        """An epoch of the frozen phase: the head learns from the backbone's pooled features, computed on first use.

        One step takes a whole effective batch (features need no accumulation), so the schedule keeps its steps.
        """
        cfg, epoch = self.cfg, self.epoch
        self.data_wait = [0.0]
        if self.features is None:
            self.features = self._extract_features(progress)
        self.model.train()
        generator = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
        batches = self.features[0].view(epoch).batches(cfg.batch_size * cfg.accum_steps, generator,
                                                        self.steps_per_epoch)
        loss_sum, seen = 0.0, 0
        for step, (pooled, targets) in enumerate(batches):
            if step < self.step_in_epoch:  # done before the run was interrupted
                continue
            pooled, targets = pooled.to(self.device), targets.to(self.device)
            with compute_context(self.device, self.precision):
                loss = self.head_loss_fn(self.model.classify(pooled), targets)
            _check_finite(loss, epoch, step)
            self.scaler.scale(loss).backward()
            if self.ddp.enabled:  # the head runs outside DDP's wrapper: average its gradients here
                for param in self.model.parameters():
                    if param.grad is not None:
                        dist.all_reduce(param.grad)
                        param.grad /= self.ddp.world
            self._optimizer_step()
            loss_sum += loss.item() * len(targets)
            seen += len(targets)
            if self.step_in_epoch < self.steps_per_epoch and self._stop_requested():
                return loss_sum / max(seen, 1), seen, True
        totals = _all_sum([loss_sum, seen], self.ddp, self.device)
        return totals[0] / max(totals[1], 1), totals[1], False

    def _extract_features(self, progress) -> tuple[FeatureSet, Optional[FeatureSet]]:
        """The frozen backbone's pooled features of this rank's training images and validation slice."""
        cfg, start = self.cfg, time.perf_counter()
        views = cfg.feature_views
        dataset = self.train_set.with_transform(self.eval_tf if views == 1 else self.train_tf, return_index=True)
        loader = build_loader(dataset, cfg.batch_size, train=False, workers=cfg.workers,
                              device_type=self.device.type, distributed=self.ddp.enabled, seed=cfg.seed)
        task = progress.add_task("pooled features", total=views * len(loader) + len(self.val_loader), info="")
        train = extract_features(self.model, loader, self.device, self.precision, views,
                                 lambda done, _: progress.update(task, completed=done))
        val = None
        if self.val_set is not None:
            val = extract_features(self.model, self.val_loader, self.device, self.precision, 1,
                                   lambda done, _: progress.update(task, completed=views * len(loader) + done))
        progress.remove_task(task)
        seconds = time.perf_counter() - start
        images = len(train) + (len(val) if val is not None else 0)
        counts = _all_sum([images, seconds], self.ddp, self.device)
        if self.ddp.main:
            log.info("pooled features of %d images (%d view(s) of the training images, and the validation ones) "
                     "computed once in %.0fs (%.0f img/s); the head trains on them", counts[0], views, seconds,
                     counts[0] / max(seconds, 1e-9))
        return train, val

    def _stop_requested(self) -> bool:
        flag = [1.0 if self.stop.stop else 0.0]
        return _all_sum(flag, self.ddp, self.device)[0] > 0

    @torch.inference_mode()
    def validate(self, model: nn.Module) -> dict:
        """Loss, top-1 and top-5 on this run's validation images, summed over all ranks."""
        model.eval()
        batches = self._feature_logits(model) if self._feature_phase() else self._image_logits(model)
        loss_sum = correct1 = correct5 = count = 0.0
        for logits, targets in batches:
            loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").item()
            top1, top5 = top_k_hits(logits, targets)
            correct1 += top1.sum().item()
            correct5 += top5.sum().item()
            count += targets.numel()
        loss_sum, correct1, correct5, count = _all_sum([loss_sum, correct1, correct5, count], self.ddp, self.device)
        if not count:
            raise VitftError("none of the validation images could be decoded")
        return {"val_loss": loss_sum / count, "val_top1": correct1 / count,
                "val_top5": correct5 / count if len(self.classes) > 5 else None, "val_images": int(count)}

    def _image_logits(self, model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        done = 0
        for images, targets, used in self.val_loader:
            # an image that failed to decode was replaced by another (used != requested): drop it, as evaluate does
            keep = used == torch.arange(done, done + len(used))
            done += len(used)
            if not keep.any():
                continue
            images, targets = images[keep].to(self.device), targets[keep].to(self.device)
            with compute_context(self.device, self.precision):
                logits = model(images)
            yield logits, targets

    def _feature_logits(self, model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.features is None or self.features[1] is None:  # a rank without validation images
            return
        for pooled, targets in self.features[1].batches(self.cfg.batch_size):
            with compute_context(self.device, self.precision):
                logits = getattr(model, "module", model).classify(pooled.to(self.device))
            yield logits, targets.to(self.device)

    def run(self, progress) -> RunResult:
        cfg = self.cfg
        interrupted = False
        self.tb = self._tb_writer(str(self.run_dir / "tensorboard")) if self._tb_writer else None
        with _StopFlag() as self.stop:
            while self.epoch < cfg.epochs:
                if cfg.freeze_backbone and cfg.unfreeze_after is not None and self.epoch == cfg.unfreeze_after \
                        and self.step_in_epoch == 0:
                    if self.ddp.main:
                        log.info("epoch %d: unfreezing the backbone", self.epoch + 1)
                    _set_backbone_trainable(self.model, True)
                    self._wrap()
                t0 = time.perf_counter()
                feature_phase = self._feature_phase()
                if not feature_phase:
                    self.features = None  # the backbone trains now: features computed before are stale
                epoch = self.train_head_epoch if feature_phase else self.train_epoch
                train_loss, seen, interrupted = epoch(progress)
                if interrupted:
                    self.save_checkpoint()
                    break
                seconds = time.perf_counter() - t0
                row = {"epoch": self.epoch + 1, "train_loss": round(train_loss, 5),
                       "lr": self.optimizer.param_groups[-1]["lr"], "images_per_s": round(seen / seconds, 1),
                       "seconds": round(seconds, 1), "data_wait": round(self.data_wait[0] / seconds, 4)}
                if self.device.type == "cuda":
                    row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
                candidates = [(self.model, self.validate(self.net if not cfg.compile else self.model))]
                if self.ema is not None:
                    candidates.append((self.ema.module, self.validate(self.ema.module)))
                best_model, scores = max(candidates, key=lambda c: c[1]["val_top1"])
                row.update({k: (round(v, 5) if isinstance(v, float) else v) for k, v in scores.items()})
                if self.ema is not None:
                    row["ema"] = best_model is self.ema.module
                self.epoch += 1
                self.step_in_epoch = 0
                # between two epochs on cached features (each a second or less) a checkpoint is written once a
                # minute at most: a crash loses those seconds, and the features are computed again on resume anyway
                checkpoint = not (feature_phase and self.epoch < cfg.epochs and self._feature_phase()) or \
                    time.monotonic() - self._checkpointed > CHECKPOINT_INTERVAL_S
                if self.ddp.main:
                    if scores["val_top1"] > self.best_top1:
                        self.best_top1, self.best_epoch = scores["val_top1"], self.epoch
                        self._save_best(best_model, scores["val_top1"], self.epoch)
                    self.metrics.add(row, plot=checkpoint)
                    if self.tb:
                        for key in ("val_loss", "val_top1"):
                            self.tb.add_scalar(f"val/{key[4:]}", row[key], self.epoch)
                    self._epoch_line(row)
                else:
                    self.rows.append(row)
                if checkpoint:
                    self.save_checkpoint()
                if self.epoch < cfg.epochs and self._stop_requested():  # a signal in the last step or validation
                    interrupted = True
                    break
        if self.tb:
            self.tb.close()
        return RunResult(self.run_dir, self.best_top1, self.best_epoch, self.epoch, interrupted, self.rows)

    def _epoch_line(self, row: dict) -> None:
        top5 = f" top-5 {100 * row['val_top5']:.1f}%" if row.get("val_top5") is not None else ""
        ema = " (EMA)" if row.get("ema") else ""
        log.info("epoch %d/%d: train loss %.4f | val loss %.4f top-1 %.1f%%%s%s | %.0f img/s, %.0fs",
                 row["epoch"], self.cfg.epochs, row["train_loss"], row["val_loss"], 100 * row["val_top1"], top5, ema,
                 row["images_per_s"], row["seconds"])


def _timed(batches, clock: list[float]):
    """Yield from `batches`, adding the seconds spent waiting for each batch to clock[0]."""
    iterator = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        clock[0] += time.perf_counter() - start
        yield batch


def _rng_state() -> dict:
    """Every RNG's state as tensors and plain numbers, so that a checkpoint loads with weights_only=True."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                      "gauss": float(gauss)},
            "python": {"version": version, "words": list(words), "gauss_next": gauss_next}}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["words"]), python["gauss_next"]))


def load_checkpoint(run_dir: Path) -> dict:
    """A run's last/checkpoint.pt, read with weights_only=True: a run folder from someone else cannot run code."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        raise VitftError(f"{run_dir} has no {CHECKPOINT} to resume from; is it a vitft run folder?")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VitftError(f"cannot read {path} as a checkpoint of tensors and plain values (it is never unpickled "
                         f"with code): {why}") from err


# options that define a run: a resume that changed them would re-split the data or ignore them
_RUN_DEFINING = ("seed", "val_split", "img_size", "pretrained", "model", "model_kwargs")


def _resume_config(state: dict, options: dict) -> TrainConfig:
    saved = TrainConfig.from_dict(state["config"])
    cfg = TrainConfig.from_dict({**state["config"], **options})
    changed = [k for k in _RUN_DEFINING if getattr(cfg, k) != getattr(saved, k)]
    if changed:
        was = ", ".join(f"--{k.replace('_', '-')} {getattr(saved, k)!r} (not {getattr(cfg, k)!r})" for k in changed)
        raise VitftError(f"a resumed run keeps its own {was}: drop those options, or start a new run to change them")
    return cfg


def _check_run_dir(cfg: TrainConfig) -> Path:
    """The run folder; an existing one is an error unless --overwrite and it is a run folder (replaced later)."""
    run_dir = Path(cfg.output) if cfg.output else _default_run_dir(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 alone checks and replaces the folder
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        if not cfg.overwrite:
            raise VitftError(f"run folder {run_dir} already exists; pass --overwrite to replace it, "
                             f"or --resume {run_dir} to continue it")
        if not ((run_dir / "train_config.json").is_file() or (run_dir / CHECKPOINT).is_file()):
            raise VitftError(f"{run_dir} is not a vitft run folder: --overwrite only replaces run folders; "
                             "pick another --output")
    return run_dir


def _start_run_dir(run_dir: Path) -> Optional[Path]:
    """Create the folder of a run that is ready to start; a run it replaces (checked by _check_run_dir) is moved
    aside first, and the caller deletes it when the new run ends: a crash never leaves neither."""
    replaced = None
    if run_dir.exists() and any(run_dir.iterdir()):
        replaced = run_dir.with_name(f"{run_dir.name}.replaced-{datetime.now():%Y%m%d-%H%M%S-%f}")
        run_dir.rename(replaced)
        log.info("moved the run being replaced to %s; it is deleted when this run ends", replaced)
    run_dir.mkdir(parents=True, exist_ok=True)
    return replaced


def finetune(config: TrainConfig | dict | None = None, resume: Optional[str | Path] = None,
             **options: Any) -> RunResult:
    """Fine-tune (or train) a ViT on an image folder; returns where the run is and how it went.

    `finetune(data="./intel", pretrained="vit_b_16", epochs=5)` or `finetune(resume="runs/x")`.
    Everything is checked (data, model, options, Hub token) before an existing run folder is replaced.
    """
    main = int(os.environ.get("RANK", "0")) == 0
    if resume is not None:
        run_dir = Path(resume)
        state = load_checkpoint(run_dir)
        cfg = _resume_config(state, options)
        if state["epoch"] >= cfg.epochs:
            done = f"{state['epoch']} epoch{'s' if state['epoch'] != 1 else ''}"
            raise VitftError(f"{run_dir} already finished {done}; raise --epochs to train longer")
    else:
        values = config.to_dict() if isinstance(config, TrainConfig) else dict(config or {})
        cfg = TrainConfig.from_dict({**values, **options})
        if not cfg.data:
            raise VitftError("no data: pass --data DIR (a folder of class folders, train/val, or the Intel layout)")
        if cfg.pretrained is None:
            cfg.pretrained = _default_pretrained(cfg.model)
            if main:
                log.info("no --pretrained given: using %s, %s", cfg.pretrained,
                         f"the default weights of --model {cfg.model}" if cfg.model else "the default")
        state = None
        run_dir = _check_run_dir(cfg)
    _check_config(cfg)
    if cfg.push_to_hub:
        from .hub import resolve_token

        resolve_token()  # no token: fail now, not after hours of training
    trainer = Trainer(cfg, run_dir, state)
    replaced = None
    if trainer.ddp.main:
        replaced = _start_run_dir(run_dir) if state is None else None
        atomic_write(run_dir / "train_config.json", lambda tmp: tmp.write_text(json.dumps(cfg.to_dict(), indent=2)))
        for line in trainer.describe():
            log.info(line)
        if state is not None:
            log.info("resuming %s at epoch %d, step %d", run_dir, trainer.epoch + 1, trainer.step_in_epoch)
    try:
        with ProgressBar(enabled=not cfg.quiet and trainer.ddp.main) as progress:
            result = trainer.run(progress)
    except BaseException:
        if replaced is not None:
            log.warning("the run this one was replacing is kept in %s", replaced)
        raise
    if replaced is not None:
        shutil.rmtree(replaced)
    if trainer.ddp.main and not result.interrupted and cfg.push_to_hub:
        from .hub import push_run

        push_run(run_dir, cfg.push_to_hub)
    if trainer.ddp.enabled:  # the ranks leave together: a rank that exits while gloo's threads still run aborts
        dist.barrier()
        dist.destroy_process_group()
    return result


def _check_config(cfg: TrainConfig) -> None:
    checks = [
        (cfg.epochs >= 1, "--epochs must be at least 1"),
        (cfg.batch_size >= 1, "--batch-size must be at least 1"),
        (cfg.accum_steps >= 1, "--accum-steps must be at least 1"),
        (cfg.lr > 0, "--lr must be positive"),
        (cfg.unfreeze_after is None or cfg.freeze_backbone, "--unfreeze-after needs --freeze-backbone"),
        (cfg.unfreeze_after is None or 0 < cfg.unfreeze_after < cfg.epochs,
         f"--unfreeze-after must be between 1 and --epochs - 1 ({cfg.epochs - 1}), got {cfg.unfreeze_after}"),
        (cfg.feature_views >= 0, "--feature-views must be 0 (no cached features) or more"),
        (cfg.head_lr is None or cfg.head_lr > 0, "--head-lr must be positive"),
        (not (cfg.mixup or cfg.cutmix) or cfg.batch_size % 2 == 0, "mixup/cutmix need an even --batch-size"),
    ]
    for ok, message in checks:
        if not ok:
            raise VitftError(message)

"""A run, assembled from the engine's parts: the data, the model and its optimisation, a plan of phases, the
step loop, the callbacks around it, and the state a checkpoint keeps. One loop for CPU, one GPU or many (DDP
under torchrun), resumable at any step."""
from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import TrainConfig
from ..data.balance import check_balance
from ..data.datasets import DatasetSplits, find_dataset
from ..data.loaders import ImageDataset, build_loader
from ..data.transforms import build_transforms
from ..errors import VitftError
from ..progress import ProgressBar
from ..run_folder import RunFolder
from ..runtime import check_precision, choose_precision, model_widths
from ..tasks.inference import top_k_hits
from ..tasks.report import confusion_scores
from ..weights.preprocessing import preprocessing
from . import callbacks as cb
from .budget import TimeBudget
from .distributed import all_sum, init_distributed, main_process_choice
from .loop import EpochResult, Interrupted, StopFlag, run_steps
from .model_setup import build_model, is_scratch
from .objective import losses, mark_task, selection_metric, validate_multilabel
from .phases import PhasePlan
from .schedule import build_schedule
from .state import TrainState, model_from_checkpoint
from .stream_data import build_stream_data
from .summary import startup_lines
from .weighted_loss import balanced_loss

log = logging.getLogger("vitft")


@dataclass
class RunResult:
    run_dir: Path
    best_top1: float
    best_epoch: int
    epochs_done: int
    interrupted: bool
    metrics: list[dict]
    stop_reason: Optional[str] = None  # why the run ended before --epochs, other than a signal (early stopping)


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, resume_state: Optional[dict] = None,
                 stop_flag: Optional[StopFlag] = None, progress: Optional[ProgressBar] = None,
                 started: Optional[float] = None):
        """`stop_flag`: one already installed around the whole run (finetune's), so that a signal while the data is
        scanned and cached stops the run too; without one, run() installs its own. `progress` shows the cache fill;
        `started`: when the command started (time.monotonic()), which a --time-budget counts from."""
        self.cfg = cfg
        self.stop_flag, self._own_stop_flag = stop_flag or StopFlag(), stop_flag is None
        self.folder = RunFolder(run_dir)
        self.ddp, self.device = init_distributed(cfg.device)
        torch.manual_seed(cfg.seed + self.ddp.rank)
        random.seed(cfg.seed + self.ddp.rank)
        np.random.seed(cfg.seed + self.ddp.rank)
        check_precision(self.device, cfg.precision)  # fail early; 'auto' is resolved once the model is built
        # trackers are checked first (no package, no MLflow server: fail before anything is written), started later
        self.trackers = [cb.make_tracker(name, self.folder) for name in cb.trackers(cfg)] if self.ddp.main else []

        self.splits: DatasetSplits = find_dataset(
            cfg.data, cfg.val_split, cfg.seed, config=cfg.data_config, revision=cfg.data_revision,
            streaming=cfg.streaming, val_data=cfg.val_data, label_names=cfg.label_names,
            image_column=cfg.image_column, label_column=cfg.label_column)
        self.multi_label = cfg.multi_label or self.splits.multi_label
        if not self.splits.val:
            raise VitftError(f"no validation images found in {cfg.data}; add a val/ folder or use --val-split")
        self.classes = self.splits.classes
        if len(self.classes) < 2:
            raise VitftError(f"{cfg.data} has {len(self.classes)} class ({', '.join(self.classes)}): a classifier "
                             "needs at least two class folders")
        self.resumed = resume_state is not None
        # a resumed run keeps its architecture and preprocessing: the data and the EMA copy are built from them
        self.model = build_model(cfg, len(self.classes)) if resume_state is None else \
            model_from_checkpoint(resume_state, self.classes, cfg.data)
        self.model.pretrained_cfg["label_names"] = list(self.classes)
        mark_task(self.model, self.multi_label)
        self.img_size = tuple(self.model.patch_embed.img_size)
        self.model.to(self.device)
        # measured on rank 0 alone: ranks that timed bf16 differently would train in different precisions
        self.precision_choice = main_process_choice(
            choose_precision(self.device, cfg.precision, model_widths(self.model)) if self.ddp.main else None, self.ddp)
        self.precision = self.precision_choice.precision
        if cfg.grad_checkpointing:
            self.model.set_grad_checkpointing(True)

        self.plan = PhasePlan(cfg, len(self.model.blocks))
        self._build_data(progress)
        self.plan.freeze_for_the_run(self.model)
        self._build_optimization()
        self.budget = TimeBudget(self, started) if cfg.time_budget else None
        self.state = TrainState(cfg, self.model, self.optimizer, self.scaler, self.ema, budget=self.budget)
        if resume_state is not None:
            self.state.load_state_dict(resume_state)
            # the schedule is a function of the step: rebuilt from this run's options, so more --epochs extend it
            self.scheduler.step_update(self.state.global_step)
        self.phase = self.plan.at(self.state.epoch)
        self.phase.enter(self.model)  # after the optimizer is built: its groups hold every parameter
        self._wrap()
        self.stop_reason: Optional[str] = None
        self.checkpoint_due = False
        self.data_wait = [0.0]
        self.progress = progress

    # -- setup
    def _build_data(self, progress: Optional[ProgressBar]) -> None:
        cfg, pcfg = self.cfg, self.model.pretrained_cfg
        self.train_tf = train_tf = build_transforms(
            pcfg, self.img_size, train=True, scale=cfg.scale, ratio=cfg.ratio, hflip=cfg.hflip,
            color_jitter=cfg.color_jitter, strong=cfg.strong_aug)
        self.eval_tf = eval_tf = build_transforms(pcfg, self.img_size, train=False)
        crop_pct = preprocessing(pcfg).crop_pct
        if self.splits.streamed:
            return build_stream_data(self)
        targets = len(self.classes) if self.multi_label else None  # multi-hot targets of this length
        self.train_set = ImageDataset(self.splits.train, train_tf, cache=cfg.cache, img_size=self.img_size,
                                      crop_pct=crop_pct, name="train", num_classes=targets)
        show = progress.counter("decoding the training images (--cache)", " images") \
            if progress is not None and self.ddp.main else None
        self.train_set.fill_cache(show, self.interrupt_requested)  # before build_loader, which would fill it unpolled
        # each rank evaluates its own slice of the validation set, so nothing is counted twice; a rank left
        # without images (fewer than processes) validates nothing and adds zeros to the sums. Never from the
        # cache: validation decodes each original as `evaluate` does, so that the two agree exactly
        val_part = self.splits.val[self.ddp.rank::self.ddp.world]
        self.val_set = ImageDataset(val_part, eval_tf, img_size=self.img_size, crop_pct=crop_pct,
                                    return_index=True, name="val", num_classes=targets) if val_part else None
        if len(self.train_set) < cfg.batch_size * self.ddp.world:
            raise VitftError(f"only {len(self.train_set)} training images for a batch of {cfg.batch_size}; "
                             "lower --batch-size")
        device_type = self.device.type
        check_balance(cfg.balance, self.multi_label)
        self.train_loader = build_loader(self.train_set, cfg.batch_size, train=True, workers=cfg.workers,
                                         threads=cfg.threads, device_type=device_type, distributed=self.ddp.enabled,
                                         seed=cfg.seed, balanced=cfg.balance == "sampler")
        self.val_loader = build_loader(self.val_set, cfg.batch_size, train=False, workers=cfg.workers,
                                       threads=cfg.threads, device_type=device_type,
                                       seed=cfg.seed) if self.val_set is not None else ()
        if len(self.train_loader) < cfg.accum_steps:
            raise VitftError(f"an epoch has {len(self.train_loader)} batches, fewer than --accum-steps "
                             f"{cfg.accum_steps}; lower --accum-steps or --batch-size")
        steps = len(self.train_loader) // cfg.accum_steps
        if cfg.max_steps_per_epoch:
            steps = min(steps, cfg.max_steps_per_epoch)
        self.steps_per_epoch = steps
        self.batches_per_epoch = steps * cfg.accum_steps  # leftover micro-batches would leak into the next step

    def _build_optimization(self) -> None:
        from timm.optim import create_optimizer_v2
        from timm.utils import ModelEmaV3

        cfg = self.cfg
        self.effective_batch = cfg.batch_size * cfg.accum_steps * self.ddp.world
        self.lr = cfg.lr * self.effective_batch / cfg.lr_base_size
        layer_decay = cfg.layer_decay if cfg.layer_decay is not None else (None if is_scratch(cfg) else 0.75)
        self.layer_decay = layer_decay if layer_decay and layer_decay < 1 else None
        self.optimizer = create_optimizer_v2(self.model, opt=cfg.opt, lr=self.lr, weight_decay=cfg.weight_decay,
                                             layer_decay=self.layer_decay)
        schedule = build_schedule(self.optimizer, cfg, self.lr, self.effective_batch, self.plan.head_epochs,
                                  self.steps_per_epoch, main=self.ddp.main)
        self.scheduler, self.head_lr, self.warmup_epochs = schedule.scheduler, schedule.head_lr, schedule.warmup_epochs
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        # cached features have no mixup: the head loss is the unmixed one
        self.mixup, self.train_loss_fn, self.head_loss_fn = losses(cfg, len(self.classes), self.multi_label)
        labels = () if self.splits.streamed else self.train_set.labels  # a stream is refused --balance
        weighted = balanced_loss(cfg.balance, labels, len(self.classes), cfg.label_smoothing)
        if weighted is not None:  # --balance loss or sqrt: one loss for labels, smoothed or mixed
            self.train_loss_fn = self.head_loss_fn = weighted.to(self.device)
        self.ema = ModelEmaV3(self.model, decay=cfg.ema_decay, use_warmup=True) if cfg.ema else None

    def _wrap(self) -> None:
        """DDP and/or torch.compile around the model; re-done when the trainable set changes."""
        module = self.model
        if self.ddp.enabled:
            module = nn.parallel.DistributedDataParallel(
                module, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.cfg.compile:
            module = torch.compile(module)
        self.net = module

    def _callbacks(self, progress: ProgressBar) -> cb.Callbacks:
        """In order: a --time-budget's planner (it re-plans, and puts its plan into the row metrics.csv gets); early
        stopping decides next (a stop forces a checkpoint and the curves); then the best model
        and at once the checkpoint, so that a kill -9 leaves a run that resumes; then metrics, curves and trackers."""
        callbacks: list[cb.Callback] = [self.budget] if self.budget else []  # first: it adds the plan to the rows
        callbacks += [cb.EarlyStopping(self.cfg.patience)] if self.cfg.patience else []
        if self.ddp.main:
            callbacks.append(cb.BestModelSaver(self.folder))
        callbacks.append(cb.Checkpointer(self.cfg.save_every))
        if self.ddp.main:
            callbacks += [cb.MetricsLog(self.folder), *self.trackers]
        return cb.Callbacks([*callbacks, cb.Progress(progress, self.ddp.main)])

    # -- the run
    def run(self, progress: ProgressBar) -> RunResult:
        state = self.state
        self.progress = progress
        self.callbacks = self._callbacks(progress)
        interrupted, status = False, "failed"
        self.callbacks.on_run_start(self)
        try:
            with self.stop_flag if self._own_stop_flag else contextlib.nullcontext():
                try:
                    self.check_interrupt()  # a signal while the data was scanned or cached
                    while state.epoch < self.plan.epochs and not self.stop_reason:
                        self._enter(self.plan.at(state.epoch))
                        self.data_wait = [0.0]
                        steps = self.phase.steps(self, progress)  # a head phase's feature pass runs here, untimed
                        start = time.perf_counter()
                        self.callbacks.on_epoch_start(self)
                        result = run_steps(self, steps)
                        if result.interrupted:
                            raise Interrupted
                        self._end_epoch(result, time.perf_counter() - start)
                        if state.epoch < self.plan.epochs and not self.stop_reason and self.stop_requested():
                            raise Interrupted  # a signal in the last step
                except Interrupted:
                    self.save_checkpoint()  # at step 0 when nothing was done yet: a resume starts the pass again
                    interrupted = True
            status = "interrupted" if interrupted else "finished"
        finally:
            self.phase.leave()  # a cache's memory and scratch file go now
            self.callbacks.on_run_end(self, status)
        return RunResult(self.folder.path, state.best_top1, state.best_epoch, state.epoch, interrupted, state.rows,
                         self.stop_reason)

    def _enter(self, phase) -> None:
        if phase is self.phase:
            return
        if self.ddp.main:
            log.info("epoch %d: %s", self.state.epoch + 1, phase.starts)
        self.phase.leave()
        self.phase = phase
        phase.enter(self.model)
        self._wrap()

    def _end_epoch(self, result: EpochResult, seconds: float) -> None:
        """Validate (the model, and its EMA), count the epoch, and hand its row to the callbacks."""
        cfg, state, phase = self.cfg, self.state, self.phase
        row = {"epoch": state.epoch + 1, "train_loss": round(result.loss, 5),
               "lr": self.optimizer.param_groups[-1]["lr"], "images_per_s": round(result.images / seconds, 1),
               "seconds": round(seconds, 1), "data_wait": round(self.data_wait[0] / seconds, 4)}
        if self.device.type == "cuda":
            row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        candidates = [(self.model, self.validate(self.net if not cfg.compile else self.model))]
        if self.ema is not None:
            candidates.append((self.ema.module, self.validate(self.ema.module)))
        key = selection_metric(self.multi_label)
        best_model, scores = max(candidates, key=lambda c: c[1][key])
        row.update({k: (round(v, 5) if isinstance(v, float) else v) for k, v in scores.items()})
        if self.ema is not None:
            row["ema"] = best_model is self.ema.module
        improved = state.record(scores[key])
        state.rows.append(row)
        self.checkpoint_due = phase.wants_checkpoint(state.epoch >= self.plan.epochs or self.plan.at(state.epoch)
                                                     is not phase)
        self.callbacks.on_epoch_end(self, row, best_model if improved else None)

    def optimizer_step(self) -> float:
        """Clip, step, schedule and average (EMA) after a full batch; returns the LR of the next step."""
        if self.cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self.state.step_in_epoch += 1
        self.scheduler.step_update(self.state.global_step)
        if self.ema is not None:
            self.ema.update(self.model, step=self.state.global_step)
        return self.optimizer.param_groups[-1]["lr"]

    def save_checkpoint(self) -> None:
        self.phase.checkpointed()
        if self.ddp.main:
            self.folder.write_checkpoint(self.state.state_dict())

    def stop(self, reason: str) -> None:
        """End the run after this epoch, checkpointed, saying why (every rank decides alike)."""
        self.stop_reason, self.checkpoint_due = reason, True

    def stop_requested(self) -> bool:
        """Whether any rank got a signal."""
        return all_sum([1.0 if self.stop_flag.stop else 0.0], self.ddp, self.device)[0] > 0

    def interrupt_requested(self) -> bool:
        """Whether a pass between training steps (cache, features, validation) stops at a signal: with one
        process. Ranks of a DDP run must stop together, at the collective check after a step."""
        return not self.ddp.enabled and self.stop_flag.stop

    def check_interrupt(self) -> None:
        """Raise Interrupted if interrupt_requested(): called between the batches of those passes."""
        if self.interrupt_requested():
            raise Interrupted

    @torch.inference_mode()
    def validate(self, model: nn.Module) -> dict:
        """Loss, top-1, top-5, balanced accuracy and macro F1 on this run's validation images, summed over all ranks."""
        if self.multi_label:
            return validate_multilabel(self, model)
        model.eval()
        loss_sum = correct1 = correct5 = count = 0.0
        k = len(self.classes)
        confusion = torch.zeros(k * k, dtype=torch.long)  # for balanced accuracy and macro F1
        total = len(self.val_set) if self.val_set is not None else 0
        progress = self.progress.counter("validation", " images") if self.progress is not None else None
        for logits, targets in self.plan.at(self.state.epoch).logits(self, model):
            self.check_interrupt()
            loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum").item()
            top1, top5 = top_k_hits(logits, targets)
            correct1 += top1.sum().item()
            correct5 += top5.sum().item()
            count += targets.numel()
            confusion += torch.bincount((targets * k + logits.argmax(dim=1)).cpu(), minlength=k * k)
            if progress:
                progress(int(count), total)
        loss_sum, correct1, correct5, count, *cells = all_sum([loss_sum, correct1, correct5, count,
                                                               *confusion.tolist()], self.ddp, self.device)
        if not count:
            raise VitftError("none of the validation images could be decoded")
        return {"val_loss": loss_sum / count, "val_top1": correct1 / count,
                "val_top5": correct5 / count if len(self.classes) > 5 else None, "val_images": int(count),
                **{f"val_{name}": v for name, v in confusion_scores(np.reshape(cells, (k, k))).items()}}

    def describe(self) -> list[str]:
        """The start-up lines: weights, data, device, optimisation, and the head phase."""
        return startup_lines(self)

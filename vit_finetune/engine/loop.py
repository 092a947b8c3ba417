"""The step loop: one epoch of steps over a batch source (images or cached features) with a forward function.

The loop owns what every epoch shares: gradient accumulation, the finite-loss check, the loss accounting, the
callbacks after each step, stopping at a signal, and the sums over the ranks. What differs between epochs (the
batches, the forward, how the gradients meet across ranks) comes in a `Steps`, made by the run's phase.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..errors import VitftError
from .distributed import all_sum

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger("vitft")


@dataclass
class Steps:
    """One epoch's work: (inputs, targets) batches from where the epoch resumes, and how to get a loss from one."""

    batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, targets) -> mean loss
    first: int = 0  # index of the first batch (past those done before an interruption)
    accum_steps: int = 1  # batches per optimizer step
    no_sync: Optional[Callable[[], AbstractContextManager]] = None  # DDP's, for the batches before a step's last
    sync_gradients: Optional[Callable[[], None]] = None  # what brings the ranks' gradients together, if DDP does not


@dataclass
class StepEnd:
    """What callbacks learn after each optimizer step."""

    loss: float  # the last batch's loss
    mean_loss: float  # this epoch's so far, on this rank
    images: int  # images this epoch, on this rank
    seconds: float  # since the epoch started
    lr: float  # the learning rate of the next step


class Interrupted(Exception):
    """A signal asked the run to stop in the middle of a pass that is not a training step (caching, features,
    validation): the trainer checkpoints where the run is and stops."""


@dataclass
class EpochResult:
    loss: float  # mean training loss (over all ranks, unless interrupted); nan when no batch was left to train
    images: int
    interrupted: bool


def check_finite(loss: torch.Tensor, epoch: int, step: int) -> None:
    if not torch.isfinite(loss):
        raise VitftError(f"loss became {loss.item()} at epoch {epoch + 1} step {step}; lower --lr or use "
                         "--precision fp32/bf16")


def run_steps(trainer: Trainer, steps: Steps) -> EpochResult:
    """Train on `steps` to the epoch's end, or until every rank has been asked to stop."""
    state, loss_sum, seen, start = trainer.state, 0.0, 0, time.perf_counter()
    for i, (inputs, targets) in enumerate(steps.batches, start=steps.first):
        last_micro = (i + 1) % steps.accum_steps == 0
        sync = contextlib.nullcontext() if last_micro or steps.no_sync is None else steps.no_sync()
        with sync:  # one context for forward and backward: a no_sync() context can be entered only once
            loss = steps.forward(inputs, targets)
            check_finite(loss, state.epoch, i)
            trainer.scaler.scale(loss / steps.accum_steps).backward()
        loss_sum += loss.item() * len(targets)
        seen += len(targets)
        if not last_micro:
            continue
        if steps.sync_gradients is not None:
            steps.sync_gradients()
        lr = trainer.optimizer_step()
        trainer.callbacks.on_step_end(trainer, StepEnd(loss.item(), loss_sum / seen, seen,
                                                       time.perf_counter() - start, lr))
        if state.step_in_epoch < trainer.steps_per_epoch and trainer.stop_requested():  # else: finish the epoch
            return EpochResult(loss_sum / max(seen, 1), seen, True)
        if trainer.budget is not None and trainer.budget.cuts_epoch(state.step_in_epoch):
            break  # a --time-budget plan made this epoch shorter than its batches
    loss_sum, seen = all_sum([loss_sum, seen], trainer.ddp, trainer.device)
    # nan: a resume after an interrupted validation has no batch left, and its loss was not kept
    return EpochResult(loss_sum / seen if seen else float("nan"), int(seen), False)


def timed(batches: Iterable, clock: list[float]) -> Iterator:
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


class StopFlag:
    """SIGINT/SIGTERM ask the run to checkpoint and stop at the next step or batch, instead of dying mid-write.

    Installed before the data is scanned; the long passes other than training steps (the decode cache, the
    feature pass, validation) poll it between batches (Trainer.check_interrupt) and raise Interrupted.
    """

    def __init__(self):
        self.stop = False
        self._previous = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.stop:  # second signal: give up at once
            log.warning("%s again: stopping now, without a checkpoint", signal.Signals(signum).name)
            raise KeyboardInterrupt
        self.stop = True
        log.warning("%s received: saving a checkpoint to resume from, then stopping", signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

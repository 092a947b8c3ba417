"""--time-budget: a run planned to end, best model saved, within a number of minutes from the command's start.

`TimeBudget` is a callback, first in the trainer's list, and plans each phase of the run (PhasePlan) in turn:
- it times the phase's first steps in this process (WARMUP_STEPS untimed, then TIMED_STEPS, or fewer when the
  epoch ends first: a fixed count, so that every DDP rank plans at the same step), a few validation batches, and
  estimates an epoch end (validation, saving); one-time passes (the cached features) are already spent by then;
- it fits the phase's epochs (at most its share of --epochs) and steps per epoch (at most an epoch's batches)
  into the time the phase may take: the phases after it keep their share of the epochs (`budget_head_share` for a
  head phase), the last phase has all the rest. A warmup + cosine schedule is fitted to that length, from the
  phase's first step: after its last step the LR is min_lr, as in a run of that many epochs;
- at each epoch start (and a few times within each epoch) it re-checks the plan with the last epochs' step time
  (or the current epoch's) and the measured epoch ends. Where
  the rest no longer fits, the end moves earlier (never later): fewer epochs or steps, and a cosine re-fitted from
  the current step and LR down to min_lr at the new end;
- its plans, and the budget seconds used, go into the checkpoint: a resume restores the schedule as it was and
  re-checks it against the time left (the first steps of a resumed run are timed again).
Rank 0 decides every plan and re-fit (`main_process_choice`); the other ranks apply what it sends.
"""
from __future__ import annotations

import logging
import math
import time
from datetime import datetime, timedelta
from itertools import islice
from statistics import mean
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..errors import VitftError
from ..progress import format_rate
from .callbacks import Callback
from .distributed import main_process_choice
from .schedule import cosine, fitted_warmup_epochs

if TYPE_CHECKING:
    from .loop import StepEnd
    from .trainer import Trainer

log = logging.getLogger("vitft")

WARMUP_STEPS = 2  # a phase's first steps in a process (allocations, loader start-up): not timed
TIMED_STEPS = 8  # then the steps whose mean time a plan uses
MARGIN = 0.02  # of the budget: kept free for the timing's noise; a re-fit starts when half of it would be used
CHECKS_PER_EPOCH = 4  # re-checks within an epoch, besides the one at its start
PROBE_BATCHES = 2  # validation batches timed to estimate a validation pass
SAVE_S, SAVE_BYTES_PER_S = 0.5, 200e6  # an epoch end's saving (best model, checkpoint, curves), until measured
PASS_CHECK_S = 10.0  # seconds of a one-time pass (cached features or activations) before its end is projected


def fit(seconds: float, step_s: float, epoch_end_s: float, max_epochs: int, max_steps: int,
        done: int = 0, whole_epochs: bool = False) -> Optional[tuple[int, int]]:
    """(epochs, steps per epoch) that fill `seconds`: all of `max_epochs` full epochs of `max_steps` when they fit,
    else the fewest epochs, each shorter than a full one where needed, that use the time; `done` steps of the first
    epoch are already behind (they cost nothing more). `whole_epochs` (a re-fit): the full epochs that fit, shorter
    ones only when not even one does; re-fits that shortened every epoch again would end in epochs of a step or
    two, each paying a whole epoch end. None when not even the current epoch can end in time."""
    fits = (seconds + done * step_s) / (max_steps * step_s + epoch_end_s)  # full epochs, fractional
    if fits >= max_epochs:
        return max_epochs, max_steps
    if whole_epochs and fits >= 1:
        return math.floor(fits), max_steps
    for epochs in range(min(max_epochs, max(1, math.ceil(fits))), 0, -1):
        steps = min(max_steps, math.floor(((seconds - epochs * epoch_end_s) / step_s + done) / epochs))
        if steps >= max(done, 1):
            return epochs, steps
    return None


def planned_epochs(state: dict) -> Optional[int]:
    """The run's length that a checkpoint's --time-budget planned; None when it had none, or planned nothing yet."""
    budget = state.get("budget") or {}
    return budget["epochs"] if budget.get("plans") else None


class TimeBudget(Callback):
    def __init__(self, trainer: Trainer, started: Optional[float] = None):
        self.trainer = trainer
        self.budget_s = trainer.cfg.time_budget * 60
        self.started = started if started is not None else time.monotonic()
        self.used_before = 0.0  # budget seconds a resumed run had used before
        phases, end = trainer.plan.phases, trainer.plan.epochs
        self.caps = [(phases[i + 1][0] if i + 1 < len(phases) else end) - first for i, (first, _) in enumerate(phases)]
        self.full_steps = trainer.steps_per_epoch  # an epoch's batches (--max-steps-per-epoch's cap included)
        # the schedules built from the options, one per phase that has epochs: what a phase follows until planned
        self.provisional = dict(zip([i for i, cap in enumerate(self.caps) if cap], [s for _, s in
                                                                                    trainer.scheduler.phases]))
        self.plans: dict[int, dict] = {}  # by phase index: see _plan()
        self.ends_by: dict[int, float] = {}  # by phase index: the budget seconds by which it must end
        self.mark = 0.0  # budget seconds at the run's start or the last epoch end: where a new phase starts
        self.index: Optional[int] = None  # the phase this process is timing
        self.steps_seen = self.epoch_steps = 0
        self.measured = False
        self.timed_from = self.epoch_start = self.last_step = 0.0
        self.step_s: Optional[float] = None  # seconds per step: the first steps', then the last epochs' (up to 3)
        self.epoch_step_s: list[float] = []  # each epoch's, of this phase in this process
        self.epoch_ends: list[float] = []  # measured epoch ends of this phase, in this process

    # -- the clock
    def used(self) -> float:
        """Budget seconds used so far, this run's earlier processes included."""
        return self.used_before + time.monotonic() - self.started

    def clock_time(self, budget_s: float) -> str:
        return f"{datetime.now() + timedelta(seconds=budget_s - self.used()):%H:%M:%S}"

    # -- checkpoint
    def state_dict(self) -> dict:
        return {"used_s": self.used(), "epochs": self.trainer.plan.epochs,
                "plans": {str(i): plan for i, plan in self.plans.items()},
                "ends_by": {str(i): s for i, s in self.ends_by.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue the checkpointed plans: the same schedule, within what is left of the budget."""
        self.used_before = state["used_s"]
        self.plans = {int(i): plan for i, plan in state["plans"].items()}
        self.ends_by = {int(i): s for i, s in state["ends_by"].items()}
        self.mark = self.used_before
        self._install()

    def describe(self) -> str:
        cfg = self.trainer.cfg
        spent = f"{self.used_before / 60:.1f} min used before this resume, " if self.used_before else ""
        setup = time.monotonic() - self.started
        return (f"time budget: {cfg.time_budget:g} min from the command's start ({spent}{setup:.0f} s set-up so "
                f"far): the run's length is planned from its first steps (--epochs {cfg.epochs} at most), to end by "
                f"{self.clock_time(self.budget_s)}")

    def pass_check(self, what: str, total: int) -> Callable[[int], None]:
        """A check for a one-time pass over `total` images (pooled features, activations), called with the images
        done: once the pass has run PASS_CHECK_S, a pass whose projected end is past the budget stops the run with a
        one-line error then, not after overrunning the budget. One process only: DDP ranks that projected apart
        would stop apart (theirs is the check after the first steps)."""
        start = time.monotonic()

        def check(done: int) -> None:
            elapsed = time.monotonic() - start
            if self.trainer.ddp.enabled or not done or elapsed < PASS_CHECK_S:
                return
            ends = self.used() + elapsed * (total - done) / done
            if ends > self.budget_s * (1 - MARGIN):
                raise VitftError(
                    f"--time-budget {self.trainer.cfg.time_budget:g} min is too short: the {what} pass alone would "
                    f"end {ends / 60:.1f} min into the run ({format_rate(done / elapsed)} img/s for {total} images on "
                    f"this machine); give it at least {math.ceil(ends * 1.25 / 60)} min, or fewer images to pass "
                    "(--feature-views, --max-steps-per-epoch)")
        return check

    def cuts_epoch(self, step_in_epoch: int) -> bool:
        """Whether the loop ends the epoch here: a plan made it shorter than the batches its steps were made from."""
        return step_in_epoch >= self.trainer.steps_per_epoch and self.trainer.steps_per_epoch < self.full_steps

    # -- hooks
    def on_run_start(self, trainer):
        self.mark = self.used()
        spent = self._decide(lambda: self.mark >= self.budget_s * (1 - MARGIN) and
                             {"error": f"--time-budget {trainer.cfg.time_budget:g} min is too short: "
                                       f"{self.mark:.2g} s of it {'were' if not self.used_before else 'are'} "
                                       "used before training could start; give it more minutes"})
        self._apply(spent)

    def on_epoch_start(self, trainer):
        index = self._phase_index()
        now = time.perf_counter()
        if index != self.index:  # a phase starts (or the run resumes): time it afresh
            self.index, self.steps_seen, self.measured, self.epoch_ends = index, 0, False, []
            self.step_s, self.epoch_step_s = None, []
            if index not in self.ends_by:  # its share of what is left after its one-time pass (features), not
                share, used = self._share(index), self.used()  # before it: the pass is no epoch's to repay
                self.ends_by[index] = used + share * (self.budget_s * (1 - MARGIN) - used)
        else:
            self.epoch_ends.append(now - self.last_step)
            if index in self.plans:
                self._apply(self._decide(self._refit))
        self.epoch_start, self.epoch_steps = now, 0

    def on_step_end(self, trainer, step: StepEnd):
        now = time.perf_counter()
        self.steps_seen, self.epoch_steps, self.last_step = self.steps_seen + 1, self.epoch_steps + 1, now
        if self.steps_seen == WARMUP_STEPS:
            self.timed_from = now
        epoch_ends = trainer.state.step_in_epoch >= trainer.steps_per_epoch
        if self.measured and self.index in self.plans and not epoch_ends and \
                trainer.state.step_in_epoch % max(1, trainer.steps_per_epoch // CHECKS_PER_EPOCH) == 0:
            if self.epoch_steps >= WARMUP_STEPS:  # a long epoch is re-checked within: by its steps so far
                self.step_s = (now - self.epoch_start) / self.epoch_steps
            self._apply(self._decide(self._refit))
            return
        if self.measured or not (self.steps_seen == WARMUP_STEPS + TIMED_STEPS or epoch_ends):
            return
        self.measured = True
        timed = self.steps_seen - WARMUP_STEPS
        self.step_s = max((now - self.timed_from) / timed if timed > 0 else (now - self.epoch_start) / self.epoch_steps,
                          1e-6)
        self._apply(self._decide(self._refit if self.index in self.plans else self._plan))
        self.epoch_start += time.perf_counter() - now  # the epoch's step time leaves the validation probe out

    def on_epoch_end(self, trainer, row, best):
        if self.epoch_steps:
            self.epoch_step_s.append((self.last_step - self.epoch_start) / self.epoch_steps)
            self.step_s = mean(self.epoch_step_s[-3:])
        plan = self.plans.get(self.index)
        if plan is not None:
            row.update(planned_epochs=trainer.plan.epochs, planned_steps=plan["end_step"],
                       planned_end=self.clock_time(plan["ends_at"]))
        self.mark = self.used()
        self._use_steps_per_epoch()  # the next epoch's, which may be another phase's

    # -- decisions (rank 0's) and what every rank does with them
    def _decide(self, decide) -> Optional[dict]:
        return main_process_choice(decide() or None if self.trainer.ddp.main else None, self.trainer.ddp)

    def _apply(self, decision: Optional[dict]) -> None:
        if not decision:
            return
        if "error" in decision:
            raise VitftError(decision["error"])
        self.plans[decision["index"]] = decision["plan"]
        self._install()
        self.trainer.scheduler.step_update(self.trainer.state.global_step)

    def _plan(self) -> dict:
        """A phase's plan from its first steps: how many epochs of how many steps, and its schedule."""
        trainer, index = self.trainer, self.index
        state, cfg = trainer.state, trainer.cfg
        done = state.step_in_epoch  # steps of the phase's first epoch behind (with their one-time passes)
        epoch_end_s = self._validation_s() + self._save_s()
        seconds = self.ends_by[index] - self.used()
        behind = state.epoch - trainer.plan.phases[index][0]  # the phase's epochs done by a run without a budget
        cap = self.caps[index] - behind
        fitted = fit(seconds, self.step_s, epoch_end_s, cap, self.full_steps, done)
        shortest = (max(done, 1) - done) * self.step_s + epoch_end_s  # one epoch, of the steps already done
        if fitted is None and self.used() + shortest <= self.budget_s * (1 - MARGIN):
            fitted = 1, max(done, 1)  # a share too small for an epoch end: the phase still takes its one epoch
            self.ends_by[index] = self.used() + shortest
        if fitted is None:
            need = self.used() + (self.full_steps - done) * self.step_s + epoch_end_s
            return {"error": f"--time-budget {cfg.time_budget:g} min is too short: {self.used():.2g} s went to "
                             f"setting up and the first {done} step(s), a step takes {self.step_s:.2g} s and an "
                             f"epoch end (validation, saving) ~{epoch_end_s:.1f} s; give it at least "
                             f"{need / 60 / (1 - MARGIN):.2g} min"}
        epochs, steps = fitted
        provisional = self.provisional[index]
        warmup = fitted_warmup_epochs(cfg.warmup_epochs, epochs, steps) * steps if provisional.warmup_t else 0
        first_step = state.global_step - done
        ends_at = self.used() + (epochs * steps - done) * self.step_s + epochs * epoch_end_s
        plan = {"first_epoch": state.epoch - behind, "first_step": first_step, "epochs": behind + epochs,
                "steps_per_epoch": steps, "steps": epochs * steps, "warmup_steps": warmup,
                "lr": provisional.base_values[0], "refits": [],
                "end_step": first_step + epochs * steps, "ends_at": ends_at, "step_s": self.step_s,
                "epoch_end_s": epoch_end_s}
        phase = f" (phase {index + 1}, {type(trainer.phase).__name__})" if sum(map(bool, self.caps)) > 1 else ""
        capped = " (--epochs caps it)" if (epochs, steps) == (cap, self.full_steps) else ""
        log.info("time budget: %s img/s measured over the first steps (%.3g s a step), an epoch end (validation, "
                 "saving) ~%.1f s; plan%s: %d epoch%s x %d steps = %d steps%s, warmup %d steps, ending at %s "
                 "(%.3g of %g min)", format_rate(trainer.effective_batch / self.step_s), self.step_s, epoch_end_s,
                 phase, epochs, "s" * (epochs != 1), steps, epochs * steps, capped, round(warmup),
                 self.clock_time(ends_at), ends_at / 60, cfg.time_budget)
        return {"index": index, "plan": plan}

    def _refit(self) -> Optional[dict]:
        """The plan of this phase re-checked with the latest timings: unchanged where the rest still fits, else
        ending earlier, with a cosine from here to min_lr at the new end."""
        trainer, index = self.trainer, self.index
        state, plan = trainer.state, dict(self.plans[self.index])
        step_s = self.step_s or plan["step_s"]
        # the first epoch end of a process pays one-time costs (imports, first writes): the later ones tell
        epoch_end_s = mean(self.epoch_ends[1:]) if len(self.epoch_ends) > 1 else plan["epoch_end_s"]
        done, left = state.step_in_epoch, plan["first_epoch"] + plan["epochs"] - state.epoch
        need = (left * plan["steps_per_epoch"] - done) * step_s + left * epoch_end_s
        seconds = self.ends_by[index] - self.used()
        if need <= seconds + MARGIN / 2 * self.budget_s or left < 1:
            return None
        epochs, steps = fit(seconds, step_s, epoch_end_s, left, plan["steps_per_epoch"], done,
                            whole_epochs=True) or (1, done + 1)
        end = state.global_step + epochs * steps - done
        if end >= plan["end_step"] or end <= state.global_step:
            return None
        group = trainer.optimizer.param_groups[-1]
        plan["refits"] = [*plan["refits"], [state.global_step, end, group["lr"] / group.get("lr_scale", 1.0)]]
        plan.update(epochs=state.epoch - plan["first_epoch"] + epochs, steps_per_epoch=steps, end_step=end,
                    ends_at=self.used() + (epochs * steps - done) * step_s + epochs * epoch_end_s)
        log.warning("time budget: the run is slower than planned (%.3g s a step, an epoch end %.1f s): the schedule "
                    "now ends after %d epochs of this phase, at step %d (was %d), ending at %s; its cosine is "
                    "re-fitted from step %d", step_s, epoch_end_s, plan["epochs"], end, self.plans[index]["end_step"],
                    self.clock_time(plan["ends_at"]), state.global_step)
        return {"index": index, "plan": plan}

    # -- the plans at work
    def _install(self) -> None:
        """Phase lengths, the schedule and the current steps per epoch, from the plans."""
        trainer = self.trainer
        for index, plan in self.plans.items():
            trainer.plan.resize(index, plan["epochs"])
        segments, step, min_lr = [], 0, trainer.cfg.min_lr
        for index, scheduler in self.provisional.items():
            plan = self.plans.get(index)
            if plan is None:
                segments.append((step, scheduler))
                step += self.caps[index] * self.full_steps
                continue
            optimizer = trainer.optimizer
            segments.append((plan["first_step"], cosine(optimizer, plan["lr"], plan["steps"], plan["warmup_steps"],
                                                        min_lr)))
            segments += [(first, cosine(optimizer, lr, end - first, 0, min_lr)) for first, end, lr in plan["refits"]]
            step = plan["end_step"]
        trainer.scheduler.phases = segments
        self._use_steps_per_epoch()

    def _use_steps_per_epoch(self) -> None:
        trainer = self.trainer
        plan = self.plans.get(self._phase_index(trainer.state.epoch))
        trainer.steps_per_epoch = plan["steps_per_epoch"] if plan else self.full_steps
        trainer.batches_per_epoch = trainer.steps_per_epoch * trainer.cfg.accum_steps

    def _phase_index(self, epoch: Optional[int] = None) -> int:
        phase = self.trainer.plan.at(self.trainer.state.epoch if epoch is None else epoch)
        return next(i for i, (_, p) in enumerate(self.trainer.plan.phases) if p is phase)

    def _share(self, index: int) -> float:
        """The part of the time left that phase `index` may take: `budget_head_share` for a head phase before
        others, else its part of the epochs left (the phases after it keep theirs)."""
        later = sum(self.caps[index:])
        head_share = self.trainer.cfg.budget_head_share
        if index == 0 and head_share is not None and later > self.caps[0]:
            return head_share
        return self.caps[index] / later if later else 1.0

    def _validation_s(self) -> float:
        """A validation pass's seconds (twice with an EMA), from timing its first batches."""
        trainer = self.trainer
        total = len(trainer.val_set) if trainer.val_set is not None else 0
        model = trainer.model  # unwrapped: rank 0 alone runs it, and DDP's forward would wait for the others
        start, seen = time.perf_counter(), 0
        model.eval()
        with torch.inference_mode():
            for _, targets in islice(trainer.plan.at(trainer.state.epoch).logits(trainer, model), PROBE_BATCHES):
                seen += len(targets)
        model.train()
        return (time.perf_counter() - start) * total / max(seen, 1) * (2 if trainer.ema is not None else 1)

    def _save_s(self) -> float:
        """An epoch end's saving, until measured: the best model, the checkpoint (and the optimizer's state)."""
        params = sum(p.numel() for p in self.trainer.model.parameters())
        return SAVE_S + 16 * params / SAVE_BYTES_PER_S

"""What happens around the steps and epochs of a run, one concern per callback (as Lightning's callbacks and the
HF Trainer's TrainerCallback): metrics.csv and curves, trackers (TensorBoard, MLflow), the best-model saver, the
progress bar and epoch lines, early stopping and the checkpointer.

The trainer calls every hook of every callback in order; a callback that writes files is only given to rank 0.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional
from urllib.parse import urlsplit

import torch.nn as nn

from ..errors import VitftError
from ..progress import format_rate
from ..run_folder import RunFolder
from ..weights.download import endpoint_unreachable
from .loop import StepEnd
from .objective import metric_name, selection_metric

if TYPE_CHECKING:
    from ..progress import ProgressBar
    from .trainer import Trainer

log = logging.getLogger("vitft")
TRACKERS = ("tensorboard", "mlflow")


class Callback:
    """Hooks, each a no-op here: a callback overrides those it needs."""

    def on_run_start(self, trainer: Trainer) -> None:
        pass

    def on_epoch_start(self, trainer: Trainer) -> None:
        pass

    def on_step_end(self, trainer: Trainer, step: StepEnd) -> None:
        pass

    def on_epoch_end(self, trainer: Trainer, row: dict, best: Optional[nn.Module]) -> None:
        """`row` is metrics.csv's new row; `best` the model that just validated best so far, else None."""

    def on_run_end(self, trainer: Trainer, status: str) -> None:
        """`status`: finished, interrupted or failed."""


class Callbacks(Callback):
    """Callbacks called in turn."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = callbacks

    def on_run_start(self, trainer):
        for callback in self.callbacks:
            callback.on_run_start(trainer)

    def on_epoch_start(self, trainer):
        for callback in self.callbacks:
            callback.on_epoch_start(trainer)

    def on_step_end(self, trainer, step):
        for callback in self.callbacks:
            callback.on_step_end(trainer, step)

    def on_epoch_end(self, trainer, row, best):
        for callback in self.callbacks:
            callback.on_epoch_end(trainer, row, best)

    def on_run_end(self, trainer, status):
        for callback in self.callbacks:
            callback.on_run_end(trainer, status)


class EarlyStopping(Callback):
    """Stop when val top-1 (multi-label: mAP) has not improved for `patience` epochs; the best model is saved."""

    def __init__(self, patience: int):
        self.patience = patience

    def on_epoch_end(self, trainer, row, best):
        state = trainer.state
        if state.epoch - state.best_epoch >= self.patience and state.epoch < trainer.plan.epochs:
            trainer.stop(f"early stopping: val {metric_name(trainer.multi_label)} has not improved for "
                         f"{self.patience} epoch"
                         f"{'s' * (self.patience != 1)} (best {100 * state.best_top1:.1f}% at epoch "
                         f"{state.best_epoch})")


class BestModelSaver(Callback):
    """The model that validates best so far, saved as config.json + model.safetensors with what it learnt from."""

    def __init__(self, run: RunFolder):
        self.run = run

    def on_epoch_end(self, trainer, row, best):
        if best is None:
            return
        cfg, splits = trainer.cfg, trainer.splits
        self.run.save_model(best, {
            "train": cfg.to_dict(),
            "data": {"root": str(cfg.data), "layout": splits.layout, "classes": trainer.classes,
                     "counts": splits.class_counts()},
            "best": {"epoch": trainer.state.best_epoch,
                     selection_metric(trainer.multi_label): trainer.state.best_top1}})


class MetricsLog(Callback):
    """metrics.csv after every epoch, and curves.png with every checkpoint (drawing takes longer than a cached-
    features epoch)."""

    def __init__(self, run: RunFolder):
        self.run = run

    def on_epoch_end(self, trainer, row, best):
        self.run.write_metrics(trainer.state.rows)
        if trainer.checkpoint_due:
            self.run.write_curves(trainer.state.rows)


class Progress(Callback):
    """A progress bar per epoch, and a line at its end."""

    def __init__(self, progress: ProgressBar, main: bool):
        self.progress, self.main, self.task = progress, main, None

    def on_epoch_start(self, trainer):
        self.task = self.progress.add_task(f"epoch {trainer.state.epoch + 1}/{trainer.plan.epochs}",
                                           total=trainer.steps_per_epoch, completed=trainer.state.step_in_epoch,
                                           info="", unit=" steps")

    def on_step_end(self, trainer, step):
        rate = step.images / max(step.seconds, 1e-9) * trainer.ddp.world
        info = f"loss {step.mean_loss:.4f} lr {step.lr:.2e} {format_rate(rate)} img/s"
        self.progress.update(self.task, advance=1, info=info)

    def on_epoch_end(self, trainer, row, best):
        self._remove()
        if not self.main:
            return
        top5 = f" top-5 {100 * row['val_top5']:.1f}%" if row.get("val_top5") is not None else ""
        if "val_mAP" in row:
            top5 += f" mAP {100 * row['val_mAP']:.1f}% F1 {100 * row['val_f1_macro']:.1f}%"
        ema = " (EMA)" if row.get("ema") else ""
        log.info("epoch %d/%d: train loss %.4f | val loss %.4f top-1 %.1f%%%s%s | %s img/s, %.0fs",
                 row["epoch"], trainer.plan.epochs, row["train_loss"], row["val_loss"], 100 * row["val_top1"], top5,
                 ema, format_rate(row["images_per_s"]), row["seconds"])

    def on_run_end(self, trainer, status):
        self._remove()
        if self.main and trainer.stop_reason:
            log.info("%s; the best model (epoch %d) is in %s", trainer.stop_reason, trainer.state.best_epoch,
                     trainer.folder.path)

    def _remove(self) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
            self.task = None


class Checkpointer(Callback):
    """last/checkpoint.pt every `save_every` steps on images, and at the epoch ends the phase asks for."""

    def __init__(self, save_every: Optional[int]):
        self.save_every = save_every

    def on_step_end(self, trainer, step):
        if self.save_every and trainer.phase.step_checkpoints and trainer.state.global_step % self.save_every == 0:
            trainer.save_checkpoint()

    def on_epoch_end(self, trainer, row, best):
        if trainer.checkpoint_due:
            trainer.save_checkpoint()


# ---- trackers ---------------------------------------------------------------------------------------
class TensorBoard(Callback):
    """train/loss and train/lr per step, val/loss and val/top1 per epoch, in the run folder's tensorboard/."""

    def __init__(self, run: RunFolder):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise VitftError("--log-with tensorboard needs the tensorboard package: pip install tensorboard") from err
        self.run, self.make_writer, self.writer = run, SummaryWriter, None

    def on_run_start(self, trainer):
        # made when the run starts: nothing may be written into a run folder being replaced
        self.writer = self.make_writer(str(self.run.tensorboard_dir))

    def on_step_end(self, trainer, step):
        self.writer.add_scalar("train/loss", step.loss, trainer.state.global_step)
        self.writer.add_scalar("train/lr", step.lr, trainer.state.global_step)

    def on_epoch_end(self, trainer, row, best):
        for key in ("val_loss", "val_top1"):
            self.writer.add_scalar(f"val/{key[4:]}", row[key], trainer.state.epoch)

    def on_run_end(self, trainer, status):
        if self.writer is not None:
            self.writer.close()


class MLflow(Callback):
    """An MLflow run (experiment "vitft") with the options as params, each epoch's metrics and curves.png: in
    MLFLOW_TRACKING_URI, else in the run folder's mlruns/ (an SQLite store and its artifacts, MLflow's local
    backend). The run folder remembers the MLflow run: a resume continues it, so one training is one MLflow run."""

    def __init__(self, run: RunFolder):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise VitftError("--log-with mlflow needs the mlflow package: pip install 'vit-finetune[mlflow]' "
                             "(pip install -e '.[mlflow]' in a checkout)") from err
        self.run, self.make_client, self.client, self.run_id = run, MlflowClient, None, None
        self.server_uri = os.environ.get("MLFLOW_TRACKING_URI") or None  # None: the run folder's own store
        # checked now, before anything is written: MlflowClient retries an unreachable server for minutes, silently
        if self.server_uri and urlsplit(self.server_uri).scheme in ("http", "https"):
            unreachable = endpoint_unreachable(self.server_uri)
            if unreachable:
                raise VitftError(f"MLflow tracking server {self.server_uri} cannot be reached ({unreachable}); "
                                 "start it, or unset MLFLOW_TRACKING_URI to log into the run folder's mlruns/")

    def on_run_start(self, trainer):
        from mlflow.entities import Param

        uri, artifacts = self.server_uri, None
        if not uri:
            uri, artifacts = self.run.mlflow_store()
        self.client = self.make_client(tracking_uri=uri)
        self.run_id = (self._continued_run() if trainer.resumed else None) or self._new_run(artifacts)
        # MLflow refuses to change a param's value: a resume logs only the options the run does not have yet
        logged = self.client.get_run(self.run_id).data.params
        params = [Param(key, str(value)[:500])  # MLflow's limit for a param's value
                  for key, value in sorted(trainer.cfg.to_dict().items()) if key not in logged]
        if params:
            self.client.log_batch(self.run_id, params=params)

    def _new_run(self, artifacts: Optional[str]) -> str:
        experiment = self.client.get_experiment_by_name("vitft")
        experiment_id = experiment.experiment_id if experiment else \
            self.client.create_experiment("vitft", artifact_location=artifacts)
        run_id = self.client.create_run(experiment_id, run_name=self.run.path.name).info.run_id
        self.run.write_mlflow_run(self.server_uri, run_id)
        return run_id

    def _continued_run(self) -> Optional[str]:
        """The MLflow run this run folder logged to, running again; None (saying why) when it is not there."""
        from mlflow.exceptions import MlflowException

        record = self.run.mlflow_run()
        run_id = record.get("run_id")
        if not run_id:
            return None
        where = record.get("tracking_uri") or "the run folder's mlruns/"
        if record.get("tracking_uri") != self.server_uri:
            log.info("this run logged to MLflow in %s: the resume starts a new MLflow run", where)
            return None
        try:
            found = self.client.get_run(run_id)
        except MlflowException:
            found = None
        if found is None or found.info.lifecycle_stage == "deleted":
            log.warning("MLflow run %s is gone from %s: the resume starts a new MLflow run", run_id, where)
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def on_epoch_end(self, trainer, row, best):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, row["epoch"]) for key, value in row.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "epoch"]
        self.client.log_batch(self.run_id, metrics=metrics)

    def on_run_end(self, trainer, status):
        if self.run_id is None:
            return
        if self.run.curves_file.is_file():
            self.client.log_artifact(self.run_id, str(self.run.curves_file))
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED"))


def trackers(cfg) -> list[str]:
    """The trackers a run logs to: --log-with's names, and tensorboard for --tensorboard (an alias)."""
    names = [name.strip().lower() for name in (cfg.log_with or "").split(",") if name.strip()]
    if cfg.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise VitftError(f"unknown tracker {', '.join(unknown)} in --log-with; use {', '.join(TRACKERS)} "
                         "(comma-separated)")
    return names


def make_tracker(name: str, run: RunFolder) -> Callback:
    return {"tensorboard": TensorBoard, "mlflow": MLflow}[name](run)

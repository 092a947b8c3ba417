"""The run folder's format, in one place: every file name in it, and the only code that reads or writes them.

A run folder holds the effective options (train_config.json), the best model (config.json + model.safetensors,
loadable by timm and vitft, its config's "vitft" key saying what it was trained on; a LoRA run's with the adapter
merged in, and the adapter itself in adapter/ as peft writes it), metrics.csv and curves.png,
a resumable checkpoint (last/checkpoint.pt), tracker logs (tensorboard/, mlruns/) and, once evaluated,
report.json; while a run runs, scratch/ may hold cached activations too large for memory. Nothing here imports
torch at module level: the command line reads a run without it.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Union

from .errors import VitftError
from .files import atomic_write

log = logging.getLogger("vitft")

PathLike = Union[str, os.PathLike]
CHECKPOINT = Path("last") / "checkpoint.pt"
ADAPTER_DIR = "adapter"  # a LoRA run's adapter: adapter_config.json + adapter_model.safetensors
METRIC_FIELDS = ["epoch", "train_loss", "val_loss", "val_top1", "val_top5", "lr", "images_per_s", "seconds",
                 "data_wait", "peak_mem_gb", "val_images", "val_balanced_accuracy", "val_f1_macro",
                 "val_mAP"]
PLAN_FIELDS = ["planned_epochs", "planned_steps", "planned_end"]  # a --time-budget's plan, in runs that have one
CURVES = "curves.png"
CARD_IMAGES = (CURVES, "confusion_matrix.png")  # the pictures a model card embeds, when the run has them


class RunFolder:
    """A run (or model) folder: its paths, and reading and writing the files `vitft finetune` and `evaluate`
    leave there."""

    def __init__(self, path: PathLike):
        self.path = Path(path).expanduser()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return str(self.path)

    # -- paths
    @property
    def train_config_file(self) -> Path:
        return self.path / "train_config.json"

    @property
    def checkpoint_file(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.csv"

    @property
    def curves_file(self) -> Path:
        return self.path / CURVES

    @property
    def model_config_file(self) -> Path:
        return self.path / "config.json"

    @property
    def adapter_dir(self) -> Path:
        return self.path / ADAPTER_DIR

    @property
    def report_file(self) -> Path:
        return self.path / "report.json"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def mlflow_dir(self) -> Path:
        return self.path / "mlruns"

    def mlflow_store(self) -> tuple[str, str]:
        """(tracking URI, artifact URI) of the run's own MLflow store in mlruns/: SQLite, MLflow's local backend."""
        folder = self.mlflow_dir.resolve()
        folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()

    @property
    def mlflow_run_file(self) -> Path:
        return self.mlflow_dir / "run.json"

    def write_mlflow_run(self, tracking_uri: Optional[str], run_id: str) -> None:
        """The MLflow run this run logs to, for a resume to continue it; `tracking_uri` None: the run folder's own
        store (whose URI changes when the folder is moved)."""
        record = {"tracking_uri": tracking_uri, "run_id": run_id}
        atomic_write(self.mlflow_run_file, lambda tmp: tmp.write_text(json.dumps(record, indent=2)))

    def mlflow_run(self) -> dict:
        """The record write_mlflow_run left: tracking_uri and run_id; {} when there is none readable."""
        return _read_json(self.mlflow_run_file) or {}

    # -- what is there
    def is_run(self) -> bool:
        """Whether the folder was written by `vitft finetune` (what --overwrite may replace)."""
        return self.train_config_file.is_file() or self.checkpoint_file.is_file()

    def is_empty(self) -> bool:
        return not self.path.exists() or not any(self.path.iterdir())

    def check_new(self, overwrite: bool, data: Optional[PathLike] = None) -> None:
        """A new run may write here: the folder is new or empty, or --overwrite replaces a run folder; never a file,
        and never inside the data (its pictures would become a class of the next scan)."""
        if self.path.exists() and not self.path.is_dir():
            raise VitftError(f"--output {self.path} is a file, not a folder; pick another --output")
        if data and _inside(self.path, Path(data)):
            raise VitftError(f"--output {self.path} is inside --data {data}: the run's files would be read as "
                             "images of a class; pick an --output outside the data folder")
        if self.is_empty():
            return
        if not self.is_run():
            raise VitftError(f"{self.path} already exists and is not a vitft run folder (neither --overwrite nor "
                             "--resume applies to it); pick another --output")
        if not overwrite:
            raise VitftError(f"run folder {self.path} already exists; pass --overwrite to replace it, "
                             f"or --resume {self.path} to continue it")

    def start(self) -> Optional[Path]:
        """Create the folder of a run that is ready to start; a run it replaces (checked by check_new) is moved
        aside first and returned, for the caller to delete when the new run ends: a crash never leaves neither."""
        replaced = None
        if not self.is_empty():
            replaced = self.path.with_name(f"{self.path.name}.replaced-{datetime.now():%Y%m%d-%H%M%S-%f}")
            self.path.rename(replaced)
            log.info("moved the run being replaced to %s; it is deleted when this run ends", replaced)
        self.path.mkdir(parents=True, exist_ok=True)
        return replaced

    def require_model(self) -> None:
        """A folder with a saved model (config.json), or a VitftError saying what to pass instead."""
        if not self.path.is_dir():
            raise VitftError(f"run folder {self.path} not found")
        if not self.model_config_file.is_file():
            raise VitftError(f"{self.path} has no config.json; pass a run folder written by `vitft finetune` "
                             "(or any folder written by save_pretrained)")

    # -- train_config.json
    def write_train_config(self, options: dict) -> None:
        atomic_write(self.train_config_file, lambda tmp: tmp.write_text(json.dumps(options, indent=2)))

    def train_config(self) -> dict:
        """The run's effective options; {} when the folder has none readable."""
        try:
            value = json.loads(self.train_config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    # -- the checkpoint
    def write_checkpoint(self, state: dict) -> None:
        import torch

        atomic_write(self.checkpoint_file, lambda tmp: torch.save(state, tmp))

    def read_checkpoint(self) -> dict:
        """last/checkpoint.pt, read with weights_only=True: a run folder from someone else cannot run code."""
        import torch

        path = self.checkpoint_file
        if not path.is_file():
            if self.train_config_file.is_file():  # a run killed before its first checkpoint
                raise VitftError(f"{self.path} has no {CHECKPOINT} yet: the run stopped before its first checkpoint "
                                 f"(an epoch end, or --save-every); start it again with --output {self.path} "
                                 "--overwrite")
            raise VitftError(f"{self.path} has no {CHECKPOINT} to resume from; is it a vitft run folder?")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001
            why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise VitftError(f"cannot read {path} as a checkpoint of tensors and plain values (it is never "
                             f"unpickled with code): {why}") from err

    # -- metrics.csv and curves.png
    def write_metrics(self, rows: list[dict]) -> None:
        buf = io.StringIO()
        planned = [name for name in PLAN_FIELDS if any(name in row for row in rows)]
        writer = csv.DictWriter(buf, fieldnames=METRIC_FIELDS + planned, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(self.metrics_file, lambda tmp: tmp.write_text(buf.getvalue()))

    def read_metrics(self) -> list[dict]:
        """metrics.csv's rows as strings by column; [] when the run has none."""
        if not self.metrics_file.is_file():
            return []
        with open(self.metrics_file, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))

    def write_curves(self, rows: list[dict]) -> None:
        from .tasks.plots import curves_figure, save_png

        save_png(curves_figure(rows), self.curves_file)

    # -- the model files
    def save_model(self, model, info: dict) -> None:
        """The best model so far: config.json + model.safetensors, `info` under the config's "vitft" key; an adapted
        model's adapter in adapter/ first, then the model with the adapter merged in."""
        from .weights.adapters import is_adapted, merged_copy, save_adapter
        from .weights.saving import save_pretrained

        if is_adapted(model):
            save_adapter(model, self.adapter_dir)
            model = merged_copy(model)
        save_pretrained(model, self.path, extra_config={"vitft": info})

    def model_config(self) -> dict:
        """config.json; {} when absent, unreadable (with a warning) or not a JSON object."""
        return _read_json(self.model_config_file) or {}

    def vitft_info(self) -> dict:
        """The defensive view of the model config's "vitft" key: train, data, best (each possibly empty)."""
        config = self.model_config()
        info = as_dict(config.get("vitft"))
        return {"config": config, "train": as_dict(info.get("train")), "data": as_dict(info.get("data")),
                "best": as_dict(info.get("best"))}

    def card_images(self) -> tuple[str, ...]:
        return tuple(name for name in CARD_IMAGES if (self.path / name).is_file())

    # -- scratch: large files a run needs while it runs, and deletes when it ends
    @property
    def scratch_dir(self) -> Path:
        return self.path / "scratch"

    def scratch_tensor(self, name: str, shape: tuple[int, ...], dtype):
        """A tensor memory-mapped to scratch/`name` (created, or replaced when a killed run left one): data larger
        than memory, paged in and out by the OS. Free it with remove_scratch(name) once it is dropped."""
        import math

        import torch

        path = self.scratch_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        return torch.from_file(str(path), shared=True, size=math.prod(shape), dtype=dtype).view(shape)

    def scratch_space(self) -> int:
        """Bytes free on the disk that scratch/ is (or would be) on."""
        import shutil

        folder = self.path.resolve()
        while not folder.exists():
            folder = folder.parent
        return shutil.disk_usage(folder).free

    def remove_scratch(self, name: str) -> None:
        """Delete scratch/`name`, and scratch/ once empty (a mapping still open keeps its pages until dropped)."""
        (self.scratch_dir / name).unlink(missing_ok=True)
        if self.scratch_dir.is_dir() and not any(self.scratch_dir.iterdir()):
            self.scratch_dir.rmdir()

    # -- report.json
    def write_report(self, text: str) -> None:
        atomic_write(self.report_file, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _inside(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or below it (symbolic links followed)."""
    path, folder = path.expanduser().resolve(), folder.expanduser().resolve()
    return path == folder or folder in path.parents


def _read_json(path: Path) -> Optional[dict]:
    """An optional JSON object: None when absent or unreadable (with a warning)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        log.warning("ignoring %s: cannot read it (%s)", path, err)
        return None
    if not isinstance(value, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return None
    return value


def as_dict(value: Any) -> dict:
    """`value` when it is a dict, else {} (a hand-edited config may hold anything)."""
    return value if isinstance(value, dict) else {}

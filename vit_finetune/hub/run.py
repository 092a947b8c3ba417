"""What export, the model card and push read from a run folder: its config.json's "vitft" key and report.json."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import VitftError

log = logging.getLogger("vitft")

PathLike = Union[str, os.PathLike]


def check_run(run_dir: PathLike) -> Path:
    """The run folder as a Path; a VitftError when it is missing or holds no saved model."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise VitftError(f"run folder {run} not found")
    if not (run / "config.json").is_file():
        raise VitftError(f"{run} has no config.json; pass a run folder written by `vitft finetune` "
                         "(or any folder written by save_pretrained)")
    return run


def _read_json(path: Path) -> Optional[dict]:
    """An optional JSON file of the run: None when absent or unreadable (with a warning)."""
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


def read_report(run: Path):
    """The run's evaluation report (report.json), if it has a readable one."""
    from ..evaluate import EvalReport

    if not (run / "report.json").is_file():
        return None
    try:
        return EvalReport.load(run / "report.json")
    except VitftError as err:
        log.warning("ignoring %s", err)
        return None


def as_dict(value: Any) -> dict:
    """`value` when it is a dict, else {} (a hand-edited config may hold anything)."""
    return value if isinstance(value, dict) else {}


def run_info(run: Path) -> dict:
    """The defensive view of the run's "vitft" config key: train, data, best (each possibly empty)."""
    config = _read_json(run / "config.json") or {}
    info = as_dict(config.get("vitft"))
    return {"config": config, "train": as_dict(info.get("train")), "data": as_dict(info.get("data")),
            "best": as_dict(info.get("best"))}

"""What export, the model card and push read from a run folder (through RunFolder) and its evaluation report."""
from __future__ import annotations

import logging
import os
from typing import Union

from ..errors import VitftError
from ..run_folder import RunFolder

log = logging.getLogger("vitft")

PathLike = Union[str, os.PathLike]


def check_run(run_dir: PathLike) -> RunFolder:
    """The run folder; a VitftError when it is missing or holds no saved model."""
    run = RunFolder(run_dir)
    run.require_model()
    return run


def read_report(run: RunFolder):
    """The run's evaluation report (report.json), if it has a readable single-label one."""
    from ..tasks.report import EvalReport

    if not run.report_file.is_file():
        return None
    if '"task": "multi-label"' in run.report_file.read_text(encoding="utf-8", errors="replace"):
        log.info("%s is a multi-label report: the card shows the validation mAP instead", run.report_file)
        return None
    try:
        return EvalReport.load(run.report_file)
    except VitftError as err:
        log.warning("ignoring %s", err)
        return None

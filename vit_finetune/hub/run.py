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
    """The run's evaluation report (report.json), if it has a readable one."""
    from ..tasks.report import EvalReport

    if not run.report_file.is_file():
        return None
    try:
        return EvalReport.load(run.report_file)
    except VitftError as err:
        log.warning("ignoring %s", err)
        return None

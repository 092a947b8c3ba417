"""`vitft demo`: the offline end-to-end path works and learns."""
import json

import pytest
from typer.testing import CliRunner

from vit_finetune.cli import app


@pytest.mark.slow  # trains for 10 epochs: about two minutes on a CPU
def test_demo_trains_evaluates_and_exports(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    for name in ("model.safetensors", "config.json", "metrics.csv", "curves.png", "report.json",
                 "confusion_matrix.png", "mistakes.png", "predictions.csv"):
        assert (run / name).is_file(), name
    assert (tmp_path / "export" / "README.md").is_file() and (tmp_path / "export" / "model.safetensors").is_file()
    report = json.loads((run / "report.json").read_text())
    assert report["accuracy"] > 0.9  # the generated patterns are easy: a working pipeline learns them

"""The `vitft` command line: start-up cost, help, off switches, exit codes, model search, run summary."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import make_images
from typer.testing import CliRunner

from vit_finetune import __version__
from vit_finetune.cli import _summary, app
from vit_finetune.config import TrainConfig
from vit_finetune.hub.onnx import INSTALL as ONNX_INSTALL

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "timm", "albumentations", "cv2", "matplotlib")
PANELS = ("Data", "Model", "Optimisation", "Augmentation", "Runtime", "Output")


def invoke(*args: str, columns: int = 200):
    logging.getLogger("vitft").handlers.clear()  # cli binds its handler to the first CliRunner's stderr
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


def _imported_by(code: str) -> list[str]:
    script = f"import sys\n{code}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.split()


@pytest.mark.parametrize("args", [["--help"], ["finetune", "--help"], ["evaluate", "--help"], ["--version"]])
def test_help_starts_without_torch(args):
    code = f"from vit_finetune.cli import app\ntry:\n    app({args!r})\nexcept SystemExit:\n    pass"
    assert _imported_by(code) == []


def test_import_is_lazy_and_the_public_api_still_works():
    assert _imported_by("import vit_finetune") == []
    assert "torch" in _imported_by("import vit_finetune as vf\nassert callable(vf.create_model)")
    code = ("import vit_finetune as vf, vit_finetune.tasks.evaluate, vit_finetune.tasks.explain\n"
            "assert callable(vf.evaluate) and callable(vf.explain) and vf.TrainConfig().epochs == 10\n"
            "assert vf.evaluate.__module__ == 'vit_finetune.tasks.evaluate'")
    _imported_by(code)


def test_figures_and_the_report_format_import_no_torch():
    imported = _imported_by("import vit_finetune.tasks.plots, vit_finetune.tasks.report")
    assert "torch" not in imported and "timm" not in imported


def test_finetune_help_groups_the_options_in_panels():
    result = invoke("finetune", "--help")
    assert result.exit_code == 0, result.output
    for panel in PANELS:
        assert f"─ {panel} ─" in result.output, panel
    assert "<bool>" not in result.output and "(default:" not in result.output
    assert "[default: 10]" in result.output  # TrainConfig.epochs
    assert "--no-cache" in result.output and "--no-freeze-backbone" in result.output


def test_every_option_of_every_command_has_help():
    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        for param in cmd.params:
            assert getattr(param, "help", None), f"vitft {name} {param.name} has no help"


def _commands() -> dict[str, object]:
    """Every help page: the group's ('') and each command's, by the arguments that show it."""
    group = typer.main.get_command(app)
    return {"": group, **group.commands}


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_help_shows_every_help_text_as_written():
    """typer reads help as rich markup: `pip install -e '.[onnx]'` lost `[onnx]`. Every command's and option's
    help text shows whole, brackets and all (on a line wide enough that nothing wraps)."""
    finetune = invoke("finetune", "--help", columns=200).output  # a docstring's line breaks are not kept
    assert "Options given on the command line override the recipe's; the others take the recipe's value, else the " \
           "default shown." in finetune
    export = _flat(invoke("export", "--help", columns=1000).output)
    assert f"Needs: {ONNX_INSTALL}." in export and "pip install -e '.[onnx]' in a clone of vitft" in export
    for name, cmd in _commands().items():
        shown = _flat(invoke(*name.split(), "--help", columns=1000).output)
        texts = [cmd.help, *(param.help for param in cmd.params)]
        texts += [sub.help.split("\n\n")[0] for sub in getattr(cmd, "commands", {}).values()]
        for text in filter(None, texts):
            assert _flat(text) in shown, f"vitft {name} --help: {text!r}"


def test_option_names_show_whole_at_80_columns():
    """At 80 columns rich cut `--max-steps-per-epoch` to `--max-steps-per-epo…`: the help column gives way."""
    for name, cmd in _commands().items():
        shown = invoke(*name.split(), "--help", columns=80).output
        assert "…" not in shown, f"vitft {name} --help cuts a word:\n{shown}"
        for option in (o for param in cmd.params for o in [*param.opts, *param.secondary_opts]):
            if option.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", shown), f"vitft {name}: {option}"


def test_finetune_options_are_the_train_config_fields_with_a_panel():
    options = {p.name for p in typer.main.get_command(app).commands["finetune"].params} - {"recipe", "resume"}
    assert options == {f.name for f in TrainConfig.options()}
    assert "min_lr" not in options and "lr" in options  # a recipe key only, and an option


def test_every_boolean_a_recipe_sets_has_an_off_switch():
    options = {p.name: p for p in typer.main.get_command(app).commands["finetune"].params}
    booleans = [o.name for o in TrainConfig.options() if isinstance(getattr(TrainConfig(), o.name), bool)]
    assert {"cache", "compile", "freeze_backbone", "strong_aug", "grad_checkpointing", "tensorboard", "quiet",
            "overwrite", "ema"} <= set(booleans)
    for field in booleans:
        assert options[field].secondary_opts == ["--no-" + field.replace("_", "-")], field


def test_usage_names_arguments_in_capitals():
    result = invoke("predict", "--help")
    assert "predict [OPTIONS] MODEL INPUTS..." in result.output and "{" not in result.output


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"vitft {__version__}"


def test_exit_codes_runtime_error_1_usage_error_2(tmp_path):
    runtime = invoke("evaluate", str(tmp_path / "missing" / "model"), "--data", str(tmp_path))
    assert runtime.exit_code == 1 and "error:" in runtime.output and "Traceback" not in runtime.output
    usage = invoke("evaluate", "x", "--no-such-option")
    assert usage.exit_code == 2


def test_models_matches_substrings_case_insensitively():
    dinov2 = invoke("models", "dinov2")
    assert dinov2.exit_code == 0 and "vit_small_patch14_dinov2" in dinov2.output
    assert "vit_base_patch16_224 " not in dinov2.output
    deit = invoke("models", "DeiT")
    assert "deit_tiny_patch16_224" in deit.output and "vit_base_patch16_224 " not in deit.output
    glob = invoke("models", "vit_b*")
    assert "vit_b_16" in glob.output and "deit" not in glob.output
    none = invoke("models", "no-such-model")
    assert none.exit_code == 1 and "no architecture" in none.output


def test_flags_override_the_recipe_both_ways_and_the_next_command_is_printed(tmp_path):
    data = make_images(tmp_path / "data", {"red": 6, "blue": 6}, size=32)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"data: {data}\npretrained: none\nmodel: vit_tiny_patch16_224\nepochs: 3\nbatch_size: 4\n"
                      "model_kwargs: {img_size: 32, patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2}\n"
                      "cache: true\nstrong_aug: true\nworkers: 0\nval_split: 0.34\n")
    out = tmp_path / "run"
    result = invoke("finetune", "--recipe", str(recipe), "--epochs", "1", "--no-cache", "--no-strong-aug",
                    "--max-steps-per-epoch", "1", "--output", str(out), "--quiet", columns=400)
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["epochs"] == 1 and saved["cache"] is False and saved["strong_aug"] is False  # the flags
    assert saved["batch_size"] == 4 and saved["val_split"] == 0.34  # the recipe, where no flag is given
    assert f"next: `vitft evaluate {out} --data {data}`" in result.output


def test_run_summary_has_no_empty_header_and_counts_epochs(capsys, tmp_path):
    from vit_finetune.engine.trainer import RunResult

    rows = [{"epoch": 1, "val_top1": 0.5, "train_loss": 1.0}]
    _summary(RunResult(tmp_path, 0.5, 1, 1, True, rows))
    err = capsys.readouterr().err
    assert "after 1 epoch;" in err and f"vitft finetune --resume {tmp_path}" in err
    assert "━" not in err and "┃" not in err  # no header row (an empty one before)
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].split()[:2] == ["run", "folder"]


def test_paths_in_printed_commands_paste_back_into_a_shell():
    """The `next: vitft evaluate RUN` hint: a name with bytes that are not UTF-8 (or quotes, spaces) pastes into bash
    as the same bytes, never as a Python surrogate escape."""
    from vit_finetune.cli import _quoted

    for raw in (b"/tmp/run \xff \xc3\xbc", b"/tmp/it's a run", b"plain"):
        word = _quoted(os.fsdecode(raw))
        word.encode("utf-8")  # printable: no lone surrogate, which a terminal shows as \udcff
        echoed = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True).stdout
        assert echoed == raw, word

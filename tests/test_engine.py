"""The trainer's parts seen from a run: early stopping, trackers (MLflow, TensorBoard) as callbacks, and
`finetune(recipe=...)` merging a recipe with options as the command line does."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from conftest import make_images

from vit_finetune.engine.api import finetune
from vit_finetune.errors import VitftError
from vit_finetune.run_folder import RunFolder

# a linear probe on cached features: epochs of a fraction of a second
PROBE = dict(epochs=2, batch_size=4, lr=0.02, workers=0, warmup_epochs=0, quiet=True, freeze_backbone=True,
             val_split=0.2)


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("two"), {"buildings": 10, "forest": 10})


def test_patience_stops_the_run_says_why_and_keeps_the_best(two_classes, tiny_model_dir, tmp_path, caplog):
    out = tmp_path / "run"
    caplog.set_level("INFO", logger="vitft")
    # an LR too small to change a prediction: val top-1 stays where epoch 1 left it
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), patience=2,
                      **dict(PROBE, epochs=10, lr=1e-12))
    assert result.epochs_done == 3 and not result.interrupted
    assert result.stop_reason.startswith("early stopping: val top-1 has not improved for 2 epochs")
    assert any(r.getMessage().startswith("early stopping") and str(out) in r.getMessage() for r in caplog.records)
    run = RunFolder(out)
    assert json.loads(run.model_config_file.read_text())["vitft"]["best"]["epoch"] == result.best_epoch == 1
    assert [int(r["epoch"]) for r in run.read_metrics()] == [1, 2, 3]
    assert run.read_checkpoint()["epoch"] == 3  # checkpointed at the stop, though head-phase epochs are throttled
    assert run.curves_file.is_file()


def test_patience_must_be_positive(two_classes, tiny_model_dir, tmp_path):
    with pytest.raises(VitftError, match="--patience must be at least 1"):
        finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(tmp_path / "x"), patience=0,
                 **PROBE)


def test_mlflow_logs_params_metrics_and_curves_to_the_run_folder(two_classes, tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), log_with="mlflow", **PROBE)
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("vitft").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["epochs"] == "2" and run.data.params["freeze_backbone"] == "True"
    history = client.get_metric_history(run.info.run_id, "val_top1")
    rows = RunFolder(out).read_metrics()
    assert [(m.step, m.value) for m in history] == [(int(r["epoch"]), float(r["val_top1"])) for r in rows]
    assert {"train_loss", "val_loss", "lr"} <= set(run.data.metrics)
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curves.png"]


def test_an_unreachable_mlflow_server_is_one_line_before_anything_is_written(two_classes, tiny_model_dir, tmp_path,
                                                                            monkeypatch):
    """MlflowClient retries an unreachable server for minutes, silently: a fast check fails first."""
    import socket
    import time

    from vit_finetune.engine.callbacks import make_tracker
    from vit_finetune.weights.download import HUB_CONNECT_TIMEOUT, HUB_LOOKUP_TIMEOUT

    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # without the check, fail (not hang) in MLflow
    unreachable = rf"MLflow tracking server {uri} cannot be reached \(.*\); start it, or unset MLFLOW_TRACKING_URI"
    out = tmp_path / "run"
    with pytest.raises(VitftError, match=unreachable):
        finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), log_with="mlflow", **PROBE)
    assert not out.exists()
    start = time.perf_counter()
    with pytest.raises(VitftError, match=unreachable):
        make_tracker("mlflow", RunFolder(out))  # what the trainer does when it is made
    assert time.perf_counter() - start < HUB_LOOKUP_TIMEOUT + HUB_CONNECT_TIMEOUT


def test_a_resumed_run_continues_its_mlflow_run(two_classes, tiny_model_dir, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from vit_finetune.engine.callbacks import MLflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), log_with="mlflow", **PROBE)
    statuses, log_epoch = [], MLflow.on_epoch_end

    def log_epoch_and_status(tracker: MLflow, trainer, row, best) -> None:
        statuses.append(tracker.client.get_run(tracker.run_id).info.status)
        log_epoch(tracker, trainer, row, best)

    monkeypatch.setattr(MLflow, "on_epoch_end", log_epoch_and_status)
    finetune(resume=out, epochs=3)
    assert statuses == ["RUNNING"]  # the finished MLflow run runs again while the resume trains
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("vitft").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val_top1")
    rows = RunFolder(out).read_metrics()
    assert [(m.step, m.value) for m in history] == [(int(r["epoch"]), float(r["val_top1"])) for r in rows]
    assert [m.step for m in history] == [1, 2, 3]
    assert run.data.params["epochs"] == "2"  # MLflow keeps a param's first value: the resume does not change it


def test_a_missing_tracker_package_is_one_line_before_anything_is_written(two_classes, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    out = tmp_path / "run"
    options = dict(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), **PROBE)
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")] + ["mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed (also after another test imported it)
    missing = r"--log-with mlflow needs the mlflow package: .*pip install -e '\.\[mlflow\]'"
    with pytest.raises(VitftError, match=missing):
        finetune(log_with="mlflow", **options)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(VitftError, match="--log-with tensorboard needs the tensorboard package: pip install"):
        finetune(tensorboard=True, **options)
    with pytest.raises(VitftError, match="unknown tracker wandb in --log-with; use tensorboard, mlflow"):
        finetune(log_with="wandb", **options)
    assert not out.exists()


class _Writer:
    """A stand-in for TensorBoard's SummaryWriter (the package is optional): records what it is given."""

    made: list[_Writer] = []

    def __init__(self, log_dir: str):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        _Writer.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


def test_tensorboard_alias_logs_steps_and_epochs_to_the_run_folder(two_classes, tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))
    out = tmp_path / "run"
    result = finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), tensorboard=True,
                      **PROBE)
    [writer] = _Writer.made
    assert writer.log_dir == str(out / "tensorboard") and writer.closed
    steps = [step for tag, _, step in writer.scalars if tag == "train/loss"]
    assert steps == list(range(1, RunFolder(out).read_checkpoint()["global_step"] + 1))
    top1 = [(step, value) for tag, value, step in writer.scalars if tag == "val/top1"]
    assert top1 == [(r["epoch"], r["val_top1"]) for r in result.metrics]


def test_finetune_takes_a_recipe_and_overrides_it_as_the_cli_does(two_classes, tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"data: {two_classes}\npretrained: {tiny_model_dir}\nepochs: 5\nbatch_size: 4\nworkers: 0\n"
                      "freeze_backbone: true\nval_split: 0.2\nmodel_kwargs: {drop_rate: 0.1}\nquiet: true\n")
    out = tmp_path / "run"
    result = finetune(recipe=recipe, epochs=1, output=str(out), model_kwargs={"attn_drop_rate": 0.2})
    saved = RunFolder(out).train_config()
    assert result.epochs_done == saved["epochs"] == 1 and saved["batch_size"] == 4  # the option, the recipe
    assert saved["model_kwargs"] == {"drop_rate": 0.1, "attn_drop_rate": 0.2}  # merged key by key
    with pytest.raises(VitftError, match="--recipe is for new runs"):
        finetune(resume=out, recipe=recipe, epochs=2)


def _choose_on_rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from vit_finetune.engine.distributed import Dist, main_process_choice

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:  # each rank "measured" its own answer; all must train with rank 0's
        chosen = main_process_choice(f"bf16 from rank {rank}" if rank == 0 else None, Dist(rank, 2, rank))
        Path(out, f"rank{rank}").write_text(chosen)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes
def test_ranks_take_the_main_process_precision_choice(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_choose_on_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["bf16 from rank 0"] * 2


class _Killed(BaseException):
    """Stands in for a kill -9: nothing after it runs, no handler sees it."""


def test_a_run_killed_while_drawing_its_curves_resumes(two_classes, tiny_model_dir, tmp_path, monkeypatch):
    """At an epoch end the best model and the checkpoint are written before the slow files (curves.png): a kill
    in between leaves a run that --resume continues."""
    out = tmp_path / "run"
    options = dict(PROBE, freeze_backbone=False, device="cpu", precision="fp32")

    def die(self, rows):
        raise _Killed

    monkeypatch.setattr(RunFolder, "write_curves", die)
    with pytest.raises(_Killed):
        finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), **options)
    assert RunFolder(out).read_checkpoint()["epoch"] == 1 and (out / "model.safetensors").is_file()
    monkeypatch.undo()
    result = finetune(resume=str(out))
    assert result.epochs_done == 2 and (out / "curves.png").is_file()


def test_resuming_a_run_killed_before_its_first_checkpoint_says_what_to_do(tmp_path):
    RunFolder(tmp_path / "run").write_train_config({"data": "images"})
    with pytest.raises(VitftError, match=r"has no last/checkpoint.pt yet: the run stopped before its first "
                                         r"checkpoint .*start it again with --output .* --overwrite"):
        finetune(resume=str(tmp_path / "run"))


def test_a_head_epoch_is_timed_without_the_feature_pass(two_classes, tiny_model_dir, tmp_path, monkeypatch):
    """The first head epoch's seconds, img/s and progress count its steps only: the features computed before it
    (a long pass on real data) made the first progress line promise hours."""
    import time

    from vit_finetune.engine import phases

    compute = phases.cache_features

    def slow_features(trainer, progress):
        time.sleep(1.0)
        return compute(trainer, progress)

    monkeypatch.setattr(phases, "cache_features", slow_features)
    out = tmp_path / "run"
    finetune(data=str(two_classes), pretrained=str(tiny_model_dir), output=str(out), **PROBE)
    first = RunFolder(out).read_metrics()[0]
    assert float(first["seconds"]) < 0.5, first


def test_a_second_signal_says_it_stops_without_a_checkpoint(caplog):
    import signal

    from vit_finetune.engine.loop import StopFlag

    caplog.set_level("WARNING", logger="vitft")
    flag = StopFlag()
    flag._handle(signal.SIGINT, None)
    assert flag.stop and "saving a checkpoint to resume from" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        flag._handle(signal.SIGINT, None)
    assert "SIGINT again: stopping now, without a checkpoint" in caplog.text

"""Shared fixtures: generated class images, the real Intel images and DINOv2 weights (skipped when absent), small
model folders; the CPU pin for every test, the gpu marker, and CI's refusal of skips it must never see."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vit_finetune.runtime import DEVICE_ENV

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
# Every test runs on the CPU, whatever the machine has: `--device auto` resolves to $VITFT_DEVICE, which the
# subprocesses tests start (CLI runs, torchrun ranks) inherit. Tests marked gpu unset it for themselves.
os.environ[DEVICE_ENV] = "cpu"

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"  # real data and weights, next to the checkout: CI always has them
INTEL = SHARED / "data" / "intel" / "seg_train"
DINOV2 = SHARED / "weights" / "dinov2-vits14"  # timm Hub folder of a DINOv2 ViT-S/14 (its SOURCE.md says whence)
CLASSES = ["buildings", "forest", "glacier", "mountain", "sea", "street"]
# a tiny ViT (depth 2, width 64) at 32 px: fast enough for many CPU tests
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
# set by .ci/run: a skip for want of ../shared or of a package of the [test] extra fails the run
REQUIRE_ENV = "VITFT_REQUIRE_SHARED"


def shared_path(path: Path, what: str) -> Path:
    """`path` under ../shared, or a skip that names it (a skip CI turns into a failure)."""
    if not path.exists():
        pytest.skip(f"{what} not found at {path} (CI always has them)")
    return path
# a file or folder name with a Latin-1 byte, as Linux hands it to Python (a surrogate escape, not UTF-8)
NOT_UTF8 = os.fsdecode(b"caf\xe9 run")


@pytest.fixture(scope="session", autouse=True)
def own_cache_dir(tmp_path_factory) -> Path:
    """precision 'auto' caches its CPU measurement in the user's cache: the tests keep theirs apart (subprocesses
    inherit it)."""
    folder = tmp_path_factory.mktemp("vitft-cache")
    os.environ["VITFT_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def intel_dir() -> Path:
    return shared_path(INTEL, "real Intel images")


@pytest.fixture(scope="session")
def dinov2_dir() -> Path:
    return shared_path(DINOV2, "real DINOv2 ViT-S/14 weights")


@pytest.fixture(autouse=True)
def _gpu_tests_leave_the_cpu(request, monkeypatch):
    """Tests marked gpu skip, saying why, without CUDA; with it they run where `--device auto` points."""
    if request.node.get_closest_marker("gpu") is None:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU, and there is none here")
    monkeypatch.delenv(DEVICE_ENV)


# ---- CI: skips that mean the set-up is broken -----------------------------------------------------------
_REFUSED_SKIPS: list[str] = []


def _test_extra() -> set[str]:
    """Import names of the packages in the installed project's [test] extra."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        declared = requires("vit-finetune") or []
    except PackageNotFoundError as err:
        raise pytest.UsageError(f"{REQUIRE_ENV}=1 needs the project installed: pip install -e '.[test]'") from err
    return {re.match(r"[\w.-]+", r).group().lower().replace("-", "_")
            for r in declared if re.search(r"""extra\s*==\s*["']test["']""", r)}


def refused_skip(reason: str, test_extra: set[str]) -> bool:
    """A skip for want of ../shared, or of a package of the [test] extra (importorskip names its module)."""
    return str(SHARED) in reason or any(re.search(rf"\b{re.escape(name)}\b", reason) for name in test_extra)


def _note_skip(report) -> None:
    if os.environ.get(REQUIRE_ENV) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if refused_skip(reason, _test_extra()):
        _REFUSED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report) -> None:  # a module-level importorskip
    _note_skip(report)


def pytest_runtest_logreport(report) -> None:  # a fixture's or a test's own skip
    _note_skip(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _REFUSED_SKIPS and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _REFUSED_SKIPS:
        terminalreporter.section(f"skips {REQUIRE_ENV}=1 refuses (CI has ../shared and the [test] extra)", red=True)
        for line in _REFUSED_SKIPS:
            terminalreporter.line(line)


def make_subset(src: Path, dst: Path, per_class: int, classes=CLASSES) -> Path:
    """A class-folder tree of symlinks to the first `per_class` images of each class."""
    for name in classes:
        (dst / name).mkdir(parents=True, exist_ok=True)
        for image in sorted((src / name).iterdir())[:per_class]:
            (dst / name / image.name).symlink_to(image)
    return dst


def make_images(root: Path, counts: dict[str, int], size: int = 40, seed: int = 0,
                suffix: str = ".png") -> Path:
    """Class folders of square noise images (PNG, or JPEG with suffix='.jpg'), each class around its own colour
    (learnable, and quick): grey levels 60, 120 and 180 for the first three classes, tinted ones after."""
    rng = np.random.default_rng(seed)
    for c, (name, n) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        colour = np.full(3, 60.0 + 60 * (c % 3))
        colour[c // 3 % 3] += 60 * (c // 3)
        for i in range(n):
            pixels = np.clip(rng.normal(colour, 40, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{name}_{i:02d}{suffix}")
    return root


@pytest.fixture(scope="session")
def class_images(tmp_path_factory) -> Path:
    """Generated stand-ins for the real photos where their content does not matter: Intel's six class folders
    of 60 noise JPEGs (64 px), so that the tests that use them run without ../shared."""
    return make_images(tmp_path_factory.mktemp("generated"), {c: 60 for c in CLASSES}, size=64, suffix=".jpg")


@pytest.fixture(scope="session")
def small_images(class_images, tmp_path_factory) -> Path:
    """40 generated images per class in one folder of class folders."""
    return make_subset(class_images, tmp_path_factory.mktemp("generated40"), 40)


@pytest.fixture(scope="session")
def small_intel(intel_dir, tmp_path_factory) -> Path:
    """40 real images per class in one folder of class folders."""
    return make_subset(intel_dir, tmp_path_factory.mktemp("intel40"), 40)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A saved 6-class tiny model folder (config.json + model.safetensors) with Intel's label names."""
    import torch

    from vit_finetune import create_model, save_pretrained

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=len(CLASSES), **TINY)
    model.pretrained_cfg["label_names"] = list(CLASSES)
    return save_pretrained(model, tmp_path_factory.mktemp("tiny_model"))


def tiny_classifier(classes=("a", "b")):
    """A tiny ViT whose config names its classes."""
    from vit_finetune import create_model

    model = create_model("vit_tiny_patch16_224", num_classes=len(classes), **TINY)
    model.pretrained_cfg["label_names"] = list(classes)
    return model


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run faster on one thread than on two contended ones (2-core CI machines): modules that run many
    small models take it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def invoke_cli(*args):
    """`vitft ARGS` through typer's CliRunner, each argument as a string."""
    import logging

    from typer.testing import CliRunner

    from vit_finetune.cli import app

    logging.getLogger("vitft").handlers.clear()  # cli binds its handler to the first CliRunner's stderr
    return CliRunner().invoke(app, [str(a) for a in args])


def torchrun(*args: str, timeout: float = 300):
    """`vitft finetune ARGS` in 2 processes on gloo (CPU, fp32: the same numbers on every CPU), ended after
    `timeout` seconds, workers included (ranks that disagree would wait on each other for ever, and outlive a
    killed torchrun); --standalone picks a free port (a fixed one collides with parallel runs)."""
    import signal
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "vit_finetune", "finetune", *args, "--workers", "0", "--device", "cpu", "--precision", "fp32",
           "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(REPO), NO_ALBUMENTATIONS_UPDATE="1", OMP_NUM_THREADS="1")
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # the workers first (torchrun puts each in a session of its own), then torchrun
            workers = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in [*map(int, workers), proc.pid]:
                os.kill(pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)

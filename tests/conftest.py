"""Shared fixtures: generated class images, the real Intel images (skipped when absent) and small model
folders."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

INTEL = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "intel" / "seg_train"
CLASSES = ["buildings", "forest", "glacier", "mountain", "sea", "street"]
# a tiny ViT (depth 2, width 64) at 32 px: fast enough for many CPU tests
TINY = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)


@pytest.fixture(scope="session", autouse=True)
def own_cache_dir(tmp_path_factory) -> Path:
    """precision 'auto' caches its CPU measurement in the user's cache: the tests keep theirs apart (subprocesses
    inherit it)."""
    folder = tmp_path_factory.mktemp("vitft-cache")
    os.environ["VITFT_CACHE_DIR"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def intel_dir() -> Path:
    if not INTEL.is_dir():
        pytest.skip(f"real Intel images not found at {INTEL} (CI always has them)")
    return INTEL


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

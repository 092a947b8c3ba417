"""`vitft demo`: the whole path (data -> finetune -> evaluate -> export) offline, in a couple of minutes."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image

log = logging.getLogger("vitft")

CLASSES = ("horizontal_stripes", "vertical_stripes", "spots")
# a tiny ViT: 48 px images as 8x8 patches, 4 blocks of width 96
DEMO_MODEL = dict(img_size=48, patch_size=8, embed_dim=96, depth=4, num_heads=3, mlp_ratio=2,
                  global_pool="avg", class_token=False)


def _pattern(kind: str, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """One noisy picture of `kind`, in random colours, frequency and phase."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    freq, phase = rng.uniform(3, 8), rng.uniform(0, 2 * np.pi)
    if kind == "horizontal_stripes":
        mask = np.sin(2 * np.pi * freq * yy + phase) > 0
    elif kind == "vertical_stripes":
        mask = np.sin(2 * np.pi * freq * xx + phase) > 0
    else:
        mask = np.sin(2 * np.pi * freq * xx + phase) * np.sin(2 * np.pi * freq * yy + phase) > 0.3
    fg, bg = rng.integers(140, 256, 3), rng.integers(0, 110, 3)  # light pattern on a dark ground
    image = np.where(mask[..., None], fg, bg) + rng.normal(0, 20, (size, size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def make_demo_data(folder: Union[str, Path], per_class: int = 150, seed: int = 0) -> Path:
    """A folder of class folders with `per_class` generated JPEGs each."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    for kind in CLASSES:
        (folder / kind).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(_pattern(kind, rng)).save(folder / kind / f"{kind}_{i:03d}.jpg", quality=90)
    return folder


def demo(output: Union[str, Path] = "vitft-demo", epochs: int = 10, seed: int = 0) -> dict[str, Path]:
    """Generate data, fine-tune a tiny ViT on the CPU, evaluate it and export it; returns the paths."""
    from .engine.api import finetune
    from .hub.export import export
    from .run_folder import RunFolder
    from .tasks.evaluate import evaluate

    output = Path(output)
    data = make_demo_data(output / "data", seed=seed)
    log.info("demo data: %s (%d classes x 150 generated images)", data, len(CLASSES))
    run = finetune(data=str(data), pretrained="none", model="vit_tiny_patch16_224", model_kwargs=DEMO_MODEL,
                   epochs=epochs, batch_size=32, lr=0.03, warmup_epochs=1, val_split=0.25, drop_path=0.0,
                   scale=(0.5, 1.0), workers=0, device="cpu", seed=seed, output=str(output / "run"),
                   overwrite=True, quiet=True)
    report = evaluate(run.run_dir, data, device="cpu", workers=0, output=run.run_dir)
    exported = export(run.run_dir, output / "export", overwrite=True)
    log.info("demo: val top-1 %.1f%% after %d epochs; evaluated again on those %d validation images: %.1f%%",
             100 * run.best_top1, run.epochs_done, report.num_images, 100 * report.accuracy)
    return {"data": data, "run": run.run_dir, "report": RunFolder(run.run_dir).report_file, "export": exported}

"""Run a training recipe on the real Intel images and print accuracy and wall time.

Uses a seeded, stratified 85/15 train/val split of ../shared/data/intel/seg_train.

    python scripts/bench_finetune.py                       # recipes/intel_cpu.yaml
    python scripts/bench_finetune.py --recipe recipes/intel_vit_b16.yaml --epochs 1
    # the default CPU sharing (workers and torch threads chosen together) against a manual one, ~60 steps each:
    python scripts/bench_finetune.py --epochs 1 --max-steps-per-epoch 60 --workers default
    python scripts/bench_finetune.py --epochs 1 --max-steps-per-epoch 60 --workers 1 --threads 1
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEL = ROOT.parent / "shared" / "data" / "intel" / "seg_train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "intel_cpu.yaml"))
    parser.add_argument("--data", default=str(INTEL))
    parser.add_argument("--output", default="runs/bench-finetune")
    parser.add_argument("--epochs", type=int, help="override the recipe's epochs")
    parser.add_argument("--seed", type=int, help="override the recipe's seed (split and training)")
    parser.add_argument("--max-steps-per-epoch", type=int, help="cap each epoch (a short timing, not a full run)")
    parser.add_argument("--workers", help="loader workers: a number, or 'default' to let vitft choose them with "
                        "torch's threads (default: the recipe's)")
    parser.add_argument("--threads", type=int, help="torch threads (OMP_NUM_THREADS; default: vitft's choice)")
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported: torch reads it then

    from vit_finetune.config import load_recipe
    from vit_finetune.engine.api import finetune

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_recipe(args.recipe)
    if args.workers is not None:
        config["workers"] = None if args.workers == "default" else int(args.workers)
    if args.max_steps_per_epoch:
        config["max_steps_per_epoch"] = args.max_steps_per_epoch
    config.update(data=args.data, val_split=0.15, output=args.output, overwrite=True, quiet=True)
    if args.epochs:
        config["epochs"] = args.epochs
    if args.seed is not None:
        config["seed"] = args.seed
    start = time.perf_counter()
    result = finetune(config)
    wall = time.perf_counter() - start
    train_seconds = sum(float(r["seconds"]) for r in result.metrics)
    last = result.metrics[-1]
    print(f"\nrecipe {args.recipe}: {result.epochs_done} epochs")
    print(f"best val top-1   {100 * result.best_top1:.2f}% (epoch {result.best_epoch})")
    print(f"last val top-1   {100 * last['val_top1']:.2f}%")
    print(f"training time    {train_seconds / 60:.1f} min (epochs only)")
    print(f"wall time        {wall / 60:.1f} min (data scan, cache, evaluation included)")
    print(f"training speed   {sum(r['images_per_s'] * r['seconds'] for r in result.metrics) / train_seconds:.1f} img/s")


if __name__ == "__main__":
    main()

"""--balance none, sampler and loss on real photos with one class cut to 5%: macro F1, balanced accuracy, top-1
and the small class's recall, side by side.

A seeded split of ../shared/data/intel/seg_train, as symlinks in a temporary folder: --val images of each class
(balanced, untouched), --train images of each class for training but only 5% of the --minority class's. Each
run: a head phase on DINOv2 ViT-S/14's cached features, then --finetune-epochs of full fine-tuning, at 112 px.

    python scripts/bench_balance.py                        # 240 / 80 per class, glacier at 5% (12 images)
    python scripts/bench_balance.py --balances none sqrt --finetune-epochs 0
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEL = ROOT.parent / "shared" / "data" / "intel" / "seg_train"
DINOV2 = ROOT.parent / "shared" / "weights" / "dinov2-vits14"


def make_split(src: Path, dst: Path, train: int, val: int, minority: str, fraction: float, seed: int) -> int:
    """dst/train/<class>/ and dst/val/<class>/ as symlinks; returns the minority class's training images."""
    rng = random.Random(seed)
    kept = 0
    for folder in sorted(p for p in src.iterdir() if p.is_dir()):
        images = sorted(folder.iterdir())
        rng.shuffle(images)
        n_train = max(1, round(train * fraction)) if folder.name == minority else train
        for split, chosen in (("val", images[:val]), ("train", images[val:val + n_train])):
            (dst / split / folder.name).mkdir(parents=True, exist_ok=True)
            for image in chosen:
                (dst / split / folder.name / image.name).symlink_to(image)
        kept = n_train if folder.name == minority else kept
    return kept


def cpu_model() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(INTEL))
    parser.add_argument("--pretrained", default=str(DINOV2))
    parser.add_argument("--train", type=int, default=240, help="training images per class")
    parser.add_argument("--val", type=int, default=80, help="validation images per class")
    parser.add_argument("--minority", default="glacier")
    parser.add_argument("--fraction", type=float, default=0.05, help="of --train kept for the minority class")
    parser.add_argument("--balances", nargs="+", default=["none", "sampler", "loss"])
    parser.add_argument("--head-epochs", type=int, default=6)
    parser.add_argument("--finetune-epochs", type=int, default=1)
    parser.add_argument("--img-size", type=int, default=112)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from vit_finetune.engine.api import finetune
    from vit_finetune.runtime import choose_precision
    from vit_finetune.tasks.evaluate import evaluate

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # one precision for every run, so that they differ in --balance alone
    precision = choose_precision(torch.device("cpu"), args.precision).precision
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-balance-") as tmp:
        data = Path(tmp) / "data"
        kept = make_split(Path(args.data), data, args.train, args.val, args.minority, args.fraction, args.seed)
        print(f"data: {args.train} training images per class, {args.minority} cut to {kept}; {args.val} validation "
              f"images per class; DINOv2 ViT-S/14 at {args.img_size} px, {args.head_epochs} head epochs on cached "
              f"features + {args.finetune_epochs} fine-tuning epoch(s), precision {precision}", flush=True)
        for balance in args.balances:
            out, start = Path(tmp) / f"run-{balance}", time.perf_counter()
            epochs = args.head_epochs + args.finetune_epochs
            finetune(data=str(data), pretrained=args.pretrained, output=str(out), img_size=args.img_size,
                     epochs=epochs, freeze_backbone=True, feature_views=1,
                     unfreeze_after=args.head_epochs if args.finetune_epochs else None, batch_size=32, lr=2e-4,
                     warmup_epochs=0, head_lr=2.5e-2, label_smoothing=0.1, balance=balance, seed=args.seed,
                     precision=precision, quiet=True)
            seconds = time.perf_counter() - start
            report = evaluate(str(out), str(data), split="val", precision=precision, output=None)
            results[balance] = (report, seconds)
            print(f"--balance {balance}: {seconds:.0f}s, macro F1 {report.macro_f1:.4f}", flush=True)
    print(f"\nCPU: {cpu_model()} ({os.cpu_count()} cores, torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}); load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'--balance':<10} {'macro F1':>9} {'bal. acc':>9} {'top-1':>7} {args.minority + ' recall':>15} "
          f"{'seconds':>8}")
    for balance, (report, seconds) in results.items():
        recall = report.per_class[args.minority]["recall"]
        print(f"{balance:<10} {report.macro_f1:>9.4f} {report.balanced_accuracy:>9.4f} {report.accuracy:>7.4f} "
              f"{recall:>15.4f} {seconds:>8.0f}")


if __name__ == "__main__":
    main()

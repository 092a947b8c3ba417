"""Full fine-tuning, partial fine-tuning (--train-blocks) and LoRA (--lora) side by side under one time budget,
on the real DINOv2 ViT-S/14 weights and a seeded subset of the real Intel photos.

Each way runs the CLI in a subprocess of its own (so its peak RSS is its alone) with the same head phase first
(a linear probe on cached features) and the same --time-budget; printed: best val top-1, trainable parameters,
peak RSS, training img/s, checkpoint size and the wall time against the budget, with the CPU it ran on.

    python scripts/bench_transfer.py                      # 3 minutes each, 150 training photos per class
    python scripts/bench_transfer.py --budget 13 --train-per-class 1240 --precision fp32
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEL = ROOT.parent / "shared" / "data" / "intel" / "seg_train"
DINOV2 = ROOT.parent / "shared" / "weights" / "dinov2-vits14"
# the CLI in this process, printing its own peak RSS at exit (loader workers, if any, not counted)
PEAK_RSS = ("import resource, runpy, sys\nsys.argv = ['vitft', *sys.argv[1:]]\ntry:\n"
            "    runpy.run_module('vit_finetune', run_name='__main__')\nfinally:\n"
            "    print('peak_rss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
WAYS = {"full": [], "train-blocks 2": ["--train-blocks", "2"], "lora 8": ["--lora", "8"]}


def split_subset(out: Path, train_per_class: int, val_per_class: int, seed: int) -> None:
    """out/train/<class>/ and out/val/<class>/ of symlinks to a seeded draw of each class's photos."""
    rng = random.Random(seed)
    for folder in sorted(p for p in INTEL.iterdir() if p.is_dir()):
        photos = sorted(folder.glob("*.jpg"))
        rng.shuffle(photos)
        for split, chosen in (("val", photos[:val_per_class]),
                              ("train", photos[val_per_class:val_per_class + train_per_class])):
            (out / split / folder.name).mkdir(parents=True)
            for photo in chosen:
                (out / split / folder.name / photo.name).symlink_to(photo)


def trained_parameters(checkpoint: Path) -> int:
    """Parameters the last phase trained: those with AdamW state in the checkpoint (frozen ones get none)."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["optimizer"]["state"]
    return sum(s["exp_avg"].numel() for s in state.values() if "exp_avg" in s)


def run_way(args: argparse.Namespace, data: Path, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-c", PEAK_RSS, "finetune", "--recipe", str(ROOT / "recipes" /
               "intel_cpu_dinov2.yaml"), "--data", str(data), "--pretrained", str(DINOV2), "--output", str(out),
               "--time-budget", str(args.budget), "--epochs", str(args.epochs), "--unfreeze-after",
               str(args.head_epochs), "--precision", args.precision, "--quiet", *extra]
    start = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("peak_rss_kb")]
        return {"error": (lines or ["?"])[-1]}
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    trainable = trained_parameters(out / "last" / "checkpoint.pt")
    tuned = [r for r in rows if int(r["epoch"]) > args.head_epochs] or rows
    seconds = sum(float(r["seconds"]) for r in tuned)
    return {"top1": max(float(r["val_top1"]) for r in rows), "head_top1": max(float(r["val_top1"]) for r in rows
                                                                             if int(r["epoch"]) <= args.head_epochs),
            "epochs": len(rows), "trainable": trainable,
            "peak_rss_gb": int(proc.stderr.rsplit("peak_rss_kb ", 1)[1].split()[0]) / 2**20,
            "img_s": sum(float(r["images_per_s"]) * float(r["seconds"]) for r in tuned) / max(seconds, 1e-9),
            "checkpoint_mb": (out / "last" / "checkpoint.pt").stat().st_size / 2**20, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=3.0, help="minutes per way (--time-budget)")
    parser.add_argument("--train-per-class", type=int, default=150)
    parser.add_argument("--val-per-class", type=int, default=50)
    parser.add_argument("--epochs", type=int, default=30, help="the most epochs (the budget plans fewer)")
    parser.add_argument("--head-epochs", type=int, default=5, help="linear-probe epochs first (--unfreeze-after)")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated: " + ", ".join(WAYS))
    args = parser.parse_args()
    import torch

    from vit_finetune.runtime import cpu_model

    print(f"CPU: {cpu_model()}, capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; precision {args.precision}; budget {args.budget:g} min per way; "
          f"{args.train_per_class} train / {args.val_per_class} val photos per class")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        split_subset(data, args.train_per_class, args.val_per_class, seed=0)
        print(f"{'way':<16}{'best top-1':>11}{'head top-1':>11}{'epochs':>7}{'trainable':>22}{'peak RSS':>10}"
              f"{'img/s':>8}{'ckpt MB':>9}{'wall/budget':>13}")
        for way in args.ways.split(","):
            r = run_way(args, data, Path(tmp) / way.replace(" ", "-"), WAYS[way])
            if "error" in r:
                print(f"{way:<16}error: {r['error']}")
                continue
            print(f"{way:<16}{100 * r['top1']:>10.1f}%{100 * r['head_top1']:>10.1f}%{r['epochs']:>7}"
                  f"{r['trainable']:>22,}{r['peak_rss_gb']:>8.2f}GB{r['img_s']:>8.1f}{r['checkpoint_mb']:>9.1f}"
                  f"{r['wall_s'] / (60 * args.budget):>12.0%}", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

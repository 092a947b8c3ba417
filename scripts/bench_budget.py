"""--time-budget's accuracy: planned end against actual end, for runs of different budgets on the real photos.

Each run is the real `vitft finetune` (a subprocess, timed from its start to its exit) with a recipe on a seeded
subset of ../shared/data/intel/seg_train split into train/ and val/ folders of symlinks, under a temporary folder.

    python scripts/bench_budget.py                                  # intel_cpu.yaml, budgets of 1.5, 2.5 and 3.5 min
    python scripts/bench_budget.py --budgets 0.5 1 --per-class 200 --recipe recipes/intel_cpu_dinov2.yaml
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
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTEL = ROOT.parent / "shared" / "data" / "intel" / "seg_train"


def split_subset(source: Path, target: Path, per_class: int, val_fraction: float, seed: int) -> Path:
    """train/<class> and val/<class> folders of symlinks to `per_class` seeded photos of each class."""
    rng = random.Random(seed)
    for folder in sorted(p for p in source.iterdir() if p.is_dir()):
        photos = sorted(folder.glob("*.jpg"))
        chosen = rng.sample(photos, min(per_class, len(photos)))
        val = round(len(chosen) * val_fraction)
        for split, part in (("val", chosen[:val]), ("train", chosen[val:])):
            (target / split / folder.name).mkdir(parents=True, exist_ok=True)
            for photo in part:
                (target / split / folder.name / photo.name).symlink_to(photo)
    return target


def cpu_line() -> str:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "unknown")
    return (f"CPU: {model}, {os.cpu_count()} cores, capability {torch.backends.cpu.get_cpu_capability()}; "
            f"load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "intel_cpu.yaml"))
    parser.add_argument("--data", default=str(INTEL))
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.5, 2.5, 3.5], help="minutes")
    parser.add_argument("--per-class", type=int, default=600, help="photos per class in the subset")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        data = split_subset(Path(args.data), Path(tmp) / "data", args.per_class, 0.15, args.seed)
        for budget in args.budgets:
            out = Path(tmp) / f"run-{budget:g}"
            command = [sys.executable, "-m", "vit_finetune", "finetune", "--recipe", args.recipe, "--data", str(data),
                       "--time-budget", str(budget), "--output", str(out), "--quiet"]
            start = time.monotonic()
            done = subprocess.run(command, capture_output=True, text=True)
            seconds = time.monotonic() - start
            lines = (done.stdout + done.stderr).splitlines()
            if done.returncode:
                print(f"\n--- budget {budget:g} min failed: {lines[-1]}")
                continue
            said = [line for line in lines if "time budget" in line or "precision" in line]
            print(f"\n--- budget {budget:g} min\n" + "\n".join(said))
            ended = f"{datetime.now():%H:%M:%S}"
            with open(out / "metrics.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            first_plan = next(r for r in rows if r.get("planned_epochs"))
            best = max(float(r["val_top1"]) for r in rows)
            results.append((budget, first_plan, rows[-1], len(rows), best, ended, seconds))
    print(f"\n{cpu_line()}\nrecipe {args.recipe}, {args.per_class} photos per class (85/15 split)")
    print("budget | first plan: epochs, end | last plan: epochs, end | epochs run | best val top-1 | actual end | "
          "took | took/budget")
    for budget, first, last, epochs, best, ended, seconds in results:
        print(f"{budget:g} min | {first['planned_epochs']}, {first['planned_end']} | {last['planned_epochs']}, "
              f"{last['planned_end']} | {epochs} | {100 * best:.1f}% | {ended} | {seconds / 60:.2f} min | "
              f"{seconds / budget / 60:.1%}")


if __name__ == "__main__":
    main()

"""Full fine-tuning against LoRA for a model too large to train fully with comfort on a small CPU machine: the peak
memory (RSS) of one training step, trainable parameters, checkpoint size and img/s, side by side. Each mode runs in
a subprocess of its own, so that its peak RSS (resource.getrusage) is its alone. Random weights: memory and speed
do not depend on them.

    PYTHONPATH=. python scripts/bench_lora.py [--arch vit_large_patch14_dinov2] [--img-size 112] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_mode(arch: str, img_size: int, batch: int, rank: int, steps: int) -> dict:
    """A few AdamW steps in this process (the first one warms up); what a checkpoint of it weighs."""
    import resource

    import torch
    from timm.optim import create_optimizer_v2

    from vit_finetune import create_model
    from vit_finetune.weights.adapters import adapter_state, apply_lora, trainable_counts

    torch.manual_seed(0)
    model = create_model(arch, num_classes=10, img_size=img_size)
    if rank:
        apply_lora(model, rank)
    trainable, total = trainable_counts(model)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.05, layer_decay=0.75)
    images, targets = torch.randn(batch, 3, img_size, img_size), torch.randint(0, 10, (batch,))
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    state = {"model": adapter_state(model) if rank else model.state_dict(), "optimizer": optimizer.state_dict()}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(state, Path(tmp) / "checkpoint.pt")
        size = (Path(tmp) / "checkpoint.pt").stat().st_size
    return {"trainable": trainable, "total": total, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            / 2**20, "checkpoint_mb": size / 2**20, "img_s": batch / min(seconds[1:] or seconds)}


def cpu_line() -> str:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return (f"CPU: {model}, capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch "
            f"threads; load average {load}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="vit_large_patch14_dinov2")
    parser.add_argument("--img-size", type=int, default=112)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mode", type=int, help=argparse.SUPPRESS)  # a child: the LoRA rank (0: full)
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(one_mode(args.arch, args.img_size, args.batch, args.mode, args.steps)))
        return
    print(cpu_line())
    rows = {}
    for name, rank in (("full", 0), (f"LoRA r={args.rank}", args.rank)):
        proc = subprocess.run([sys.executable, __file__, "--arch", args.arch, "--img-size", str(args.img_size),
                               "--batch", str(args.batch), "--steps", str(args.steps), "--mode", str(rank)],
                              capture_output=True, text=True, check=True)
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{args.arch} at {args.img_size} px, batch {args.batch}, AdamW, fp32, random weights")
    print(f"{'':<22}" + "".join(f"{name:>16}" for name in rows))
    for key, label, fmt in (("trainable", "trainable params", "{:,.0f}"), ("peak_rss_gb", "peak RSS (GB)", "{:.2f}"),
                            ("checkpoint_mb", "checkpoint (MB)", "{:.1f}"), ("img_s", "img/s (best step)", "{:.2f}")):
        print(f"{label:<22}" + "".join(f"{fmt.format(row[key]):>16}" for row in rows.values()))
    print(cpu_line())


if __name__ == "__main__":
    main()

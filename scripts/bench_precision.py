"""fp32 against bf16 autocast on this CPU: img/s of a training step and of evaluation, for both CPU recipes' models.

Whether bf16 pays on a CPU depends on its matrix units (AMX / AVX-512 bf16): without them PyTorch emulates bf16
matmuls and a step can be 10-20x slower. `precision: auto` measures this per machine (vit_finetune.runtime); this
script measures the whole models, as the recipes train them (random weights, the recipes' batch sizes).

    python scripts/bench_precision.py                  # both models, 3 timed steps each, ~1-2 min with bf16 units
    python scripts/bench_precision.py --steps 1 --models intel_cpu
    # on a machine shared with other jobs: one thread, timed by its own CPU time (what other jobs cannot inflate)
    python scripts/bench_precision.py --threads 1 --clock thread
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import torch

from vit_finetune import create_model
from vit_finetune.config import load_recipe
from vit_finetune.runtime import compute_context

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 6  # the Intel scene photos


def intel_cpu_model() -> tuple[torch.nn.Module, int]:
    """recipes/intel_cpu.yaml's model, from scratch as the recipe trains it, and its batch size."""
    recipe = load_recipe(ROOT / "recipes" / "intel_cpu.yaml")
    kwargs = dict(recipe["model_kwargs"])
    img_size = kwargs.pop("img_size")
    return create_model(recipe["model"], num_classes=CLASSES, img_size=img_size, **kwargs), recipe["batch_size"]


def dinov2_model() -> tuple[torch.nn.Module, int]:
    """recipes/intel_cpu_dinov2.yaml's model (DINOv2 ViT-S/14 at 112 px; random weights time the same)."""
    recipe = load_recipe(ROOT / "recipes" / "intel_cpu_dinov2.yaml")
    model = create_model("vit_small_patch14_dinov2", num_classes=CLASSES, img_size=recipe["img_size"])
    return model, recipe["batch_size"]


MODELS = {"intel_cpu": intel_cpu_model, "intel_cpu_dinov2": dinov2_model}


def cpu_model_name() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no lscpu)"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "unknown")


def median_seconds(run, steps: int, clock) -> float:
    run()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(steps):
        start = clock()
        run()
        times.append(clock() - start)
    return statistics.median(times)


def bench(model: torch.nn.Module, batch: int, precision: str, steps: int, clock) -> tuple[float, float]:
    """(train img/s, eval img/s): a training step is forward, backward and an AdamW update."""
    device = torch.device("cpu")
    size = tuple(model.patch_embed.img_size)
    images, labels = torch.randn(batch, 3, *size), torch.randint(0, CLASSES, (batch,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step() -> None:
        model.train()
        with compute_context(device, precision):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.inference_mode()
    def eval_step() -> None:
        model.eval()
        with compute_context(device, precision):
            model(images)

    return batch / median_seconds(train_step, steps, clock), batch / median_seconds(eval_step, steps, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median), after one warm-up")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall time, or this thread's CPU time (only with --threads 1: other threads' work is "
                             "not counted)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts only this thread's work: use it with --threads 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"CPU: {cpu_model_name()}; torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} thread(s), {args.clock} clock")
    print(f"{'model':18} {'batch':>5} {'train fp32':>11} {'train bf16':>11} {'eval fp32':>10} {'eval bf16':>10}  "
          "bf16 speed-up train / eval")
    for name in args.models:
        torch.manual_seed(0)
        model, batch = MODELS[name]()
        (train32, eval32), (train16, eval16) = (bench(model, batch, p, args.steps, clock) for p in ("fp32", "bf16"))
        print(f"{name:18} {batch:5d} {train32:11.1f} {train16:11.1f} {eval32:10.1f} {eval16:10.1f}  "
              f"{train16 / train32:.2f}x / {eval16 / eval32:.2f}x   (img/s)")


if __name__ == "__main__":
    main()

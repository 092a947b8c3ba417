"""Partial fine-tuning (--train-blocks N) on cached activations against full fine-tuning: train img/s on this CPU.

DINOv2 ViT-S/14 at 112 px (intel_cpu_dinov2.yaml's model and weights), a batch of real Intel photos, fp32 and bf16
autocast. For N = 2 and 4 it times the one-time caching pass (the frozen lower blocks, forward only, per image and
view) and a step of the top N blocks (forward, backward, AdamW); "incl. cache" spreads the caching pass over
--epochs epochs of --views views, as a run pays it. "frozen every step" is --feature-views 0 (the lower blocks run
at every step, without autograd). Ratios are against full fine-tuning in the same precision.

    python scripts/bench_partial.py                          # ~5 min on a 2-core AVX2 CPU (bf16 is emulated there)
    python scripts/bench_partial.py --precisions fp32 --batch 32
    # the storage type's effect on accuracy: a small real run, activations stored in fp32 and in bf16
    python scripts/bench_partial.py --storage-accuracy
On a machine shared with other jobs the default clock is this thread's CPU time with one torch thread (what other
jobs cannot inflate); the load average is printed with the results.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from bench_precision import median_seconds  # scripts/ is on sys.path when a script runs

from vit_finetune import create_model
from vit_finetune.data.images import load_rgb
from vit_finetune.data.transforms import build_transforms
from vit_finetune.engine.phases import set_trainable
from vit_finetune.runtime import compute_context, cpu_model

ROOT = Path(__file__).resolve().parents[1]

WEIGHTS = ROOT.parent / "shared" / "weights" / "dinov2-vits14"
INTEL = ROOT.parent / "shared" / "data" / "intel" / "seg_train"
CLASSES = 6


def photos(model: torch.nn.Module, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` real Intel photos, round-robin over the classes, through the eval transform; and their labels."""
    transform = build_transforms(model.pretrained_cfg, tuple(model.patch_embed.img_size), train=False)
    classes = sorted(p for p in INTEL.iterdir() if p.is_dir())
    files = [sorted(c.iterdir()) for c in classes]
    picked = [(files[i % len(classes)][i // len(classes)], i % len(classes)) for i in range(count)]
    images = torch.stack([transform(image=load_rgb(path))["image"] for path, _ in picked])
    return images, torch.tensor([label for _, label in picked])


def train_step(model, forward, inputs, labels, precision: str):
    """One AdamW step on the trainable parameters through `forward` (inputs -> logits)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        model.train()
        with compute_context(torch.device("cpu"), precision):
            loss = loss_fn(forward(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench(model, images, labels, precision: str, blocks: list[int], steps: int, clock) -> dict:
    """Seconds per image: {'full': step, N: (cache pass, step, frozen-every-step step)}."""
    batch, depth = len(images), len(model.blocks)
    set_trainable(model, None)
    result = {"full": median_seconds(train_step(model, model, images, labels, precision), steps, clock) / batch}
    for n in blocks:
        start = depth - n
        set_trainable(model, n)

        @torch.inference_mode()
        def cache() -> None:
            model.eval()
            with compute_context(torch.device("cpu"), precision):
                model.forward_tokens(images, start)

        cache_s = median_seconds(cache, steps, clock) / batch
        with torch.inference_mode(), compute_context(torch.device("cpu"), precision):
            tokens = model.eval().forward_tokens(images, start)
        stored = tokens.to(torch.bfloat16 if precision == "bf16" else torch.float32).clone()
        step_s = median_seconds(train_step(model, lambda t: model.forward_from(t.float(), start), stored, labels,
                                           precision), steps, clock) / batch
        frozen_s = median_seconds(train_step(model, model, images, labels, precision), steps, clock) / batch
        result[n] = (cache_s, step_s, frozen_s)
    set_trainable(model, None)
    return result


def report(precision: str, result: dict, epochs: int, views: int) -> None:
    full = result["full"]
    print(f"\n{precision}: full fine-tuning {1 / full:.1f} img/s (1.00x)")
    print(f"{'--train-blocks':>14} {'cache pass':>11} {'steps only':>18} {'incl. cache':>18} {'frozen every step':>20}")
    for n, (cache_s, step_s, frozen_s) in ((k, v) for k, v in result.items() if k != "full"):
        with_cache = step_s + views * cache_s / epochs  # the pass, spread over the run's image-epochs
        print(f"{n:>14} {1 / cache_s:7.1f} img/s {1 / step_s:7.1f} ({full / step_s:5.2f}x) "
              f"{1 / with_cache:7.1f} ({full / with_cache:5.2f}x) {1 / frozen_s:9.1f} ({full / frozen_s:5.2f}x)")


def storage_accuracy(args) -> None:
    """The same small real run (fp32 compute, --train-blocks 2), activations stored in fp32 and in bf16."""
    from vit_finetune.engine import activations
    from vit_finetune.engine.api import finetune

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        for c in sorted(p for p in INTEL.iterdir() if p.is_dir()):
            (data / c.name).mkdir(parents=True)
            for image in sorted(c.iterdir())[:args.per_class]:
                (data / c.name / image.name).symlink_to(image)
        results = {}
        for dtype in (torch.float32, torch.bfloat16):
            activations.storage_dtype = lambda precision, dtype=dtype: dtype
            out = Path(tmp) / str(dtype)
            start = time.perf_counter()
            run = finetune(data=str(data), pretrained=str(WEIGHTS), output=str(out), img_size=112, train_blocks=2,
                           epochs=args.epochs, batch_size=32, lr=5e-4, val_split=0.2, precision="fp32", device="cpu",
                           workers=0, quiet=True, warmup_epochs=1, seed=0)
            rows = run.metrics
            results[dtype] = torch.load(out / "last" / "checkpoint.pt", weights_only=True)["model"]
            print(f"activations stored in {str(dtype).removeprefix('torch.'):8}: best val top-1 {run.best_top1:.2%} "
                  f"(epoch {run.best_epoch}), last val loss {rows[-1]['val_loss']:.4f}, "
                  f"top-1 per epoch {[round(r['val_top1'] * 100, 1) for r in rows]} "
                  f"({time.perf_counter() - start:.0f}s)")
        a, b = results.values()
        drift = max((a[k] - b[k]).abs().max().item() for k in a)
        print(f"largest weight difference after training, fp32 vs bf16 storage: {drift:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per measurement (median), after a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("thread", "process", "wall"), default="thread",
                        help="this thread's CPU time (with --threads 1), the process's CPU time, or wall time")
    parser.add_argument("--epochs", type=int, default=10, help="epochs the caching pass is spread over")
    parser.add_argument("--views", type=int, default=1, help="--feature-views: caching passes per image")
    parser.add_argument("--storage-accuracy", action="store_true", help="measure bf16 against fp32 storage instead")
    parser.add_argument("--per-class", type=int, default=60, help="photos per class for --storage-accuracy")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread counts only this thread's work: use it with --threads 1")
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()} (lscpu's model name); torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} thread(s), {args.clock} clock; "
          "load average before "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.storage_accuracy:
        storage_accuracy(args)
    else:
        clock = {"thread": time.thread_time, "process": time.process_time, "wall": time.perf_counter}[args.clock]
        torch.manual_seed(0)
        model = create_model(f"local-dir:{WEIGHTS}", pretrained=True, num_classes=CLASSES, img_size=112)
        images, labels = photos(model, args.batch)
        print(f"DINOv2 ViT-S/14 at 112 px ({len(model.blocks)} blocks), batch of {args.batch} Intel photos; "
              f"'incl. cache': the caching pass ({args.views} view(s)) spread over {args.epochs} epochs")
        for precision in args.precisions:
            report(precision, bench(model, images, labels, precision, args.blocks, args.steps, clock), args.epochs,
                   args.views)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

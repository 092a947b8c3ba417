"""Native ViT vs timm's VisionTransformer: throughput side by side, same weights, same input.

Both models live in one process; timm's random weights are loaded strictly into the native
model. Runs alternate between the two (and which goes first alternates too) so drifting clocks
or a busy machine hit both alike; each number is the median over --steps timed runs after
--warmup untimed ones. fp32 on CPU; bf16 autocast on CUDA (timed with torch.cuda.synchronize).

    python scripts/bench_model.py                       # vit_small_patch16_224 on CPU, < 1 min
    python scripts/bench_model.py --device cuda         # vit_base_patch16_224, bf16 autocast
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import timm
import torch
import torch.nn.functional as F

from vit_finetune import VisionTransformer
from vit_finetune.models.archs import get_arch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="architecture (default: vit_small_patch16_224 on CPU, vit_base_patch16_224 on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=None, help="default: 4 on CPU, 128 on CUDA")
    p.add_argument("--img-size", type=int, default=None, help="default: the architecture's")
    p.add_argument("--steps", type=int, default=None, help="timed runs per model and mode (default 5 CPU, 30 CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 1 CPU, 10 CUDA)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's); on a CPU shared with other jobs, 1 "
                        "avoids OpenMP threads stalling on each other")
    return p.parse_args()


def build(name: str, img_size, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    arch = get_arch(name)
    kwargs = dict(arch.kwargs, **({"img_size": img_size} if img_size else {}))
    if not kwargs.get("num_classes"):
        kwargs["num_classes"] = 1000  # a head, so the train step has a classification loss
    timm_kwargs = {k: kwargs[k] for k in ("img_size", "num_classes")}
    theirs = timm.create_model(name, **timm_kwargs)
    ours = VisionTransformer(**kwargs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours.to(device), theirs.to(device)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = args.model or ("vit_base_patch16_224" if cuda else "vit_small_patch16_224")
    batch = args.batch_size or (128 if cuda else 4)
    steps = args.steps or (30 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)

    torch.manual_seed(0)
    ours, theirs = build(name, args.img_size, device)
    h, w = ours.patch_embed.img_size
    x = torch.randn(batch, 3, h, w, device=device)
    y = torch.randint(0, ours.num_classes, (batch,), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    with torch.no_grad():
        ours.eval(), theirs.eval()
        diff = (ours(x[:2]) - theirs(x[:2])).abs().max().item()

    def eval_step(model):
        with torch.no_grad(), autocast:
            model(x)

    def train_step(model):
        model.zero_grad(set_to_none=True)
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    models = {"native": ours, "timm": theirs}
    print(f"{name} {h}x{w}  batch {batch}  {device.type}{' bf16 autocast' if cuda else ' fp32'}  "
          f"threads {torch.get_num_threads()}  steps {steps} (+{warmup} warmup)  "
          f"fp32 eval max|native - timm| {diff:.1e}")
    print(f"{'mode':6s} {'native img/s':>13s} {'timm img/s':>11s} {'native/timm':>12s}")
    for mode, step in (("eval", eval_step), ("train", train_step)):
        for model in models.values():
            model.train(mode == "train")
        times = {k: [] for k in models}
        for i in range(warmup + steps):
            order = list(models) if i % 2 == 0 else list(models)[::-1]
            for key in order:
                sync()
                start = time.perf_counter()
                step(models[key])
                sync()
                if i >= warmup:
                    times[key].append(time.perf_counter() - start)
        ips = {k: batch / statistics.median(v) for k, v in times.items()}
        print(f"{mode:6s} {ips['native']:13.1f} {ips['timm']:11.1f} {ips['native'] / ips['timm']:12.3f}")


if __name__ == "__main__":
    main()

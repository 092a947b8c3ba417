"""The GPU check for issue 3: a short intel_vit_b16 run on real images, with throughput and MFU.

ViT-B/16 at 224 from random weights (nothing downloads on the device machine), bf16 autocast,
SDPA attention, pinned memory; prints train images/s, the data-loader wait fraction, peak GPU
memory and MFU (52.7 GFLOP per ViT-B/16 training image at 224, against 790 TFLOP/s bf16 dense).

On the device machine (the repo travels, ../shared does not), carry a subset of the images:
    mkdir -p .gpudata && for c in ../shared/data/intel/seg_train/*; do mkdir -p .gpudata/$(basename $c);
      ls $c | head -400 | xargs -I{} cp $c/{} .gpudata/$(basename $c)/; done   # ~35 MB, add to .git/info/exclude
    python scripts/gpu_check.py --data .gpudata --steps 120
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vit_finetune.config import load_recipe
from vit_finetune.engine.api import finetune

ROOT = Path(__file__).resolve().parents[1]
TRAIN_FLOPS_PER_IMAGE = 52.7e9  # forward + backward, ViT-B/16 at 224
PEAK_BF16_FLOPS = 790e12  # H200 dense bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "intel" / "seg_train"))
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="epoch 1 includes warmup/compile; epoch 2 is timed")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", default="runs/gpu-check")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = load_recipe(ROOT / "recipes" / "intel_vit_b16.yaml")
    config.update(data=args.data, pretrained="none", model="vit_base_patch16_224", epochs=args.epochs,
                  max_steps_per_epoch=args.steps, batch_size=args.batch_size, compile=args.compile,
                  device=args.device, val_split=0.1, output=args.output, overwrite=True, quiet=True)
    result = finetune(config)
    last = result.metrics[-1]
    rate = float(last["images_per_s"])
    print(f"\ntrain images/s     {rate:.0f}")
    print(f"data-loader wait   {100 * float(last['data_wait']):.1f}% of the epoch")
    if last.get("peak_mem_gb") is not None:
        print(f"peak GPU memory    {last['peak_mem_gb']} GiB")
    print(f"MFU                {100 * rate * TRAIN_FLOPS_PER_IMAGE / PEAK_BF16_FLOPS:.1f}% "
          f"(52.7 GFLOP/image vs 790 TFLOP/s)")


if __name__ == "__main__":
    main()

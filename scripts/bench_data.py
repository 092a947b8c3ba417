"""Images/s of our train pipeline (load_rgb + albumentations) next to torchvision doing the same work, one worker.

Runs in-process on one thread (what one DataLoader worker gets), on a seeded sample of the real Intel images,
alternating the pipelines round by round so that drift hits all of them alike; prints the median of the rounds.

Usage (after `pip install -e .`, or with PYTHONPATH=.):
    python scripts/bench_data.py [--n 800] [--img-size 224] [--rounds 3] [--cache]
"""

import argparse
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import torch
from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torchvision import transforms as T

from vit_finetune.data.datasets import list_images
from vit_finetune.data.images import load_rgb
from vit_finetune.data.loaders import ImageDataset
from vit_finetune.data.transforms import build_transforms

INTEL = Path(__file__).resolve().parents[1].parent / "shared/data/intel/seg_train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=INTEL, help="folder of images (searched recursively)")
    parser.add_argument("--n", type=int, default=800, help="number of images, sampled with --seed")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", action="store_true", help="also time both pipelines on images decoded once")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    paths = list_images(args.root)
    paths = sorted(random.Random(args.seed).sample(paths, min(args.n, len(paths))))
    for p in paths:  # warm the page cache so the first pipeline timed does not pay for disk reads
        p.read_bytes()

    ours = build_transforms({"interpolation": "bicubic"}, args.img_size, train=True)
    tv = T.Compose([
        T.RandomResizedCrop(args.img_size, interpolation=T.InterpolationMode.BICUBIC),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    ])
    pipelines: dict[str, Callable[[int], torch.Tensor]] = {
        "ours (load_rgb + albumentations)": lambda i: ours(image=load_rgb(paths[i]))["image"],
        "torchvision (PIL + transforms)": lambda i: tv(Image.open(paths[i]).convert("RGB")),
    }
    if args.cache:
        dataset = ImageDataset(paths, ours, cache=True, img_size=args.img_size)
        dataset.fill_cache()
        decoded = [Image.open(p).convert("RGB") for p in paths]
        pipelines["ours, cached (ImageDataset cache=True)"] = lambda i: dataset[i][0]
        pipelines["torchvision, cached (PIL images in RAM)"] = lambda i: tv(decoded[i])

    rates: dict[str, list[float]] = {name: [] for name in pipelines}
    for _ in range(args.rounds):
        for name, pipeline in pipelines.items():
            start = time.perf_counter()
            for i in range(len(paths)):
                pipeline(i)
            rates[name].append(len(paths) / (time.perf_counter() - start))

    median = {name: statistics.median(r) for name, r in rates.items()}
    print(f"{len(paths)} images from {args.root}, {args.img_size}px train transform, 1 thread, median of {args.rounds}")
    print(f"{'pipeline':<42}{'images/s':>10}{'ms/image':>10}")
    for name, rate in median.items():
        print(f"{name:<42}{rate:>10.0f}{1000 / rate:>10.2f}")
    names = list(median)
    for ours_name, tv_name in zip(names[::2], names[1::2]):
        label = f"ratio {ours_name.split(' (')[0]} / {tv_name.split(' (')[0]}"
        print(f"{label:<42}{median[ours_name] / median[tv_name]:>9.2f}x")


if __name__ == "__main__":
    main()

"""Two-scene images for multi-label classification, from a folder of class folders (e.g. Intel's seg_train).

Each image stacks two photos, each resized to 150x75, into one 150x150 picture labelled with both scenes; a
quarter of them (--same) show two photos of the same scene and carry that one label. The photos are split once,
seeded, per class: the held-out share (--held-out) makes the test images only, so no test image shares a photo
with a training image. Writes OUT/train/*.jpg, OUT/test/*.jpg and OUT/train.csv, OUT/test.csv (`path,labels`,
labels as `a|b`), ready for

    vitft finetune --recipe recipes/intel_multilabel_dinov2.yaml --pretrained ../shared/weights/dinov2-vits14 \\
        --data OUT/train.csv
    vitft evaluate RUN --data OUT/test.csv

    python scripts/make_multilabel.py ../shared/data/intel/seg_train multilabel --train 6000 --test 900
"""
from __future__ import annotations

import argparse
import csv
import random
from pathlib import Path

from PIL import Image

SIZE, HALF = 150, 75
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def split_photos(source: Path, held_out: float, seed: int) -> tuple[dict[str, list[Path]], dict[str, list[Path]]]:
    """({class: training photos}, {class: held-out photos}), a seeded share of each class held out."""
    rng = random.Random(seed)
    train, test = {}, {}
    for folder in sorted(d for d in source.iterdir() if d.is_dir() and not d.name.startswith(".")):
        photos = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        rng.shuffle(photos)
        n_test = round(len(photos) * held_out)
        train[folder.name], test[folder.name] = photos[n_test:], photos[:n_test]
    return train, test


def two_scene(top: Path, bottom: Path) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE))
    for i, photo in enumerate((top, bottom)):
        with Image.open(photo) as im:
            image.paste(im.convert("RGB").resize((SIZE, HALF), Image.BILINEAR), (0, i * HALF))
    return image


def make_images(photos: dict[str, list[Path]], out: Path, split: str, count: int, same: float,
                seed: int) -> Path:
    """`count` two-scene images from `photos` under out/split/, listed in out/split.csv; returns the CSV."""
    rng = random.Random(seed)
    classes = [c for c, files in photos.items() if len(files) >= 2]
    (out / split).mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        if rng.random() < same:
            scene = rng.choice(classes)
            top, bottom = rng.sample(photos[scene], 2)
            labels = [scene]
        else:
            first, second = rng.sample(classes, 2)
            top, bottom = rng.choice(photos[first]), rng.choice(photos[second])
            labels = sorted([first, second])
        name = f"{split}/{i:05d}.jpg"
        two_scene(top, bottom).save(out / name, quality=90)
        rows.append((name, "|".join(labels)))
    table = out / f"{split}.csv"
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "labels"])
        writer.writerows(rows)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="folder of class folders")
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--train", type=int, default=6000, help="training images")
    parser.add_argument("--test", type=int, default=900, help="test images, from the held-out photos only")
    parser.add_argument("--held-out", type=float, default=0.15, help="share of each class's photos held out")
    parser.add_argument("--same", type=float, default=0.25, help="share of images with one scene twice")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, test = split_photos(args.source, args.held_out, args.seed)
    for split, photos, count, seed in (("train", train, args.train, args.seed), ("test", test, args.test,
                                                                                args.seed + 1)):
        print(f"wrote {make_images(photos, args.out, split, count, args.same, seed)} ({count} images)")


if __name__ == "__main__":
    main()

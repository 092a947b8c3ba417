"""Facts about vit_finetune.data: layouts, errors, decoding of odd and broken files, transforms, cache, loaders."""

import io
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from vit_finetune.data.datasets import find_dataset, list_images
from vit_finetune.data.images import load_rgb
from vit_finetune.data.loaders import ImageDataset, build_loader
from vit_finetune.data.transforms import build_transforms
from vit_finetune.errors import VitftError

CLIP_CFG = {"mean": OPENAI_CLIP_MEAN, "std": OPENAI_CLIP_STD, "interpolation": "bicubic", "crop_pct": 1.0}


@pytest.fixture(scope="module")
def intel(intel_dir) -> dict[str, list[Path]]:
    """The first 20 real Intel images of each class (skipped, saying why, where the folder is absent)."""
    return {d.name: sorted(d.glob("*.jpg"))[:20] for d in sorted(intel_dir.iterdir())}


def link(files: list[Path], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        (folder / f.name).symlink_to(f)


def save(path: Path, image: Image.Image, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, **kw)
    return path


def noise_jpeg_bytes(size: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("doubled", [True, False])
def test_intel_layout(tmp_path, intel, doubled):
    for split, n in [("seg_train", 4), ("seg_test", 2)]:
        base = tmp_path / split / split if doubled else tmp_path / split
        for c in ["sea", "forest", "glacier"]:
            link(intel[c][:n] if split == "seg_train" else intel[c][-n:], base / c)
    link(intel["street"][:3], tmp_path / "seg_pred" / "seg_pred" if doubled else tmp_path / "seg_pred")
    splits = find_dataset(tmp_path)
    assert splits.layout == "Intel (seg_train/seg_test/seg_pred)"
    assert splits.classes == ["forest", "glacier", "sea"]
    assert (len(splits.train), len(splits.val), splits.test) == (12, 6, None)
    assert {p.parent.parent.name for p, _ in splits.val} == {"seg_test"}
    assert all(splits.classes[label] == p.parent.name for p, label in splits.train + splits.val)
    assert not any("seg_pred" in str(p) for p, _ in splits.train + splits.val)  # unlabelled: in no split
    assert splits.class_counts() == {"train": dict.fromkeys(splits.classes, 4), "val": dict.fromkeys(splits.classes, 2)}


def test_intel_train_only_is_split(tmp_path, intel):
    for c in ["sea", "forest"]:
        link(intel[c][:10], tmp_path / "seg_train" / "seg_train" / c)
    splits = find_dataset(tmp_path, val_split=0.2)
    assert splits.layout == "Intel (seg_train) split 80/20 (seed 0)"
    assert (len(splits.train), len(splits.val)) == (16, 4)


def test_train_valid_test_layout(tmp_path, intel):
    for split, files in [("train", intel["sea"][:5]), ("valid", intel["sea"][5:8]), ("test", intel["sea"][8:10])]:
        link(files, tmp_path / split / "sea")
        link(files, tmp_path / split / "street")
    splits = find_dataset(tmp_path)
    assert splits.layout == "train/ + valid/ + test/"
    assert splits.classes == ["sea", "street"]
    assert (len(splits.train), len(splits.val), len(splits.test)) == (10, 6, 4)
    assert {p.parts[-3] for p, _ in splits.val} == {"valid"}


def test_train_and_test_only_validates_on_test(tmp_path, intel):
    link(intel["sea"][:5], tmp_path / "train" / "sea")
    link(intel["sea"][5:7], tmp_path / "test" / "sea")
    splits = find_dataset(tmp_path)
    assert (splits.layout, len(splits.val), splits.test) == ("train/ + test/", 2, None)


def test_single_folder_split_is_stratified_and_seeded(tmp_path, intel):
    for c in ["buildings", "glacier", "mountain"]:
        link(intel[c][:10], tmp_path / c)
    a, b, other = (find_dataset(tmp_path, 0.2, seed=s) for s in (1, 1, 2))
    assert a.layout == "single folder split 80/20 (seed 1)"
    assert a.class_counts()["val"] == {"buildings": 2, "glacier": 2, "mountain": 2}
    assert (a.train, a.val) == (b.train, b.val)
    assert a.val != other.val
    assert sorted(a.train + a.val) == sorted(other.train + other.val) and not set(a.train) & set(a.val)


def test_image_suffixes_any_case_and_hidden_files_skipped(tmp_path):
    for name in ["a.JPG", "b.jpeg", "c.Png", "d.bmp", "e.webp", "f.TIFF", "g.tif", ".h.jpg", "notes.txt"]:
        suffix = name.rsplit(".", 1)[1].lower()
        fmt = {"jpg": "JPEG", "jpeg": "JPEG", "tif": "TIFF", "tiff": "TIFF", "txt": "PNG"}.get(suffix)
        save(tmp_path / "only" / name, Image.new("RGB", (8, 8)), format=fmt)
    link([tmp_path / "only" / "a.JPG", tmp_path / "only" / "b.jpeg"], tmp_path / "other")
    splits = find_dataset(tmp_path, val_split=0.5)
    counts = splits.class_counts()
    assert (counts["train"]["only"] + counts["val"]["only"], counts["val"]["other"]) == (7, 1)


# ----------------------------------------------------------------------------- errors


def test_missing_folder(tmp_path):
    with pytest.raises(VitftError, match=r"nope does not exist"):
        find_dataset(tmp_path / "nope")


def test_no_images(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(VitftError, match=r"empty has no images; accepted layouts: root/train/<class>/"):
        find_dataset(tmp_path / "empty")


def test_images_without_class_folders(tmp_path):
    save(tmp_path / "a.jpg", Image.new("RGB", (8, 8)))
    with pytest.raises(VitftError, match="has images but no class folders"):
        find_dataset(tmp_path)


def test_empty_class_folder(tmp_path, intel):
    link(intel["sea"][:3], tmp_path / "sea")
    (tmp_path / "street").mkdir()
    with pytest.raises(VitftError, match=r"class folder .*street has no images"):
        find_dataset(tmp_path)


def test_class_in_val_not_in_train(tmp_path, intel):
    link(intel["sea"][:3], tmp_path / "train" / "sea")
    link(intel["sea"][3:5], tmp_path / "val" / "sea")
    link(intel["forest"][3:5], tmp_path / "val" / "forest")
    with pytest.raises(VitftError, match=r"forest in .*val are not in the training folder"):
        find_dataset(tmp_path)


def test_bad_val_split(tmp_path, intel):
    link(intel["sea"][:3], tmp_path / "sea")
    with pytest.raises(VitftError, match="val_split must be between 0 and 1"):
        find_dataset(tmp_path, val_split=0)


# ----------------------------------------------------------------------------- decoding and bad files


@pytest.fixture
def odd_images(tmp_path) -> Path:
    """Convertible images of many modes next to three broken files."""
    d = tmp_path / "odd"
    rgba = Image.new("RGBA", (20, 10), (255, 0, 0, 0))
    rgba.paste((255, 0, 0, 255), (0, 0, 10, 10))
    palette = Image.new("P", (20, 10), 1)
    palette.putpalette([0, 0, 255, 0, 255, 0])
    palette.paste(0, (0, 0, 10, 10))
    save(d / "rgb.jpg", Image.new("RGB", (20, 10), (0, 128, 255)))
    save(d / "cmyk.jpg", Image.new("CMYK", (20, 10), (0, 255, 255, 0)))  # red
    save(d / "grey.png", Image.new("L", (20, 10), 77))
    save(d / "rgba.png", rgba)  # left half red, right half transparent
    save(d / "palette.png", palette, transparency=1)  # left half blue, right half transparent
    save(d / "grey16.png", Image.fromarray(np.full((10, 20), 32896, dtype=np.uint16)))  # 32896 / 257 = 128
    (d / "truncated.jpg").write_bytes(noise_jpeg_bytes()[:1500])
    (d / "empty.jpg").write_bytes(b"")
    (d / "text.jpg").write_text("not a picture")
    return d


@pytest.mark.parametrize(
    "name, left, right",
    [
        ("rgb.jpg", (0, 128, 255), (0, 128, 255)),
        ("cmyk.jpg", (255, 0, 0), (255, 0, 0)),
        ("grey.png", (77, 77, 77), (77, 77, 77)),
        ("rgba.png", (255, 0, 0), (255, 255, 255)),
        ("palette.png", (0, 0, 255), (255, 255, 255)),
        ("grey16.png", (128, 128, 128), (128, 128, 128)),
    ],
)
def test_load_rgb_converts_to_rgb(odd_images, name, left, right):
    image = load_rgb(odd_images / name)
    assert (image.shape, image.dtype) == ((10, 20, 3), np.uint8)
    assert np.abs(image[5, 2].astype(int) - left).max() <= 2  # JPEG rounding
    assert np.abs(image[5, 17].astype(int) - right).max() <= 2


@pytest.mark.parametrize("name, message", [("truncated.jpg", r"image file is truncated"),
                                           ("empty.jpg", r"cannot identify image file .*empty\.jpg"),
                                           ("text.jpg", r"cannot identify image file .*text\.jpg")])
def test_load_rgb_raises_on_broken_files(odd_images, name, message):
    with pytest.raises(OSError, match=message):
        load_rgb(odd_images / name)


def test_load_rgb_shrinks_large_images(tmp_path):
    path = save(tmp_path / "big.jpg", Image.new("RGB", (1000, 600), (40, 80, 120)))
    assert load_rgb(path, max_short_side=150).shape == (150, 250, 3)
    assert load_rgb(path, max_short_side=800).shape == (600, 1000, 3)  # never enlarged


def test_exif_orientation_is_applied(tmp_path):
    image = Image.new("RGB", (30, 10))
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    path = save(tmp_path / "rotated.jpg", image, exif=exif)
    assert load_rgb(path).shape == (30, 10, 3)
    assert load_rgb(path, max_short_side=5).shape == (15, 5, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_skips_and_reports_bad_files(odd_images, caplog, workers):
    caplog.set_level(logging.WARNING, logger="vitft")
    ds = ImageDataset(list_images(odd_images), build_transforms({}, 16, train=True), name="odd")
    assert "odd: skipped 2 of 9 files that are not readable images" in caplog.text
    assert "empty.jpg (empty file)" in caplog.text and "text.jpg (not an image)" in caplog.text
    assert len(ds) == 7
    for _ in range(2):  # two epochs: the truncated file is reported once
        batches = list(build_loader(ds, batch_size=2, train=False, workers=workers))
        assert sum(len(y) for _, y in batches) == 7
        assert all(x.shape[1:] == (3, 16, 16) and torch.isfinite(x).all() for x, _ in batches)
    assert caplog.text.count("odd: 1 image(s) could not be decoded and were replaced by others") == 1
    assert "(3 file(s) skipped in total): " + str(odd_images / "truncated.jpg") in caplog.text
    assert sorted(p.name for p in ds.skipped()) == ["empty.jpg", "text.jpg", "truncated.jpg"]


def test_return_index_names_the_image_used(odd_images):
    ds = ImageDataset(list_images(odd_images), build_transforms({}, 16, train=False), return_index=True)
    bad = ds.paths.index(odd_images / "truncated.jpg")
    _, label, used = ds[bad]
    assert (label, used) == (-1, (bad + 1) % len(ds))


def test_all_files_unreadable(odd_images):
    with pytest.raises(VitftError, match="no readable images among 2 files"):
        ImageDataset([odd_images / "empty.jpg", odd_images / "text.jpg"], build_transforms({}, 16, train=False))


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize(
    "cfg, mean, std", [({}, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD), (CLIP_CFG, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)]
)
def test_eval_transform_normalises_with_cfg(cfg, mean, std):
    colour = np.array([10, 120, 240], dtype=np.uint8)
    x = build_transforms(cfg, 64, train=False)(image=np.broadcast_to(colour, (50, 80, 3)).copy())["image"]
    assert (x.shape, x.dtype) == ((3, 64, 64), torch.float32)
    expected = (colour / 255 - np.array(mean)) / np.array(std)
    assert torch.allclose(x.mean(dim=(1, 2)), torch.tensor(expected, dtype=torch.float32), atol=1e-3)
    assert x.std(dim=(1, 2)).max() < 1e-3


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("strong", [False, True])
def test_non_square_sizes(train, strong):
    image = np.random.default_rng(0).integers(0, 256, (120, 90, 3), dtype=np.uint8)
    transform = build_transforms(CLIP_CFG, (48, 80), train=train, color_jitter=0.4, strong=strong)
    assert transform(image=image)["image"].shape == (3, 48, 80)


def test_eval_resizes_by_crop_pct():
    image = np.zeros((100, 100, 3), dtype=np.uint8)
    image[25:75, 25:75] = 255  # white centre square, half the side
    x = build_transforms({"crop_pct": 0.5, "mean": (0,) * 3, "std": (1,) * 3}, 32, train=False)(image=image)["image"]
    # a 50% centre crop is the white square; the antialiased resize (PIL, as timm) blends its outermost pixels
    assert x[:, 1:-1, 1:-1].min() > 0.99 and x.min() > 0.85


def test_unknown_interpolation():
    with pytest.raises(VitftError, match="unknown interpolation 'fancy'"):
        build_transforms({"interpolation": "fancy"}, 32, train=False)


# ----------------------------------------------------------------------------- cache and loader


def cached_and_plain(files: list[Path], img_size: int) -> tuple[ImageDataset, ImageDataset]:
    transform = build_transforms({}, img_size, train=False)
    return ImageDataset(files, transform, cache=True, img_size=img_size), ImageDataset(files, transform)


def test_cache_is_exact_when_nothing_is_shrunk(intel):
    files = [p for c in intel.values() for p in c[:2]]
    cached, plain = cached_and_plain(files, 224)  # cap 295 px > the 150 px Intel images
    progress = []
    cached.fill_cache(lambda done, total: progress.append((done, total)))
    assert progress[-1] == (12, 12) and cached._cache is not None
    assert all(torch.equal(cached[i][0], plain[i][0]) for i in range(len(files)))


def test_cache_shrinks_within_tolerance(intel):
    files = [p for c in intel.values() for p in c[:2]]
    cached, plain = cached_and_plain(files, 48)  # cap ceil(1.15 * 48 / 0.875) = 64 px
    cached.fill_cache()
    assert cached._cache.numel() == 12 * 64 * 64 * 3  # Intel images are 150x150 (with rare shorter ones)
    diffs = [(cached[i][0] - plain[i][0]).abs().mean().item() for i in range(len(files))]
    assert np.mean(diffs) < 0.1 and max(diffs) < 0.2  # resampling twice; 0.1 (normalised) is about 6 grey levels


def test_cached_loader_with_workers_matches_in_process(intel):
    files = [p for c in intel.values() for p in c[:3]]
    ds = ImageDataset(files, build_transforms({}, 32, train=False), cache=True, img_size=32)
    with_workers = torch.cat([x for x, _ in build_loader(ds, 4, train=False, workers=2)])
    assert ds._cache is not None  # filled by build_loader before the workers started
    in_process = torch.cat([x for x, _ in build_loader(ds, 4, train=False, workers=0)])
    assert torch.equal(with_workers, in_process)


def test_train_loader_is_seeded_and_workers_differ(intel):
    files = [intel["sea"][0]] * 8

    def first_epoch(seed: int, workers: int) -> torch.Tensor:
        ds = ImageDataset(files, build_transforms({}, 32, train=True))
        return torch.cat([x for x, _ in build_loader(ds, 2, train=True, workers=workers, seed=seed)])

    a = first_epoch(0, 2)
    assert torch.equal(a, first_epoch(0, 2))
    assert not torch.equal(a, first_epoch(1, 2))
    assert not torch.equal(a[0], a[2])  # batches 0 and 1 come from different workers: their augmentations differ
    assert torch.equal(first_epoch(0, 0), first_epoch(0, 0))


def test_loader_defaults(intel):
    ds = ImageDataset(intel["sea"][:5], build_transforms({}, 32, train=True))
    train = build_loader(ds, 2, train=True, workers=1)
    assert (train.drop_last, train.persistent_workers, train.pin_memory, len(train)) == (True, True, False, 2)
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)
    val = build_loader(ds, 2, train=False, workers=0, device_type="cuda")
    assert (val.drop_last, val.persistent_workers, val.pin_memory, len(val)) == (False, False, True, 3)
    assert isinstance(val.sampler, torch.utils.data.SequentialSampler)


# ----------------------------------------------------------------------------- list_images


@pytest.fixture
def photos(tmp_path) -> Path:
    for name in ["a.jpg", "b.PNG", "nested/deeper/c.jpeg", "nested/.hidden.jpg", "nested/notes.txt"]:
        save(tmp_path / "photos" / name, Image.new("RGB", (4, 4)), format="PNG")
    return tmp_path / "photos"


def test_list_images_file_folder_and_glob(photos):
    assert list_images(photos / "a.jpg") == [photos / "a.jpg"]
    assert list_images(str(photos)) == [photos / "a.jpg", photos / "b.PNG", photos / "nested/deeper/c.jpeg"]
    assert list_images(f"{photos}/**/*.jp*g") == [photos / "a.jpg", photos / "nested/deeper/c.jpeg"]
    both = [photos / "b.PNG", photos / "nested/deeper/c.jpeg"]
    assert list_images([photos / "b.PNG", photos / "nested", photos / "b.PNG"]) == both  # deduplicated


def test_list_images_errors(photos):
    with pytest.raises(VitftError, match="missing.jpg matches no file or folder"):
        list_images(photos / "missing.jpg")
    with pytest.raises(VitftError, match="no images .* found in"):
        list_images(f"{photos}/**/*.txt")


def test_symlink_cycles_are_walked_once(photos):
    (photos / "nested" / "deeper" / "up").symlink_to(photos, target_is_directory=True)  # a cycle
    (photos / "again").symlink_to(photos / "nested", target_is_directory=True)  # a second way into a folder
    (photos / "outside").symlink_to(photos.parent / "other", target_is_directory=True)
    save(photos.parent / "other" / "d.png", Image.new("RGB", (4, 4)), format="PNG")
    found = list_images(photos)
    # each real folder once, reached by the first name in sorted order ("again" before "nested")
    assert found == [photos / "a.jpg", photos / "again/deeper/c.jpeg", photos / "b.PNG", photos / "outside/d.png"]


# ----------------------------------------------------------------------------- eval transform = timm's


def timm_eval(cfg: dict, size: tuple[int, int]):
    from timm.data import create_transform, resolve_data_config

    return create_transform(**resolve_data_config({}, pretrained_cfg=dict(cfg, input_size=(3, *size))),
                            is_training=False)


EVAL_CFGS = [
    ({"interpolation": "bicubic", "crop_pct": 0.875, "mean": (0.5,) * 3, "std": (0.5,) * 3}, (64, 64)),
    ({"interpolation": "bilinear", "crop_pct": 0.9}, (224, 224)),
    (CLIP_CFG, (48, 80)),  # non-square: timm keeps the aspect ratio
]


@pytest.mark.parametrize("cfg,size", EVAL_CFGS)
def test_eval_transform_is_timms(intel, tmp_path, cfg, size):
    """Our eval tensor equals timm's eval transform of the same file (max abs difference after normalisation:
    0.0 measured, 1e-6 allowed; the cv2 resize before this was off by up to 0.24 at 64 px on these photos)."""
    yy, xx = np.mgrid[0:1500, 0:2000]
    large = np.stack([(xx * 0.13) % 256, (yy * 0.07) % 256, (xx + yy) * 0.05 % 256], axis=2).astype(np.uint8)
    files = [intel[c][i] for c in intel for i in (0, 7)] + [save(tmp_path / "large.png", Image.fromarray(large))]
    ours, theirs = build_transforms(cfg, size, train=False), timm_eval(cfg, size)
    for f in files:
        with Image.open(f) as im:
            expected = theirs(im.convert("RGB"))
        got = ours(image=load_rgb(f))["image"]
        assert got.shape == expected.shape == (3, *size)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=f"{f}")

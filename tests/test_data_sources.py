"""Data as people have it, on real photos: Hugging Face datasets (save_to_disk, parquet, streamed) and WebDataset
shards (vitft shards' and webdataset's own TarWriter's) give the images and labels of the class folders they were
made from; one streamed epoch reads each training image once (2 loader workers, 2 ranks, 2 gloo processes); and
bad input gets a one-line error or a counted skip."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import subprocess
import sys
import tarfile
import zlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import invoke_cli

from vit_finetune.data.datasets import find_dataset
from vit_finetune.data.images import load_rgb
from vit_finetune.data.loaders import build_loader
from vit_finetune.data.shards import write_shards
from vit_finetune.data.streams import StreamDataset, stream_batches
from vit_finetune.engine.api import finetune
from vit_finetune.errors import VitftError

datasets = pytest.importorskip("datasets")
wds = pytest.importorskip("webdataset")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
SCENES = ["buildings", "forest", "sea"]
TRAIN, VAL = 4, 2  # real photos per class: 12 training and 6 validation images
QUICK = dict(epochs=1, batch_size=4, lr=0.01, workers=0, warmup_epochs=0, quiet=True, device="cpu", precision="fp32")


def content_id(image) -> int:
    """The decoded pixels' checksum: the same image whatever it was stored in."""
    return zlib.crc32(load_rgb(image).tobytes())


def pixel_ids(image):
    """A transform that turns each image into its content_id, so batches say which images they hold."""
    return {"image": torch.tensor([zlib.crc32(image.tobytes())])}


def id_labels(samples) -> Counter:
    return Counter((content_id(image), SCENES[label]) for image, label in samples)


@pytest.fixture(scope="module")
def photos(intel_dir) -> dict[str, list[tuple[Path, int]]]:
    """A seeded subset of the real Intel photos: {"train": [(path, class index)], "validation": [...]}."""
    rng, split = random.Random(0), {"train": [], "validation": []}
    for index, scene in enumerate(SCENES):
        files = rng.sample(sorted((intel_dir / scene).iterdir()), TRAIN + VAL)
        split["train"] += [(f, index) for f in files[:TRAIN]]
        split["validation"] += [(f, index) for f in files[TRAIN:]]
    return split


@pytest.fixture(scope="module")
def sources(photos, tmp_path_factory) -> dict[str, Path]:
    """The photos as a save_to_disk folder, a folder of parquet files (two for train), shards written by
    write_shards (3 train shards), and shards written by webdataset's TarWriter (json labels by name)."""
    root = tmp_path_factory.mktemp("sources")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=SCENES)})
    table = datasets.DatasetDict({
        split: datasets.Dataset.from_dict({"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in rows],
                                           "label": [label for _, label in rows]}, features=features)
        for split, rows in photos.items()})
    table.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for i in range(2):
        table["train"].shard(2, i).to_parquet(str(root / "parquet" / f"train-0000{i}-of-00002.parquet"))
    table["validation"].to_parquet(str(root / "parquet" / "validation-00000-of-00001.parquet"))
    folder = root / "folder"
    for split, rows in photos.items():
        for path, label in rows:
            (folder / split / SCENES[label]).mkdir(parents=True, exist_ok=True)
            (folder / split / SCENES[label] / path.name).symlink_to(path)
    write_shards(find_dataset(folder), root / "shards", shard_size=5)
    (root / "wds").mkdir()
    for split, rows in photos.items():
        for shard in range(2):
            with wds.TarWriter(str(root / "wds" / f"{split}-{shard}.tar")) as sink:
                for i, (path, label) in enumerate(rows[shard::2]):
                    sink.write({"__key__": f"{shard}-{i}", "jpg": path.read_bytes(),
                                "json": {"label": SCENES[label]}})
    (root / "wds" / "classes.txt").write_text("\n".join(SCENES) + "\n")
    return {"saved": root / "saved", "parquet": root / "parquet", "folder": folder,
            "shards": root / "shards" / "train-{000000..000002}.tar", "wds": root / "wds" / "train-{0..1}.tar",
            "shards_val": root / "shards" / "val-{000000..000001}.tar",
            "wds_val": root / "wds" / "validation-{0..1}.tar"}


def _splits(sources, kind: str, streaming: bool = False):
    val_data = str(sources[f"{kind}_val"]) if kind in ("shards", "wds") else None
    return find_dataset(sources[kind], streaming=streaming, val_data=val_data)


def _stream_samples(stream):
    return [(image, label) for _, image, label in stream.records(0, 1, None)]


@pytest.mark.parametrize("kind, streaming", [("saved", False), ("parquet", False), ("parquet", True),
                                             ("shards", False), ("wds", False)])
def test_every_source_gives_the_photos_with_their_labels(sources, photos, kind, streaming):
    splits = _splits(sources, kind, streaming)
    assert splits.classes == SCENES and not splits.multi_label and splits.streamed == (streaming or kind in (
        "shards", "wds"))
    for found, split in ((splits.train, "train"), (splits.val, "validation")):
        samples = _stream_samples(found) if splits.streamed else found
        assert id_labels(samples) == id_labels(photos[split]), split


def _epoch_ids(stream, batch: int, steps: int, epoch: int, rank: int = 0, world: int = 1,
               workers: int = 0) -> list[tuple[int, int]]:
    dataset = StreamDataset(stream, pixel_ids, rank, world)
    loader = build_loader(dataset, batch, train=True, workers=workers)
    return [(int(i), int(label)) for images, labels in stream_batches(loader, 0, epoch, steps)
            for i, label in zip(images.flatten(), labels)]


@pytest.mark.parametrize("kind", [pytest.param("parquet", marks=pytest.mark.slow), "shards"])  # parquet: ~30 s
def test_a_streamed_epoch_reads_each_image_once_across_workers_and_ranks(sources, photos, kind):
    expected = sorted((content_id(p), label) for p, label in photos["train"])
    stream = _splits(sources, kind, streaming=True).train
    one = _epoch_ids(stream, batch=4, steps=3, epoch=0)
    assert sorted(one) == expected
    assert sorted(_epoch_ids(stream, 4, 3, epoch=1)) == expected and _epoch_ids(stream, 4, 3, epoch=1) != one
    two_workers = _epoch_ids(stream, batch=3, steps=4, epoch=0, workers=2)  # partial worker batches are joined
    assert sorted(two_workers) == expected
    ranks = [_epoch_ids(stream, batch=2, steps=3, epoch=0, rank=r, world=2, workers=2) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == expected


class _Batches:
    """A stand-in loader whose workers hand over batches of these sizes (partial ones at the end of their shares)."""

    batch_size = 4
    dataset = SimpleNamespace(set_epoch=lambda *args: None, name="fake")

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def __iter__(self):
        start = 0
        for size in self.sizes:
            yield torch.arange(start, start + size), torch.arange(start, start + size) % 3
            start += size


def test_partial_batches_are_joined_into_full_ones():
    batches = list(stream_batches(_Batches([3, 1, 3, 2, 3]), seed=0, epoch=0, count=3))
    assert [images.tolist() for images, _ in batches] == [list(range(0, 4)), list(range(4, 8)), list(range(8, 12))]
    assert [labels.tolist() for _, labels in batches][1] == [1, 2, 0, 1]


def test_an_epoch_longer_than_the_data_starts_another_pass(sources, photos):
    stream = _splits(sources, "shards").train
    ids = Counter(i for i, _ in _epoch_ids(stream, batch=5, steps=4, epoch=0))  # 20 images of 12
    assert sorted(ids.values()) == [1] * 4 + [2] * 8


@pytest.mark.parametrize("kind, streaming", [("saved", False), ("parquet", True), ("wds", False)])
def test_training_runs_from_each_source(sources, tiny_model_dir, tmp_path, kind, streaming):
    val_data = str(sources[f"{kind}_val"]) if kind == "wds" else None
    result = finetune(data=str(sources[kind]), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"),
                      streaming=streaming, val_data=val_data, steps_per_epoch=3, **QUICK)
    assert result.epochs_done == 1 and result.metrics[0]["val_images"] == len(SCENES) * VAL
    names = json.loads((tmp_path / "run" / "config.json").read_text())["label_names"]
    assert names == SCENES


def test_a_resume_keeps_the_runs_dataset_configuration_revision_and_streaming(sources, tiny_model_dir, tmp_path):
    """Another configuration or revision is other data; --streaming changes how epochs are cut from it, so a
    mid-epoch resume would skip other images than it trained on."""
    run = tmp_path / "run"
    finetune(data=str(sources["parquet"]), pretrained=str(tiny_model_dir), output=str(run), **QUICK)
    for change, was in ((dict(streaming=True, steps_per_epoch=3), "--streaming False (not True)"),
                        (dict(data_config="small"), "--data-config None (not 'small')"),
                        (dict(data_revision="v2"), "--data-revision None (not 'v2')")):
        with pytest.raises(VitftError, match=f"a resumed run keeps its own {re.escape(was)}"):
            finetune(resume=run, epochs=2, **change)


def test_streaming_writes_no_copy_of_the_dataset(sources, tiny_model_dir, tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    finetune(data=str(sources["parquet"]), pretrained=str(tiny_model_dir), output=str(tmp_path / "run"),
             streaming=True, steps_per_epoch=3, **QUICK)
    assert not [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock"]  # no arrow file, no download
    find_dataset(sources["parquet"])  # while reading it whole does write the arrow cache
    assert list(cache.rglob("*.arrow"))


@pytest.mark.slow  # a subprocess: several seconds
def test_streaming_from_the_hub_downloads_no_file_whole(sources, tiny_model_dir, tmp_path):
    """A dataset repo on the local Hub look-alike, read with --streaming by `vitft finetune` in a subprocess
    (huggingface_hub reads HF_ENDPOINT and HF_HOME at import): it trains, and HF_HOME holds no copy of any file."""
    from hub_server import GITATTRIBUTES, HubServer, Repo, lfs_pointer
    from test_hub import hub_env

    parquet = sorted(sources["parquet"].glob("*.parquet"))
    with HubServer() as hub:
        files = {".gitattributes": GITATTRIBUTES}
        for path in parquet:  # stored as LFS objects, as the Hub stores parquet files
            data = path.read_bytes()
            hub.lfs_objects[hashlib.sha256(data).hexdigest()] = data
            files[f"data/{path.name}"] = lfs_pointer(hashlib.sha256(data).hexdigest(), len(data))
        repo = Repo("user/photos", private=False)
        repo.refs["main"] = hub._new_commit(repo, None, files, "parquet files")
        hub.repos["user/photos"] = repo
        home = tmp_path / "hf-home"
        proc = subprocess.run([sys.executable, "-m", "vit_finetune", "finetune", "--data", "hf:user/photos",
                               "--streaming", "--steps-per-epoch", "3", "--pretrained", str(tiny_model_dir),
                               "--output", str(tmp_path / "run"), "--epochs", "1", "--batch-size", "4",
                               "--workers", "0", "--device", "cpu", "--quiet"],
                              env=dict(hub_env(hub.url, home), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert [r.route for r in hub.requests].count("lfs-download") >= len(parquet)
    assert "hf:user/photos [Hugging Face dataset (streamed)" in proc.stdout + proc.stderr
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[1].split(",")[rows[0].split(",").index("val_images")] == str(len(SCENES) * VAL)
    kept = [p for p in home.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in kept) < min(p.stat().st_size for p in parquet), kept


def test_evaluate_reads_a_hugging_face_dataset_and_shards(sources, tiny_model_dir, tmp_path):
    from vit_finetune.tasks.evaluate import evaluate

    run = tmp_path / "run"
    finetune(data=str(sources["saved"]), pretrained=str(tiny_model_dir), output=str(run), **QUICK)
    report = evaluate(run, str(sources["saved"]), device="cpu", precision="fp32", workers=0, output=None)
    assert report.num_images == len(SCENES) * VAL and report.data["split"] == "val"
    on_shards = evaluate(run, str(sources["shards_val"]), device="cpu", precision="fp32", workers=0, output=None)
    assert on_shards.num_images == len(SCENES) * VAL and on_shards.accuracy == report.accuracy
    assert on_shards.predictions[0]["path"].startswith(str(sources["shards"].parent / "val-000000.tar"))


@pytest.mark.slow  # torchrun: several seconds
def test_two_gloo_processes_read_each_image_once_and_train(sources, photos, tiny_model_dir, tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run([*cmd, str(script), str(sources["shards"]), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    seen = [tuple(x) for r in range(2) for x in json.loads((tmp_path / f"rank{r}.json").read_text())]
    assert sorted(seen) == sorted((content_id(p), label) for p, label in photos["train"])
    proc = subprocess.run([*cmd, "-m", "vit_finetune", "finetune", "--data", str(sources["shards"]), "--val-data",
                           str(sources["shards_val"]), "--pretrained", str(tiny_model_dir), "--output",
                           str(tmp_path / "run"), "--epochs", "2", "--batch-size", "2", "--steps-per-epoch", "3",
                           "--workers", "2", "--device", "cpu", "--quiet"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].split(",")[rows[0].split(",").index("val_images")] == str(len(SCENES) * VAL)


RANKS_SCRIPT = """
import json, sys, zlib, torch, torch.distributed as dist
from vit_finetune.data.datasets import find_dataset
from vit_finetune.data.loaders import build_loader
from vit_finetune.data.streams import StreamDataset, stream_batches
dist.init_process_group("gloo")
rank = dist.get_rank()
ids = lambda image: {"image": torch.tensor([zlib.crc32(image.tobytes())])}
dataset = StreamDataset(find_dataset(sys.argv[1], val_data=sys.argv[1]).train, ids, rank, 2)
loader = build_loader(dataset, 2, train=True, workers=2)
seen = [(int(i), int(l)) for x, y in stream_batches(loader, 0, 0, 3) for i, l in zip(x.flatten(), y)]
open(f"{sys.argv[2]}/rank{rank}.json", "w").write(json.dumps(seen))
dist.destroy_process_group()
"""


def test_vitft_shards_writes_shards_that_train(sources, photos, tmp_path):
    out = tmp_path / "out"
    result = invoke_cli("shards", sources["saved"], out, "--shard-size", "5")
    assert result.exit_code == 0, result.output
    assert "train: 3 shards" in result.output and "val: 2 shards" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["classes.json", "train-000000.tar", "train-000001.tar",
                                                      "train-000002.tar", "val-000000.tar", "val-000001.tar"]
    assert json.loads((out / "classes.json").read_text()) == SCENES
    splits = find_dataset(str(out / "train-{000000..000002}.tar"), val_data=str(out / "val-{000000..000001}.tar"))
    assert id_labels(_stream_samples(splits.val)) == id_labels(photos["validation"])


def test_vitft_shards_refuses_to_mix_with_old_shards_unless_overwrite(sources, tmp_path):
    """Shards written over older ones of another --shard-size would leave stale train-0000NN.tar beside the new."""
    out = tmp_path / "out"
    assert invoke_cli("shards", sources["saved"], out, "--shard-size", "1").exit_code == 0
    refused = invoke_cli("shards", sources["saved"], out, "--shard-size", "5")
    assert refused.exit_code == 1 and "already holds 18 shard(s)" in refused.output
    assert "--overwrite" in refused.output and len(list(out.glob("train-*.tar"))) == 12
    assert invoke_cli("shards", sources["saved"], out, "--shard-size", "5", "--overwrite").exit_code == 0
    assert sorted(p.name for p in out.glob("*")) == ["classes.json", "train-000000.tar", "train-000001.tar",
                                                      "train-000002.tar", "val-000000.tar", "val-000001.tar"]
    again = find_dataset(str(out / "train-{000000..000002}.tar"), val_data=str(out / "val-{000000..000001}.tar"))
    with pytest.raises(VitftError, match="holds the shards being read: write the new shards to another folder"):
        write_shards(again, out, overwrite=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(VitftError, match="is a file, not a folder: give a folder for the shards"):
        write_shards(find_dataset(sources["saved"]), tmp_path / "file")


def test_lists_of_class_labels_make_the_task_multi_label(photos, tmp_path):
    labels = datasets.Sequence(datasets.ClassLabel(names=SCENES))
    features = datasets.Features({"image": datasets.Image(), "labels": labels})
    rows = photos["train"][:6]
    tags = [[label, (label + 1) % 3] if i % 2 else [label] for i, (_, label) in enumerate(rows)]
    table = {"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in rows], "labels": tags}
    datasets.Dataset.from_dict(table, features=features).save_to_disk(str(tmp_path / "d"))
    splits = find_dataset(tmp_path / "d", val_split=0.34)
    assert splits.multi_label and splits.classes == SCENES
    found = {content_id(image): label for image, label in splits.train + splits.val}
    assert found == {content_id(p): tuple(sorted(t)) for (p, _), t in zip(rows, tags)}


def test_a_label_column_of_strings_names_the_classes(photos, tmp_path):
    """Parquet written by pandas or a labelling tool has labels as text, not a ClassLabel: the sorted names are the
    classes (or --label-names, in their order); a stream, which cannot be listed first, needs --label-names."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("string")})
    table = datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in rows],
         "label": [SCENES[label] for _, label in rows]}, features=features) for split, rows in photos.items()})
    for split, rows in table.items():
        rows.to_parquet(str(tmp_path / "pq" / f"{split}-00000-of-00001.parquet"))
    splits = find_dataset(tmp_path / "pq")
    assert splits.classes == SCENES and id_labels(splits.train) == id_labels(photos["train"])
    reverse = find_dataset(tmp_path / "pq", label_names=",".join(reversed(SCENES)))
    assert {content_id(image): label for image, label in reverse.val} == {
        content_id(p): 2 - label for p, label in photos["validation"]}
    with pytest.raises(VitftError, match="label column 'label' holds names, which a stream cannot list before"):
        find_dataset(tmp_path / "pq", streaming=True)
    streamed = find_dataset(tmp_path / "pq", streaming=True, label_names=",".join(SCENES))
    assert id_labels(_stream_samples(streamed.train)) == id_labels(photos["train"])


def test_plain_parquet_with_image_paths_or_bytes_is_read(photos, tmp_path):
    """Parquet written without datasets' features (pyarrow, pandas) holds images as path strings (relative to
    its folder, or absolute) or as {bytes, path} structs in a column named like an image. A path to no file is
    counted as images that cannot be read are, also in a stream."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "plain" / "images").mkdir(parents=True)
    for path, _ in photos["train"] + photos["validation"]:
        (tmp_path / "plain" / "images" / path.name).symlink_to(path)
    for split, rows in photos.items():
        names = [f"images/{p.name}" if i % 2 else str(tmp_path / "plain" / "images" / p.name)
                 for i, (p, _) in enumerate(rows)]
        labels = [SCENES[label] for _, label in rows]
        if split == "train":
            names, labels = names + ["images/gone.jpg"], labels + ["sea"]
        pq.write_table(pa.table({"path": names, "label": labels}), tmp_path / "plain" / f"{split}.parquet")
    splits = find_dataset(tmp_path / "plain")
    assert splits.classes == SCENES and id_labels(splits.val) == id_labels(photos["validation"])
    assert id_labels(splits.train[:-1]) == id_labels(photos["train"]) and str(splits.train[-1][0]).endswith("#12")
    stream = StreamDataset(find_dataset(tmp_path / "plain", streaming=True, label_names=",".join(SCENES)).train,
                           pixel_ids)
    assert Counter(int(label) for _, label in stream) == Counter(label for _, label in photos["train"])
    assert int(stream._failed) == 1
    rows = photos["train"]
    pq.write_table(pa.table({"image": [{"bytes": p.read_bytes(), "path": p.name} for p, _ in rows],
                             "label": [label for _, label in rows]}), tmp_path / "bytes.parquet")
    splits = find_dataset(tmp_path / "bytes.parquet", val_split=0.25, label_names=",".join(SCENES))
    assert splits.classes == SCENES and id_labels(splits.train + splits.val) == id_labels(rows)


# ---- bad input -------------------------------------------------------------------------------------------------
def test_a_dataset_without_an_image_column_is_an_error(tmp_path):
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=SCENES)})
    datasets.Dataset.from_dict({"text": ["a"], "label": [0]}, features=features).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(VitftError, match=r"has no image column \(an Image feature, or paths .*\) among text, label"):
        find_dataset(tmp_path / "d")


def test_a_dataset_without_a_train_split_is_an_error(sources, tmp_path):
    saved = datasets.load_from_disk(str(sources["saved"]))
    datasets.DatasetDict({"unseen": saved["train"], "validation": saved["validation"]}).save_to_disk(str(tmp_path))
    with pytest.raises(VitftError, match=r"has no train split \(its splits: unseen, validation\); name one 'train'"):
        find_dataset(tmp_path)


def test_numbered_labels_need_names(sources, photos, tmp_path):
    (tmp_path / "shards").mkdir()
    with wds.TarWriter(str(tmp_path / "shards" / "train-0.tar")) as sink:
        for i, (path, label) in enumerate(photos["train"]):
            sink.write({"__key__": str(i), "jpg": path.read_bytes(), "cls": label})
    pattern = str(tmp_path / "shards" / "train-{0..0}.tar")
    with pytest.raises(VitftError, match="no class names for .*write classes.json or classes.txt"):
        find_dataset(pattern, val_data=pattern)
    assert find_dataset(pattern, val_data=pattern, label_names="buildings, forest,sea").classes == SCENES


def test_shards_with_dotted_and_uppercase_names_are_read_and_samples_without_labels_counted(photos, tmp_path,
                                                                                           caplog):
    """webdataset keys a member by its name up to the first dot: 'a.b.jpg' is key 'a' with field 'b.jpg', and
    'a.jpg' beside it joins the same sample. Each name before the extension is an image of its own."""
    names = ["a.b", "a", "x.y.z", "UPPER", "a b", "\u00fcn\u00ef"]
    rows = photos["train"][:len(names)]
    with tarfile.open(tmp_path / "train-0.tar", "w") as tar:
        for name, (path, label) in zip(names, rows):
            suffix = ".JPG" if name == "UPPER" else ".jpg"
            for member, data in ((name + suffix, path.read_bytes()), (name + ".cls", str(label).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("unlabelled.jpg")
        info.size = len(rows[0][0].read_bytes())
        tar.addfile(info, io.BytesIO(rows[0][0].read_bytes()))
    shard = str(tmp_path / "train-0.tar")
    found = find_dataset(shard, val_data=shard, label_names=",".join(SCENES)).train
    assert id_labels(_stream_samples(found)) == id_labels(rows)
    assert "left out 1 sample(s) without an image" in caplog.text and "unlabelled" in caplog.text


def test_an_empty_shard_is_skipped_with_a_warning(sources, photos, tmp_path, caplog):
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    shards = find_dataset(f"{{{sources['shards'].parent}/train-000000.tar,{empty}}}",
                          val_data=str(sources["shards_val"]), label_names=",".join(SCENES))
    assert len(_stream_samples(shards.train)) == 5  # the first shard's
    assert "skipped a shard that cannot be read" in caplog.text
    only_empty = find_dataset(str(empty), val_data=str(empty), label_names=",".join(SCENES)).train
    with pytest.raises(VitftError, match="a pass over the data gave no readable image"):
        _epoch_ids(only_empty, batch=2, steps=1, epoch=0)


def test_streams_need_steps_per_epoch_and_a_validation_split(sources, tiny_model_dir, tmp_path):
    with pytest.raises(VitftError, match="read as a stream, which has no length: give --steps-per-epoch"):
        finetune(data=str(sources["parquet"]), pretrained=str(tiny_model_dir), output=str(tmp_path / "a"),
                 streaming=True, **QUICK)
    with pytest.raises(VitftError, match="--balance sampler needs the class counts of a list of images"):
        finetune(data=str(sources["parquet"]), pretrained=str(tiny_model_dir), output=str(tmp_path / "b"),
                 streaming=True, steps_per_epoch=3, balance="sampler", **QUICK)
    with pytest.raises(VitftError, match=r"cached features \(--feature-views\) need a list of images"):
        finetune(data=str(sources["parquet"]), pretrained=str(tiny_model_dir), output=str(tmp_path / "c"),
                 streaming=True, steps_per_epoch=3, train_blocks=1, **QUICK)
    with pytest.raises(VitftError, match="has no validation split to stream; give one"):
        find_dataset(sources["shards"])
    with pytest.raises(VitftError, match="--streaming reads a Hugging Face dataset"):
        find_dataset(sources["folder"], streaming=True)


def test_missing_packages_name_the_extra(sources, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(VitftError, match=r"needs the datasets package: pip install 'vit-finetune\[datasets\]'"):
        find_dataset(sources["saved"])
    monkeypatch.setitem(sys.modules, "webdataset", None)
    with pytest.raises(VitftError, match=r"needs the webdataset package: pip install 'vit-finetune\[webdataset\]'"):
        find_dataset(sources["shards"], val_data=str(sources["shards_val"]))


def test_an_unreachable_hub_fails_at_once(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(VitftError, match="the Hub cannot be reached .* set HF_DATASETS_OFFLINE=1"):
        find_dataset("hf:someone/photos")

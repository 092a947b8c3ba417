"""Facts about vit_finetune.hub: export (timm format, dtype, model card) and push, through the real
huggingface_hub client against a local Hub look-alike (tests/hub_server.py).

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_TOKEN at import time, so every push and every load
from the Hub runs in a subprocess with its own environment.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CLASSES, TINY
from conftest import REPO as CHECKOUT
from hub_server import HubServer, lfs_pointer, put_files
from safetensors.torch import load

from vit_finetune.errors import VitftError
from vit_finetune.hub.card import base_model
from vit_finetune.hub.export import export
from vit_finetune.hub.push import resolve_token

TOKEN = "hf_vitftTestToken0123456789abcdef"
TOKEN2 = "hf_otherTestToken9876543210fedcba"
REPO = "user/tiny-intel"
REPORT = {"accuracy": 0.8125, "top5": 0.99, "loss": 0.61, "macro_f1": 0.8, "weighted_f1": 0.81, "num_images": 60,
          "images_per_s": 100.0,
          "per_class": {c: {"precision": 0.8, "recall": 0.75, "f1": 0.77, "support": 10} for c in CLASSES},
          "confused_pairs": [], "classes": CLASSES, "confusion": [[10] * len(CLASSES)] * len(CLASSES),
          "absent_classes": [], "skipped": [], "model": {}, "preprocessing": {}, "runtime": {},
          "data": {"root": "/data/intel/seg_test", "split": "test", "num_images": 60}}  # report.json's schema
BASE = "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"
LOGITS = """
import json, sys, torch
kind, name, x_path = sys.argv[1:4]
if kind == "timm":
    import timm
    model = timm.create_model(name, pretrained=True)
else:
    from vit_finetune import create_model
    model = create_model(name, pretrained=True)
with torch.no_grad():
    logits = model.eval()(torch.load(x_path))
print(json.dumps({"logits": logits.tolist(), "labels": model.pretrained_cfg.get("label_names"),
                  "module": type(model).__module__}))
"""


# ---- helpers ------------------------------------------------------------------------------------------
def hub_env(endpoint: str, home: Path, token: str | None = None, tmp: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost",
               no_proxy="127.0.0.1,localhost", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HUB_DISABLE_XET="1")  # the test Hub serves LFS, not Xet (see hub_server.py)
    if token is not None:
        env["HF_TOKEN"] = token
    if tmp is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
    return env


def vitft(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from vit_finetune.cli import main; main()", *args],
                          env=env, capture_output=True, text=True, timeout=180)


def vitft_many(*invocations: list[str], env: dict) -> subprocess.CompletedProcess:
    """Several `vitft` commands in one process (one interpreter start); stops at the first failure."""
    code = ("import json, sys\nfrom vit_finetune.cli import app\n"
            "for args in json.loads(sys.argv[1]):\n"
            "    try:\n        app(args, prog_name='vitft')\n"
            "    except SystemExit as exit:\n        if exit.code:\n            raise\n")
    return subprocess.run([sys.executable, "-c", code, json.dumps(invocations)], env=env, capture_output=True,
                          text=True, timeout=240)


def files_containing(secret: str, *roots: Path) -> list[Path]:
    return [p for root in roots for p in Path(root).rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def card_data(text: str):
    from huggingface_hub import ModelCard

    return ModelCard(text).data


def reference_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    from vit_finetune import load_model

    with torch.no_grad():
        return load_model(str(folder)).eval()(x)


def timm_local_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    import timm

    model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert type(model).__module__ == "timm.models.vision_transformer"
    with torch.no_grad():
        return model(x)


# ---- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model as a finished, evaluated run: vitft key, report.json, metrics.csv, curves.png."""
    run = tmp_path_factory.mktemp("hub") / "run"
    shutil.copytree(tiny_model_dir, run)
    config = json.loads((run / "config.json").read_text())
    config["vitft"] = {"train": {"data": "/data/intel", "pretrained": "vit_b_16", "model": None, "epochs": 3,
                                 "batch_size": 32, "lr": 5e-4, "img_size": 32, "output": "/runs/x"},
                       "data": {"root": "/data/intel", "layout": "Intel (seg_train/seg_test)", "classes": CLASSES,
                                "counts": {"train": {c: 40 for c in CLASSES}, "val": {c: 10 for c in CLASSES}}},
                       "best": {"epoch": 3, "val_top1": 0.75}}
    (run / "config.json").write_text(json.dumps(config, indent=2))
    (run / "report.json").write_text(json.dumps(REPORT))
    (run / "metrics.csv").write_text("epoch,train_loss,val_top1\n1,1.7,0.5\n2,1.2,0.7\n3,0.9,0.75\n")
    (run / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    return run


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hub():
    with HubServer(tokens={TOKEN, TOKEN2}) as server:
        yield server


@pytest.fixture(scope="module")
def pushed(hub, run, tmp_path_factory) -> dict:
    """`vitft push RUN user/tiny-intel` with the token in HF_TOKEN."""
    base = tmp_path_factory.mktemp("push")
    home, tmp = base / "hf_home", base / "tmp"
    home.mkdir()
    proc = vitft("push", str(run), REPO, env=hub_env(hub.url, home, TOKEN, tmp))
    return {"proc": proc, "home": home, "tmp": tmp, "requests": list(hub.requests)}


# ---- push --------------------------------------------------------------------------------------------
def test_push_uploads_the_run_with_a_model_card(pushed, hub, run):
    proc = pushed["proc"]
    assert proc.returncode == 0, proc.stderr
    head = hub.head(REPO)
    assert f"{hub.url}/{REPO}" in proc.stdout and f"commit: {head}" in proc.stdout
    files = hub.files(REPO)
    assert {"config.json", "model.safetensors", "README.md", "curves.png"} <= set(files)
    assert "report.json" not in files and "metrics.csv" not in files  # only what the card shows
    config = json.loads(files["config.json"])
    assert config["architecture"] == "vit_tiny_patch16_224" and config["label_names"] == CLASSES
    card = files["README.md"].decode()
    data = card_data(card)
    assert data.library_name == "timm" and data.pipeline_tag == "image-classification"
    assert set(data.tags) >= {"image-classification", "timm", "vitft", "vision-transformer"}
    assert data.base_model == BASE and data.license == "apache-2.0"
    accuracy = [r for r in data.eval_results if r.metric_type == "accuracy"]
    assert accuracy[0].metric_value == pytest.approx(REPORT["accuracy"])
    assert accuracy[0].task_type == "image-classification" and accuracy[0].dataset_split == "test"
    assert f'timm.create_model("hf-hub:{REPO}", pretrained=True)' in card
    assert f"vitft predict hf-hub:{REPO} images/" in card and "![Training curves](curves.png)" in card
    assert all(label in card for label in CLASSES) and "/data/intel" not in card + files["config.json"].decode()


def test_push_token_goes_to_the_server_only(pushed, run):
    requests = pushed["requests"]
    assert [r.route for r in requests][:1] == ["create"] and "commit" in [r.route for r in requests]
    assert {r.authorization for r in requests if r.route != "lfs-upload"} == {f"Bearer {TOKEN}"}
    assert [r.authorization for r in requests if r.route == "lfs-upload"] == [None]  # the storage gets no token
    proc = pushed["proc"]
    assert TOKEN not in proc.stdout + proc.stderr
    assert files_containing(TOKEN, run, pushed["home"], pushed["tmp"]) == []
    assert list(pushed["tmp"].iterdir()) == []  # the temporary export folder is gone


def test_push_uploads_the_weights_through_lfs_and_they_download_intact(pushed, hub, run, tmp_path):
    """model.safetensors takes the Hub's LFS path: preupload answers "lfs", the client asks the LFS batch API, PUTs
    the bytes to the signed storage URL, verifies them, and the commit names the object; the repo holds the LFS
    pointer, and a download (redirected to the storage) returns the exact bytes."""
    assert pushed["proc"].returncode == 0, pushed["proc"].stderr
    routes = [r.route for r in pushed["requests"]]
    assert routes.count("lfs-upload") == 1
    assert routes.index("preupload") < routes.index("lfs-batch") < routes.index("lfs-upload") \
        < routes.index("lfs-verify") < routes.index("commit")
    exported = (export(run, tmp_path / "export", repo_id=REPO) / "model.safetensors").read_bytes()
    oid = hashlib.sha256(exported).hexdigest()
    assert hub.lfs_files(REPO) == {"model.safetensors": (oid, len(exported))}  # only the weights are LFS
    assert hub.blobs(REPO)["model.safetensors"] == lfs_pointer(oid, len(exported))
    assert hub.lfs_objects[oid] == exported
    script = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
              "print(hf_hub_download(sys.argv[1], 'model.safetensors'))")
    start = len(hub.requests)
    proc = subprocess.run([sys.executable, "-c", script, REPO], env=hub_env(hub.url, tmp_path / "home"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    downloaded = Path(proc.stdout.strip().splitlines()[-1]).read_bytes()
    assert hashlib.sha256(downloaded).hexdigest() == oid and downloaded == exported
    assert {r.route for r in hub.requests[start:]} == {"resolve", "lfs-download"}


def test_pushed_repo_loads_in_timm_and_vitft(pushed, hub, run, x, tmp_path):
    assert pushed["proc"].returncode == 0
    torch.save(x, tmp_path / "x.pt")
    expected = reference_logits(run, x)
    kinds = {"timm": "timm.models.vision_transformer", "vitft": "vit_finetune.models.vit"}
    procs = {kind: subprocess.Popen(  # both at once; each with a fresh cache and no token (the repo is public)
        [sys.executable, "-c", LOGITS, kind, f"hf-hub:{REPO}", str(tmp_path / "x.pt")],
        env=hub_env(hub.url, tmp_path / f"home_{kind}"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for kind in kinds}
    for kind, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["module"] == kinds[kind] and out["labels"] == CLASSES
        torch.testing.assert_close(torch.tensor(out["logits"]), expected, atol=1e-5, rtol=0)
    assert [r.authorization for r in hub.requests if r.route == "resolve"][-4:] == [None] * 4


def test_later_pushes_keep_the_card_overwrite_it_or_open_a_pr(pushed, hub, run, tmp_path):
    assert pushed["proc"].returncode == 0
    edited = put_files(hub, REPO, {"README.md": b"---\nlicense: mit\n---\n# My own card\n"})
    home = tmp_path / "home"
    home.mkdir()
    (home / "token").write_text(TOKEN2)  # a cached `hf auth login`, no HF_TOKEN
    start = len(hub.requests)
    proc = vitft_many(
        ["push", str(run), REPO],  # 1. the card edited on the Hub stays (and nothing else changed)
        ["push", str(run), REPO, "--overwrite-card", "--token", TOKEN, "--commit-message", "new card"],  # 2.
        ["push", str(run), REPO, "--create-pr", "--dtype", "fp16"],  # 3. a PR with fp16 weights; main untouched
        env=hub_env(hub.url, home))
    assert proc.returncode == 0, proc.stderr
    first, second, third = proc.stdout.split("pushed to ")[1:]
    assert f"commit: {edited}" in first
    assert hub.commit_log(REPO)[:2] == ["new card", "edit on the Hub"]  # push 1 committed nothing
    assert card_data(hub.files(REPO)["README.md"].decode()).library_name == "timm"
    assert f"pull request: {hub.url}/{REPO}/discussions/1" in third
    weights = load(hub.files(REPO, "refs/pr/1")["model.safetensors"])
    assert weights["head.weight"].dtype == torch.float16 and hub.commit_log(REPO)[0] == "new card"
    # the cached login for pushes 1 and 3, --token (which wins over it) for push 2
    runs = [auth for auth, _ in itertools.groupby(r.authorization for r in hub.requests[start:]
                                                  if r.route != "lfs-upload")]
    assert runs == [f"Bearer {TOKEN2}", f"Bearer {TOKEN}", f"Bearer {TOKEN2}"]
    assert TOKEN not in proc.stdout + proc.stderr and TOKEN2 not in proc.stdout + proc.stderr


def test_push_private_to_a_revision(hub, run, tmp_path):
    """--private creates the repo private; --revision commits to that branch (created from main), main untouched."""
    repo = "user/private-intel"
    proc = vitft("push", str(run), repo, "--private", "--revision", "dev", "--commit-message", "to dev",
                 env=hub_env(hub.url, tmp_path / "home", TOKEN, tmp_path / "tmp"))
    assert proc.returncode == 0, proc.stderr
    assert hub.repos[repo].private is True
    assert hub.commit_log(repo, "dev") == ["to dev", "initial commit"]
    assert hub.commit_log(repo) == ["initial commit"] and set(hub.files(repo)) == {".gitattributes"}
    assert {"config.json", "model.safetensors", "README.md"} <= set(hub.files(repo, "dev"))
    assert f"commit: {hub.head(repo, 'dev')}" in proc.stdout
    anonymous = subprocess.run(  # private: without a token the repo does not exist
        [sys.executable, "-c", "import sys\nfrom huggingface_hub import hf_hub_download\n"
         "hf_hub_download(sys.argv[1], 'config.json', revision='dev')", repo],
        env=hub_env(hub.url, tmp_path / "anonymous"), capture_output=True, text=True, timeout=120)
    assert anonymous.returncode != 0 and "RepositoryNotFoundError" in anonymous.stderr


def test_finetune_push_to_hub(hub, small_images, tiny_model_dir, tmp_path):
    """--push-to-hub: without a token, the run fails before training starts; with one, the best model is pushed
    when training ends."""
    repo = "user/finetuned"
    train = ["finetune", "--data", str(small_images), "--pretrained", str(tiny_model_dir), "--epochs", "1",
             "--batch-size", "8", "--workers", "0", "--max-steps-per-epoch", "2", "--quiet", "--push-to-hub", repo]
    start = len(hub.requests)
    (tmp_path / "empty_home").mkdir()
    no_token = vitft(*train, "--output", str(tmp_path / "refused"), env=hub_env(hub.url, tmp_path / "empty_home"))
    assert no_token.returncode == 1 and "no Hugging Face token" in no_token.stdout + no_token.stderr
    assert not (tmp_path / "refused").exists() and len(hub.requests) == start  # nothing trained, nothing sent
    out = tmp_path / "run"
    proc = vitft(*train, "--output", str(out), env=hub_env(hub.url, tmp_path / "home", TOKEN, tmp_path / "tmp"))
    assert proc.returncode == 0, proc.stderr
    pushed = load(hub.files(repo)["model.safetensors"])
    best = load((out / "model.safetensors").read_bytes())
    assert pushed.keys() == best.keys() and all(torch.equal(pushed[k], best[k]) for k in best)
    assert json.loads(hub.files(repo)["config.json"])["label_names"] == CLASSES
    assert hub.commit_log(repo)[0] == "Upload run with vitft" and repo in hub.files(repo)["README.md"].decode()


def test_token_precedence_is_the_argument_then_hf_token_then_the_cached_login(monkeypatch, tmp_path):
    from huggingface_hub import constants

    cached = tmp_path / "token"
    cached.write_text("hf_cached\n")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cached))  # where `hf auth login` keeps it
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert resolve_token("hf_explicit") == "hf_explicit"
    assert resolve_token(None) == resolve_token("  ") == "hf_from_env"
    monkeypatch.delenv("HF_TOKEN")
    assert resolve_token(None) == "hf_cached"
    cached.unlink()
    with pytest.raises(VitftError, match="no Hugging Face token: pass --token, set HF_TOKEN"):
        resolve_token(None)


def test_push_without_token_fails_before_any_request(run, tmp_path):
    with HubServer() as hub:
        (tmp_path / "home").mkdir()
        proc = vitft("push", str(run), REPO, env=hub_env(hub.url, tmp_path / "home"))
        assert proc.returncode == 1
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert len(lines) == 1 and "no Hugging Face token" in lines[0] and "HF_TOKEN" in lines[0]
        assert hub.requests == []


def test_push_permission_denied_is_one_clear_line(run, tmp_path):
    with HubServer(tokens={TOKEN}) as hub:
        hub.fail[("POST", "create")] = 403
        proc = vitft("push", str(run), REPO, env=hub_env(hub.url, tmp_path / "home", TOKEN, tmp_path / "tmp"))
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "permission denied (403)" in lines[0] and "creating the repo" in lines[0]
    assert TOKEN not in lines[0] and "Traceback" not in proc.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_push_to_unreachable_hub_is_one_clear_line(run, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = vitft("push", str(run), REPO, env=hub_env(f"http://127.0.0.1:{port}", tmp_path / "home", TOKEN))
    assert proc.returncode == 1
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Hugging Face Hub" in lines[0]


# ---- export ------------------------------------------------------------------------------------------
def test_export_is_timm_format_with_the_same_logits(run, x, tmp_path):
    out = export(run, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert {"architecture", "num_classes", "num_features", "global_pool", "label_names",
            "pretrained_cfg"} <= set(config)
    assert {"input_size", "mean", "std", "interpolation", "crop_pct"} <= set(config["pretrained_cfg"])
    assert config["model_args"]["patch_size"] == 8 and config["num_classes"] == len(CLASSES)
    torch.testing.assert_close(timm_local_logits(out, x), reference_logits(run, x), atol=1e-5, rtol=0)
    assert (out / "curves.png").read_bytes() == (run / "curves.png").read_bytes()
    card = (out / "README.md").read_text()
    assert card_data(card).library_name == "timm" and "hf-hub:<user>/<repo>" in card
    from huggingface_hub import ModelCard

    assert ModelCard.load(out / "README.md").data.base_model == BASE


def test_export_fp16_writes_fp16_tensors(run, x, tmp_path):
    """The fp16 export holds each fp32 weight rounded to the nearest fp16, and its logits stay within 2 fp16 ulps
    (at the largest logit's magnitude) of the fp32 run's. Why 2 ulps: the forward pass runs in fp32, so only the
    weights' rounding (relative error at most 2^-11) moves the logits; those errors have random signs and partly
    cancel in the dot products, so the logits move by about one relative rounding of their own size (measured: 0.6
    ulp); 2 ulps leaves room for that. bf16 keeps 3 mantissa bits fewer: rounding to it moves the logits 8x as much
    (measured: 3.6 ulps), past the tolerance, checked below."""
    from safetensors.torch import load_file

    from vit_finetune import load_model

    out = export(run, tmp_path / "fp16", dtype="fp16")
    tensors = load_file(str(out / "model.safetensors"))
    original = load_file(str(run / "model.safetensors"))
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.float16}
    assert tensors.keys() == original.keys() and all(torch.equal(tensors[k], original[k].half()) for k in original)
    assert (out / "model.safetensors").stat().st_size < (run / "model.safetensors").stat().st_size * 0.6
    fp32 = reference_logits(run, x)
    ulp = torch.finfo(torch.float16).eps * 2.0 ** math.floor(math.log2(float(fp32.abs().max())))
    torch.testing.assert_close(reference_logits(out, x), fp32, atol=2 * ulp, rtol=0)
    bf16 = load_model(str(run)).eval()
    bf16.load_state_dict({k: v.bfloat16().float() for k, v in original.items()})
    with torch.no_grad():
        assert (bf16(x) - fp32).abs().max() > 2 * ulp  # the tolerance tells fp16 from bf16
    assert "float16" in (out / "README.md").read_text()


def test_export_records_model_args_for_another_img_size(tmp_path):
    from vit_finetune import create_model, save_pretrained

    torch.manual_seed(0)
    model = create_model("vit_tiny_patch16_224", num_classes=3, **dict(TINY, img_size=48))
    save_pretrained(model, tmp_path / "run48")
    out = export(tmp_path / "run48", tmp_path / "out48")
    config = json.loads((out / "config.json").read_text())
    assert config["model_args"]["img_size"] == 48 and config["model_args"]["patch_size"] == 8
    assert config["pretrained_cfg"]["input_size"] == [3, 48, 48]
    x48 = torch.randn(2, 3, 48, 48)
    torch.testing.assert_close(timm_local_logits(out, x48), reference_logits(tmp_path / "run48", x48),
                               atol=1e-5, rtol=0)
    card = (out / "README.md").read_text()
    assert "base_model" not in card and "model-index" not in card  # from scratch, never evaluated


def test_export_errors_and_overwrite(run, tmp_path):
    with pytest.raises(VitftError, match="not found"):
        export(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(VitftError, match="no config.json"):
        export(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(VitftError, match="unknown dtype"):
        export(run, tmp_path / "out", dtype="int8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(VitftError, match="--overwrite"):
        export(run, out)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    export(run, out, overwrite=True)
    assert {"config.json", "model.safetensors", "README.md", "notes.txt"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging left behind

    from typer.testing import CliRunner

    from vit_finetune.cli import app

    result = CliRunner().invoke(app, ["export", str(run), str(out)])
    assert result.exit_code == 1 and "--overwrite" in result.output
    result = CliRunner().invoke(app, ["export", str(run), str(out), "--overwrite", "--dtype", "bf16"])
    assert result.exit_code == 0, result.output


def test_base_model_from_the_training_config(tmp_path):
    assert base_model({"pretrained": "vit_b_16"}) == BASE
    assert base_model({"model": "vit_base_patch16_224", "pretrained": "vit_base_patch16_224.augreg2_in21k_ft_in1k"}) \
        == BASE
    assert base_model({"pretrained": "hf-hub:someone/my-vit@v2"}) == "someone/my-vit"
    assert base_model({"pretrained": "none"}) is None and base_model({}) is None
    assert base_model({"pretrained": str(tmp_path)}) is None  # local weights: no Hub lineage


# ---- what goes public, what the card says, how files are replaced ---------------------------------------
def front_matter(card: str) -> dict:
    import yaml

    return yaml.safe_load(card.split("---\n")[1])


def evaluated_run_without_report(tiny_model_dir: Path, folder: Path, train: dict, **model_kwargs) -> Path:
    """The tiny model (or one built with model_kwargs) as a run with `train` as its config and a best epoch."""
    from vit_finetune import create_model, save_pretrained

    if model_kwargs:
        torch.manual_seed(0)
        model = create_model("vit_tiny_patch16_224", num_classes=len(CLASSES), **model_kwargs)
        model.pretrained_cfg["label_names"] = list(CLASSES)
        save_pretrained(model, folder)
    else:
        shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vitft"] = {"train": train, "data": {"root": "/data/intel"}, "best": {"epoch": 2, "val_top1": 0.625}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_local_weights_paths_stay_private(tiny_model_dir, tmp_path):
    from vit_finetune.hub.card import hyperparameters

    train = {"pretrained": "weights/private.pth", "model": "vit_tiny_patch16_224", "epochs": 3,
             "data": "mydata", "max_steps_per_epoch": 5}
    run = evaluated_run_without_report(tiny_model_dir, tmp_path / "run", train)
    out = export(run, tmp_path / "out")
    for name in ("README.md", "config.json"):
        text = (out / name).read_text()
        assert "private" not in text and "weights/" not in text, name
    card = (out / "README.md").read_text()  # private, but not random: the card must not claim a from-scratch run
    assert "local pretrained weights" in card and "random init" not in card and "from scratch" not in card
    exported = json.loads((out / "config.json").read_text())["vitft"]["train"]
    assert exported == {"model": "vit_tiny_patch16_224", "epochs": 3}  # no path, no bookkeeping
    assert base_model(train) is None
    public = ("vit_b_16", "vit_small_patch16_224.augreg_in21k", "hf-hub:someone/my-vit", "none")
    for value in public:
        assert hyperparameters({"pretrained": value})["pretrained"] == value
    for value in ("weights/private.pth", "private.safetensors", str(tmp_path), "runs/best", "local-dir:x"):
        assert "pretrained" not in hyperparameters({"pretrained": value}), value


def test_report_json_round_trips_through_eval_report(tmp_path):
    from vit_finetune import VitftError
    from vit_finetune.tasks.report import EvalReport

    (tmp_path / "report.json").write_text(json.dumps(REPORT))
    # a report written before balanced accuracy and f1_macro were keys reads, and gains them (from its counts)
    assert EvalReport.load(tmp_path / "report.json").to_dict() == {**REPORT, "f1_macro": REPORT["macro_f1"],
                                                                    "balanced_accuracy": pytest.approx(1 / 6)}
    (tmp_path / "report.json").write_text(json.dumps({"accuracy": 0.5}))  # not what evaluate writes
    with pytest.raises(VitftError, match="cannot read the evaluation report"):
        EvalReport.load(tmp_path / "report.json")


def test_the_card_lists_the_recipe_not_the_machine(tiny_model_dir, tmp_path):
    from vit_finetune.config import TrainConfig
    from vit_finetune.hub.card import hyperparameters

    listed = hyperparameters(TrainConfig(data="x", workers=2, device="cpu", epochs=3, lr=1e-3).to_dict())
    assert listed["epochs"] == 3 and listed["lr"] == 1e-3 and listed["min_lr"] == 1e-6
    assert not {"data", "workers", "device", "max_steps_per_epoch", "output", "quiet"} & set(listed)


def test_never_evaluated_run_has_its_validation_top1_in_the_model_index(tiny_model_dir, tmp_path):
    run = evaluated_run_without_report(tiny_model_dir, tmp_path / "run", {"pretrained": "none", "epochs": 2})
    meta = front_matter((export(run, tmp_path / "out") / "README.md").read_text())
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"]["split"] == "validation"
    assert [(m["type"], m["value"]) for m in result["metrics"]] == [("accuracy", 0.625)]
    (run / "report.json").write_text(json.dumps(REPORT))  # an evaluation replaces it
    meta = front_matter((export(run, tmp_path / "out2") / "README.md").read_text())
    (result,) = meta["model-index"][0]["results"]
    assert result["dataset"]["split"] == "test" and result["metrics"][0]["value"] == 0.8125


def test_card_lists_the_overridden_architecture_args(tiny_model_dir, tmp_path):
    run = evaluated_run_without_report(tiny_model_dir, tmp_path / "run", {"pretrained": "none"},
                                       **dict(TINY, img_size=48, depth=3, drop_path_rate=0.1))
    card = (export(run, tmp_path / "out") / "README.md").read_text()
    line = next(row for row in card.splitlines() if row.startswith("- **Architecture:**"))
    assert line.startswith("- **Architecture:** `vit_tiny_patch16_224` (timm) with depth=3, embed_dim=64, "
                           "img_size=48, num_heads=2, patch_size=8, "), line
    assert "drop_path" not in line


def test_the_card_points_at_the_project_repository(tiny_model_dir, tmp_path):
    """vitft is not on PyPI: the card links the repository (pyproject's, the one source) and installs from it."""
    import tomllib

    from vit_finetune import __url__

    urls = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["urls"]
    assert urls["Repository"] == __url__
    run = evaluated_run_without_report(tiny_model_dir, tmp_path / "run", {"pretrained": "none"})
    card = (export(run, tmp_path / "out", repo_id=REPO) / "README.md").read_text()
    assert f"with [vitft]({__url__})." in card
    assert f"```bash\npip install git+{__url__}\nvitft predict hf-hub:{REPO} images/\n```" in card
    assert "pypi.org" not in card and "pip install vit-finetune" not in card


def test_non_utf8_class_folder_in_the_card(tmp_path):
    """A class folder named with bytes that are not UTF-8: the card shows \\xe9, config.json keeps the exact name
    (evaluate matches it against the folders), and nothing fails."""
    from vit_finetune import create_model, save_pretrained

    odd = os.fsdecode(b"caf\xe9")
    model = create_model("vit_tiny_patch16_224", num_classes=2, **TINY)
    model.pretrained_cfg["label_names"] = [odd, "tea"]
    save_pretrained(model, tmp_path / "run",
                    extra_config={"vitft": {"data": {"root": str(tmp_path / odd)}, "best": {"val_top1": 0.5}}})
    out = export(tmp_path / "run", tmp_path / "out")
    card = (out / "README.md").read_bytes().decode("utf-8")  # strict
    assert "| 0 | caf\\xe9 |" in card and "- **Dataset:** caf\\xe9" in card
    assert front_matter(card)["model-index"][0]["results"][0]["dataset"]["name"] == "caf\\xe9"
    assert json.loads((out / "config.json").read_text())["label_names"] == [odd, "tea"]


def test_save_pretrained_replaces_config_then_weights(tiny_model_dir, tmp_path, monkeypatch):
    """Both files are written in full first, then renamed: config.json, then model.safetensors. A failure
    before the last rename leaves the previous weights, never new weights with the previous config.json."""
    import vit_finetune.weights.saving as saving
    from vit_finetune import create_model, save_pretrained

    folder = tmp_path / "run"
    shutil.copytree(tiny_model_dir, folder)
    old_weights = (folder / "model.safetensors").read_bytes()
    model = create_model("vit_tiny_patch16_224", num_classes=3, **TINY)
    real_replace, renamed = os.replace, []

    def replace(src, dst):
        renamed.append(Path(dst).name)
        if Path(dst).name == "config.json":
            raise OSError("disk gone")
        return real_replace(src, dst)

    monkeypatch.setattr(saving.os, "replace", replace)
    with pytest.raises(OSError, match="disk gone"):
        save_pretrained(model, folder)
    assert (folder / "model.safetensors").read_bytes() == old_weights
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]  # no temp files left
    monkeypatch.setattr(saving.os, "replace", lambda src, dst: (renamed.append(Path(dst).name),
                                                                 real_replace(src, dst)))
    renamed.clear()
    save_pretrained(model, folder)
    assert renamed == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text())["num_classes"] == 3


def test_export_overwrite_never_removes_a_file_it_replaces(run, tmp_path, monkeypatch):
    import vit_finetune.hub.export as hub_export

    out = export(run, tmp_path / "out")
    real_replace, seen = os.replace, []

    def replace(src, dst):
        seen.append((Path(dst).name, (out / "config.json").exists(), (out / "model.safetensors").exists()))
        return real_replace(src, dst)

    monkeypatch.setattr(hub_export.os, "replace", replace)
    export(run, out, overwrite=True)
    assert [name for name, *_ in seen][:2] == ["config.json", "model.safetensors"]
    assert all(config and weights for _, config, weights in seen)


def test_vitft_predict_and_timms_pipeline_give_the_same_probabilities(tiny_model_dir, intel_dir, tmp_path):
    """The card's timm snippet and `vitft predict` on real photos: same probabilities (1e-5), at 32 px. The head is
    scaled up so that probabilities follow the pixels closely (cv2's resize before this moved them by up to 0.42)."""
    import timm
    from PIL import Image

    from vit_finetune import load_model, predict, save_pretrained

    model = load_model(str(tiny_model_dir))
    with torch.no_grad():
        model.head.weight.mul_(30)  # top-1 probabilities 0.64 to 0.96 on these photos
    out = export(save_pretrained(model, tmp_path / "run"), tmp_path / "out")
    files = [sorted((intel_dir / c).iterdir())[3] for c in CLASSES]
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    transforms = timm.data.create_transform(**timm.data.resolve_model_data_config(model), is_training=False)
    with torch.no_grad():
        expected = model(torch.stack([transforms(Image.open(f).convert("RGB")) for f in files])).softmax(-1)
    rows = list(predict(str(out), files, top_k=len(CLASSES), workers=0, device="cpu", precision="fp32"))  # as timm
    labels = model.pretrained_cfg["label_names"]
    assert [row.path for row in rows] == [str(f) for f in files] and all(row.error is None for row in rows)
    for row, probs in zip(rows, expected, strict=True):
        got = dict(zip(row.labels, row.probs))
        torch.testing.assert_close(torch.tensor([got[label] for label in labels]), probs, atol=1e-5, rtol=0)


def test_export_overwrite_never_replaces_files_of_a_folder_that_is_not_an_export(tiny_model_dir, tmp_path):
    project = tmp_path / "project"  # `vitft export runs/x . --overwrite` typed in a project's root
    project.mkdir()
    (project / "README.md").write_text("my project")
    with pytest.raises(VitftError, match="no exported model"):
        export(tiny_model_dir, project, overwrite=True)
    assert (project / "README.md").read_text() == "my project"
    assert sorted(p.name for p in project.iterdir()) == ["README.md"]
    out = export(tiny_model_dir, tmp_path / "out")
    (out / "notes.txt").write_text("kept")
    export(tiny_model_dir, out, overwrite=True)  # an earlier export is replaced, files of the user's own are kept
    assert (out / "notes.txt").read_text() == "kept"

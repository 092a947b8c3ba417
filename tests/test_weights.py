"""Weights in and out, all offline: local files, the HF cache, torchvision, timm folders, errors."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch
from conftest import CLASSES, NOT_UTF8, TINY, invoke_cli, make_images, tiny_classifier
from safetensors.torch import save_file

from vit_finetune import VitftError, create_model, resize_pos_embed, save_pretrained
from vit_finetune.weights.download import HUB_CONNECT_TIMEOUT, HUB_LOOKUP_TIMEOUT

TINY_ARCH = "vit_tiny_patch16_224"
DISTILLED_ARCH = "deit_tiny_distilled_patch16_224"  # DeiT: distillation token and a second head


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def image(*size: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    h, w = size if len(size) == 2 else (size[0], size[0])
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x) -> torch.Tensor:
    return model.eval()(x)


def save_safetensors(state: dict, path: Path) -> Path:
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return path


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every tensor random values (also the zero-initialised biases, tokens and heads)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.02 if p.ndim > 1 else 0.1) * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def timm_tiny():
    """timm's vit_tiny_patch16_224 (full depth, 1000 classes) with random weights."""
    torch.manual_seed(0)
    return randomize_(timm.create_model(TINY_ARCH)).eval()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> tuple[Path, dict]:
    """A 1000-class, depth-2, 224 px vit_tiny checkpoint (.safetensors) and its state dict."""
    torch.manual_seed(1)
    model = randomize_(create_model(TINY_ARCH, depth=2), seed=1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return save_safetensors(state, tmp_path_factory.mktemp("ckpt") / "tiny2.safetensors"), state


# ---- local files --------------------------------------------------------------------------------
def test_local_safetensors_from_timm_matches_timm(tmp_path, timm_tiny):
    path = save_safetensors(timm_tiny.state_dict(), tmp_path / "w.safetensors")
    model = create_model(TINY_ARCH, pretrained=path)
    x = image(224, batch=2)
    torch.testing.assert_close(logits(model, x), logits(timm_tiny, x), atol=1e-5, rtol=1e-5)
    assert model.pretrained_cfg["source"] == str(path)
    assert model.pretrained_cfg["mean"] == timm_tiny.pretrained_cfg["mean"]


def test_wrapped_pth_with_module_prefix_loads(tmp_path, tiny_ckpt):
    _, state = tiny_ckpt
    path = tmp_path / "ckpt.pth"
    torch.save({"state_dict": {"module." + k: v for k, v in state.items()}, "epoch": 3}, path)
    model = create_model(TINY_ARCH, pretrained=path, depth=2)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


# ---- real pretrained weights: DINOv2 ViT-S/14 from ../shared ---------------------------------------------
@pytest.mark.parametrize("size,batch,resized", [(518, 1, []), (112, 2, ["position embedding 37x37 -> 8x8"])])
def test_real_dinov2_folder_matches_timm(dinov2_dir, size, batch, resized):
    """The native model and timm's, each loading the same timm Hub folder, at its own 518 px and at 112 px (each
    resizing the 37x37 position grid its own way): tokens and pooled features equal to 1e-5 (0.0 measured)."""
    kwargs = {} if size == 518 else dict(img_size=size)
    theirs = timm.create_model(f"local-dir:{dinov2_dir}", pretrained=True, **kwargs).eval()
    ours = create_model(f"local-dir:{dinov2_dir}", pretrained=True, **kwargs).eval()
    assert ours.load_report.resized == resized and ours.pretrained_cfg["input_size"] == (3, size, size)
    x = image(size, batch=batch)
    with torch.no_grad():
        tokens, expected_tokens = ours.forward_features(x), theirs.forward_features(x)
        pooled, expected_pooled = ours(x), theirs(x)
    assert tokens.shape == (batch, 1 + (size // 14) ** 2, 384) and pooled.shape == (batch, 384)
    assert expected_pooled.std() > 0.5  # trained features, not an empty model's
    torch.testing.assert_close(tokens, expected_tokens, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, expected_pooled, atol=1e-5, rtol=1e-5)


def test_bare_pth_file_is_read_once(tmp_path, tiny_ckpt, monkeypatch):
    """Recognising its layout, sizing the head from it and loading it: one torch.load of the file."""
    from vit_finetune import load_model

    _, state = tiny_ckpt
    path = tmp_path / "ckpt.pth"
    torch.save(state, path)
    real_load, reads = torch.load, []
    monkeypatch.setattr(torch, "load", lambda f, *args, **kw: reads.append(Path(f)) or real_load(f, *args, **kw))
    model = load_model(str(path), arch=TINY_ARCH, depth=2)
    assert reads == [path] and model.num_classes == 1000 and model.load_report.layout == "timm"

# ---- the Hugging Face cache, through the real huggingface_hub client ------------------------------
def put_in_hf_cache(hf_home: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """Lay `files` out as huggingface_hub's cache does: blobs/, snapshots/<commit>/ symlinks, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


HUB_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from huggingface_hub import constants
    from vit_finetune import VitftError, create_model

    expected = torch.load(sys.argv[1])
    x = expected["x"]
    out = {"offline": constants.HF_HUB_OFFLINE, "cache": constants.HF_HUB_CACHE}
    try:
        with torch.no_grad():
            tag = create_model("vit_tiny_patch16_224", pretrained=True).eval()
            out["tag_source"] = tag.pretrained_cfg["source"]
            out["tag_diff"] = (tag(x) - expected["tag"]).abs().max().item()
            repo = create_model("hf-hub:someorg/somerepo", pretrained=True).eval()
            out["repo_diff"] = (repo(x[:, :, :32, :32]) - expected["repo"]).abs().max().item()
            out["repo_labels"] = repo.pretrained_cfg.get("label_names")
            out["repo_shape"] = [repo.embed_dim, len(repo.blocks), repo.num_classes, *repo.patch_embed.img_size]
    except VitftError as err:
        out["error"] = str(err)
    print(json.dumps(out))
""")


def run_hub_script(hf_home: Path, expected: Path) -> subprocess.Popen:
    # huggingface_hub reads HF_HOME / HF_HUB_OFFLINE into huggingface_hub.constants at import
    # time, so the real client is exercised in a fresh interpreter with the environment set
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", HUB_SCRIPT, str(expected)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def hub_result(proc: subprocess.Popen) -> dict:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def test_hf_cache_offline(tmp_path, monkeypatch):
    hf_home, empty_home = tmp_path / "hf_home", tmp_path / "empty_hf_home"
    empty_home.mkdir()
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    torch.manual_seed(2)
    tag_model = create_model(TINY_ARCH).eval()
    weights = save_safetensors(tag_model.state_dict(), tmp_path / "model.safetensors")
    put_in_hf_cache(hf_home, "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", {"model.safetensors": weights})

    repo_model = create_model(TINY_ARCH, num_classes=len(CLASSES), **TINY).eval()
    repo_model.pretrained_cfg["label_names"] = list(CLASSES)
    folder = save_pretrained(repo_model, tmp_path / "repo")
    other = {k: torch.randn_like(v) for k, v in repo_model.state_dict().items()}
    torch.save(other, tmp_path / "pytorch_model.bin")  # other weights: repo_diff below shows which file loaded
    put_in_hf_cache(hf_home, "someorg/somerepo",
                    {"config.json": folder / "config.json", "model.safetensors": folder / "model.safetensors",
                     "pytorch_model.bin": tmp_path / "pytorch_model.bin"})  # both: safetensors is preferred

    x = image(224)
    expected = tmp_path / "expected.pt"
    torch.save({"x": x, "tag": logits(tag_model, x), "repo": logits(repo_model, x[:, :, :32, :32])}, expected)

    procs = [run_hub_script(hf_home, expected), run_hub_script(empty_home, expected)]
    cached, empty = (hub_result(p) for p in procs)

    assert cached["offline"] is True and cached["cache"] == str(hf_home / "hub")
    assert "error" not in cached, cached["error"]
    assert cached["tag_source"] == "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    assert cached["tag_diff"] < 1e-5
    assert cached["repo_labels"] == CLASSES
    assert cached["repo_shape"] == [64, 2, len(CLASSES), 32, 32]
    assert cached["repo_diff"] < 1e-5

    assert "vit_tiny_patch16_224" in empty["error"]
    assert "not in the local HF cache" in empty["error"] and "HF_HUB_OFFLINE" in empty["error"]


def test_offline_error_names_local_weights_in_python_and_command_line_terms(tmp_path, monkeypatch):
    """The way out of a missing download, said so that a Python caller (`pretrained=PATH`, not `--pretrained
    PATH`) and a command-line user both read their own terms."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    ways_out = (r"download it once with network access, give a local weights file or model folder in its place "
                r"\(pretrained=PATH in Python, --pretrained PATH on the command line, or the PATH as the model to "
                r"evaluate, predict or explain\)$")
    with pytest.raises(VitftError, match=r"^timm/vit_tiny_patch16_224\.augreg_in21k_ft_in1k/model\.safetensors.* "
                                         r"is not in the local HF cache and HF_HUB_OFFLINE is set; " + ways_out):
        create_model("vit_t_16", pretrained=True)
    data = make_images(tmp_path / "data", {"a": 4, "b": 4}, size=32)
    result = invoke_cli("finetune", "--pretrained", "vit_t_16", "--data", data, "--output", tmp_path / "run")
    assert result.exit_code == 1
    assert re.search(ways_out, " ".join(result.output.split())), result.output


UNREACHABLE_SCRIPT = textwrap.dedent("""
    import logging, sys, time
    from vit_finetune import VitftError, create_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.monotonic()
    try:
        create_model("vit_tiny_patch16_224", pretrained=True)
    except VitftError as err:
        print(f"{time.monotonic() - start:.1f}")
        print(err)
""")


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("endpoint", ["http://vitft-no-such-host.invalid", "closed port"])
def test_unreachable_hub_fails_fast_and_names_the_ways_out(tmp_path, endpoint):
    """No host (or nothing listening): one line on what is fetched from where, then the error, within seconds
    and without huggingface_hub's retries (about 30 s of 'Retrying in 8s' lines before)."""
    if endpoint == "closed port":
        endpoint = f"http://127.0.0.1:{_closed_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=endpoint, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", UNREACHABLE_SCRIPT], env=env, text=True, capture_output=True,
                          timeout=300)
    seconds, message = proc.stdout.strip().split("\n", 1)
    # the check waits at most HUB_LOOKUP_TIMEOUT for the name lookup, then HUB_CONNECT_TIMEOUT for the connect;
    # 1 s more covers the rest (the cache look-up, a busy CPU). Each of huggingface_hub's retries alone was 1-8 s.
    assert float(seconds) < HUB_LOOKUP_TIMEOUT + HUB_CONNECT_TIMEOUT + 1.0, proc.stderr
    assert "Retrying" not in proc.stderr + proc.stdout
    fetching = [line for line in proc.stderr.splitlines() if line.startswith("fetching ")]
    assert len(fetching) == 1 and "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k" in fetching[0], proc.stderr
    assert endpoint in fetching[0]
    assert "not in the local HF cache" in message and endpoint in message
    assert "--pretrained PATH" in message and "HF_HUB_OFFLINE=1" in message


# ---- torchvision checkpoints ---------------------------------------------------------------------
def test_torchvision_vit_b_16_checkpoint(tmp_path):
    import torchvision

    torch.manual_seed(0)
    tv = torchvision.models.vit_b_16(weights=None).eval()
    with torch.no_grad():  # torchvision zero-initialises the head and class token: randomise them
        g = torch.Generator().manual_seed(0)
        for p in (tv.heads.head.weight, tv.heads.head.bias, tv.class_token):
            p.copy_(0.02 * torch.randn(p.shape, generator=g))
    path = tmp_path / "vit_b_16.pth"
    torch.save(tv.state_dict(), path)

    model = create_model("vit_base_patch16_224", pretrained=path).eval()
    x = image(224)
    expected = logits(tv, x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(logits(model, x), expected, atol=1e-4, rtol=1e-4)


# ---- fitting checkpoints to other shapes -----------------------------------------------------------
@pytest.fixture
def vitft_log(caplog):
    """Records of the 'vitft' logger (attached directly: the CLI may have turned propagation off)."""
    logger = logging.getLogger("vitft")
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


@pytest.mark.parametrize("arch", [TINY_ARCH, DISTILLED_ARCH])
def test_head_reinitialised_for_other_class_count(tmp_path, vitft_log, arch):
    """A 1000-class model folder with label names, loaded for 6 classes: a new head, and no old labels."""
    torch.manual_seed(3)
    source = randomize_(create_model(arch, **TINY), seed=3)
    assert source.num_classes == 1000
    source.pretrained_cfg["label_names"] = [f"class {i}" for i in range(1000)]
    path = save_pretrained(source, tmp_path / "source")
    assert create_model(arch, pretrained=path, **TINY).pretrained_cfg["label_names"][999] == "class 999"
    model = create_model(arch, pretrained=path, num_classes=6, **TINY)
    state, ckpt = model.state_dict(), source.state_dict()
    assert model.num_classes == 6 and state["head.weight"].shape == (6, 64) and state["head.bias"].shape == (6,)
    if arch == DISTILLED_ARCH:
        assert state["head_dist.weight"].shape == (6, 64) and state["head_dist.bias"].shape == (6,)
    assert set(state) == set(ckpt)
    for key in state:
        if not key.startswith(("head.", "head_dist.")):
            assert torch.equal(state[key], ckpt[key]), key
    assert model.load_report.new == ["head: new, 6 classes (the checkpoint's 1000-class head re-initialised)"]
    assert any("head: new, 6 classes" in r.getMessage() for r in vitft_log.records)  # create_model's debug line
    assert "label_names" not in model.pretrained_cfg


def test_resized_loading_resizes_pos_embed(tiny_ckpt):
    path, state = tiny_ckpt
    model = create_model(TINY_ARCH, pretrained=path, img_size=160, depth=2)
    assert model.pos_embed.shape == (1, 1 + 10 * 10, 192)
    expected = resize_pos_embed(state["pos_embed"], (10, 10), (14, 14), 1)
    assert torch.equal(model.pos_embed.detach(), expected)
    assert model.pretrained_cfg["input_size"] == (3, 160, 160)
    assert logits(model, image(160)).shape == (1, 1000)


def test_patch_size_override_resamples_patch_embed(tiny_ckpt):
    from timm.layers import resample_patch_embed

    path, state = tiny_ckpt
    model = create_model(TINY_ARCH, pretrained=path, patch_size=8, img_size=64, depth=2)
    weight = model.patch_embed.proj.weight.detach()
    assert weight.shape == (192, 3, 8, 8)
    torch.testing.assert_close(weight, resample_patch_embed(state["patch_embed.proj.weight"], [8, 8]))
    assert model.pos_embed.shape == (1, 1 + 8 * 8, 192)
    assert torch.equal(model.blocks[1].mlp.fc2.weight.detach(), state["blocks.1.mlp.fc2.weight"])
    assert logits(model, image(64)).shape == (1, 1000)


# ---- writing model folders that timm reads ---------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, dict(img_size=96, depth=2, num_classes=6, global_pool="avg")],
                         ids=["defaults", "overrides"])
def test_save_pretrained_loads_in_timm(tmp_path, overrides):
    torch.manual_seed(4)
    model = randomize_(create_model(TINY_ARCH, **overrides), seed=4).eval()
    folder = save_pretrained(model, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == TINY_ARCH
    if overrides:
        assert config["model_args"] == {"img_size": 96, "depth": 2, "global_pool": "avg"}
        assert config["num_classes"] == 6
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    size = overrides.get("img_size", 224)
    x = image(size, batch=2)
    torch.testing.assert_close(logits(theirs, x), logits(model, x), atol=1e-5, rtol=1e-5)
    again = create_model(f"local-dir:{folder}", pretrained=True)
    torch.testing.assert_close(logits(again, x), logits(model, x), atol=0, rtol=0)


def test_distilled_deit_exports_to_timm(tmp_path):
    """A distilled DeiT folder is timm's VisionTransformerDistilled again, with timm's DeiT preprocessing."""
    torch.manual_seed(5)
    model = randomize_(create_model(DISTILLED_ARCH, num_classes=6, img_size=64, depth=2), seed=5).eval()
    timm_cfg = timm.models.get_pretrained_cfg(DISTILLED_ARCH).to_dict()
    for key in ("mean", "std", "crop_pct", "interpolation"):
        assert model.pretrained_cfg[key] == timm_cfg[key], key
    folder = save_pretrained(model, tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"] == DISTILLED_ARCH and config["num_classes"] == 6
    assert config["pretrained_cfg"]["classifier"] == ["head", "head_dist"]
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    assert type(theirs).__name__ == "VisionTransformerDistilled"
    assert theirs.head_dist.weight.shape == (6, 192) and len(theirs.blocks) == 2
    x = image(64, batch=2)
    torch.testing.assert_close(logits(theirs, x), logits(model, x), atol=1e-5, rtol=1e-5)
    again = create_model(f"local-dir:{folder}", pretrained=True)
    torch.testing.assert_close(logits(again, x), logits(model, x), atol=0, rtol=0)


# ---- errors -----------------------------------------------------------------------------------------
def test_weights_of_another_arch_name_misshaped_keys(tmp_path):
    small = create_model("vit_small_patch16_224", depth=2)
    path = save_safetensors(small.state_dict(), tmp_path / "small.safetensors")
    fits = rf"weights {re.escape(str(path))} do not fit {TINY_ARCH}: \d+ mis-shaped"
    with pytest.raises(VitftError, match=fits) as err:
        create_model(TINY_ARCH, pretrained=path, depth=2)
    message = str(err.value)
    assert re.search(r"\d+ mis-shaped \(e\.g\. blocks\.0\.[\w.]+ \(384,?\) vs model \(192,?\)", message), message
    assert "another architecture" in message


def test_corrupted_files(tmp_path, tiny_ckpt):
    _, state = tiny_ckpt
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(os.urandom(4096))
    corrupted = r"cannot read weights from {}: corrupted or not a checkpoint \({}\)"
    with pytest.raises(VitftError, match=corrupted.format(re.escape(str(junk)), r"\w+")):
        create_model(TINY_ARCH, pretrained=junk, depth=2)

    full = tmp_path / "full.pth"
    torch.save(state, full)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    with pytest.raises(VitftError, match=corrupted.format(re.escape(str(truncated)), r"\w+")):
        create_model(TINY_ARCH, pretrained=truncated, depth=2)


class RunsCode:
    """What a booby-trapped checkpoint holds: an object whose unpickling calls os.mkdir(marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def booby_trapped(state: dict, path: Path, marker: Path) -> Path:
    """A torch checkpoint of `state` plus one pickled object that would create `marker` if unpickled."""
    torch.save(dict(state, **{"blocks.0.extra": RunsCode(marker)}), path)
    return path


REFUSED = r"refusing {}: it holds pickled Python objects \(posix\.mkdir\) that could run code"


@pytest.mark.parametrize("where", ["file", "folder"])
def test_weights_holding_a_pickled_object_are_refused_and_run_nothing(tmp_path, tiny_ckpt, where):
    """A .pth given as --pretrained, or a model folder's pytorch_model.bin: one line naming the file."""
    _, state = tiny_ckpt
    marker = tmp_path / "code-ran"
    if where == "file":
        path = booby_trapped(state, tmp_path / "weights.pth", marker)
        name, pretrained = TINY_ARCH, path
    else:
        folder = save_pretrained(create_model(TINY_ARCH, depth=2), tmp_path / "model")
        (folder / "model.safetensors").unlink()
        path = booby_trapped(state, folder / "pytorch_model.bin", marker)
        name, pretrained = f"local-dir:{folder}", True
    with pytest.raises(VitftError, match=REFUSED.format(re.escape(str(path)))) as err:
        create_model(name, pretrained=pretrained, depth=2)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_cli_refuses_pretrained_weights_holding_a_pickled_object(tmp_path, tiny_ckpt):
    _, state = tiny_ckpt
    marker = tmp_path / "code-ran"
    path = booby_trapped(state, tmp_path / "weights.pth", marker)
    data = make_images(tmp_path / "data", {"red": 4, "blue": 4}, size=32)
    result = invoke_cli("finetune", "--data", data, "--val-split", 0.5, "--model", TINY_ARCH, "--pretrained", path,
                        "--model-kwargs", "depth=2", "--epochs", 1, "--output", tmp_path / "run")
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(REFUSED.format(re.escape(str(path))), errors[0]), result.output
    assert "Traceback" not in result.output
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_unknown_model_suggests_close_name():
    with pytest.raises(VitftError, match=r"unknown model 'vit_bse_patch16_224'.*did you mean vit_base_patch16_224"):
        create_model("vit_bse_patch16_224")


def test_unknown_pretrained_tag_lists_tags():
    with pytest.raises(VitftError, match=r"unknown pretrained tag 'nope'.*augreg_in21k_ft_in1k"):
        create_model("vit_tiny_patch16_224.nope", pretrained=True)


def test_unknown_override_key():
    with pytest.raises(VitftError, match=r"unknown model argument\(s\) embed_dimm.*embed_dim"):
        create_model(TINY_ARCH, embed_dimm=64)


def test_missing_weights_file(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(VitftError, match=r"weights file .*nope\.safetensors not found"):
        create_model(TINY_ARCH, pretrained=missing)


# ---- CLI ----------------------------------------------------------------------------------------------
def test_cli_models_lists_matching_names():
    from typer.testing import CliRunner

    from vit_finetune.cli import app

    result = CliRunner().invoke(app, ["models", "vit_b*"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "vit_b_16" in result.output and "vit_base_patch16_224" in result.output
    assert "vit_small_patch16_224" not in result.output


def test_cli_models_lists_the_deit_family():
    from typer.testing import CliRunner

    from vit_finetune.cli import app

    result = CliRunner().invoke(app, ["models", "deit*"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in timm.list_models(module="deit"):
        assert f" {name} " in result.output, name
    assert "vit_base_patch16_224" not in result.output


def test_saved_weights_get_the_umasks_mode_not_a_private_one(tmp_path):
    mask = os.umask(0)
    os.umask(mask)
    folder = save_pretrained(tiny_classifier(), tmp_path / "model")
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o666 & ~mask, name


def test_weights_load_from_a_folder_whose_name_is_not_utf8(tmp_path):
    from vit_finetune import load_model

    model = tiny_classifier()
    loaded = load_model(str(save_pretrained(model, tmp_path / NOT_UTF8)))
    for key, value in model.state_dict().items():
        assert loaded.state_dict()[key].equal(value), key

"""LoRA adapters through peft (--lora): the adapter vitft trains is the one timm + peft load, the run folder's merged
model agrees with it, checkpoints hold the adapter only, and a kill -9, DDP and the Hub keep all of that true."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, make_images

pytest.importorskip("peft")

from vit_finetune import create_model, load_model, save_pretrained  # noqa: E402
from vit_finetune.engine.api import finetune  # noqa: E402
from vit_finetune.errors import VitftError  # noqa: E402
from vit_finetune.hub.export import export  # noqa: E402
from vit_finetune.run_folder import CHECKPOINT  # noqa: E402
from vit_finetune.weights.adapters import apply_lora, merged_copy, save_adapter, trainable_counts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LORA = dict(lora=4, epochs=2, batch_size=4, lr=0.05, warmup_epochs=0, workers=0, quiet=True, device="cpu",
            precision="fp32", max_steps_per_epoch=3, threads=1)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """Random 'pretrained' weights of a tiny ViT, saved as a timm-loadable folder."""
    torch.manual_seed(0)
    return save_pretrained(create_model("vit_tiny_patch16_224", num_classes=5, **TINY),
                           tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("lora_data"), {"a": 12, "b": 12, "c": 12}, size=40)


@pytest.fixture(scope="module")
def run(base_dir, images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    finetune(data=str(images), pretrained=str(base_dir), output=str(out), **LORA)
    return out


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x)


def test_timm_and_peft_load_the_adapter_as_the_card_says_with_the_run_folders_logits(run, base_dir, x, tmp_path):
    import timm
    from peft import PeftModel

    out = export(run, tmp_path / "adapter", adapter=True, repo_id="user/tiny-lora")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "local" and str(base_dir) not in (out / "README.md").read_text()
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "PeftModel.from_pretrained(model, \"user/tiny-lora\")" in card
    assert "num_classes=3" in card
    assert "vit_finetune.create_model" not in card  # vitft cannot fetch a local base by name: no snippet for it
    merged = logits(load_model(str(run)), x)
    # the card's snippet, with the local base folder standing for the Hub id
    model = timm.create_model(f"local-dir:{base_dir}", pretrained=True, num_classes=3)
    model = PeftModel.from_pretrained(model, str(out))
    assert type(model.base_model.model).__module__ == "timm.models.vision_transformer"
    torch.testing.assert_close(logits(model, x), merged, atol=1e-5, rtol=0)
    assert not torch.allclose(logits(timm.create_model(f"local-dir:{base_dir}", pretrained=True, num_classes=3), x),
                              merged, atol=1e-3)  # the adapter and head changed the logits
    export(run, tmp_path / "merged")  # the default export: the merged model, in timm's format
    timm_merged = timm.create_model(f"local-dir:{tmp_path / 'merged'}", pretrained=True)
    torch.testing.assert_close(logits(timm_merged, x), merged, atol=1e-5, rtol=0)


def test_checkpoint_holds_the_adapter_and_the_trained_lora_weights_moved(run):
    state = torch.load(run / CHECKPOINT, weights_only=True)
    assert state["model"] and all("lora_" in k or ".modules_to_save." in k for k in state["model"])
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state["model"].items())  # B starts at zero
    assert sorted(os.listdir(run / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_adapter_is_under_5_percent_of_vit_s_at_rank_8(tmp_path):
    model = apply_lora(create_model("vit_small_patch16_224", num_classes=10), 8)
    save_adapter(model, tmp_path / "adapter")
    save_pretrained(merged_copy(model), tmp_path / "full")
    adapter = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    full = (tmp_path / "full" / "model.safetensors").stat().st_size
    assert adapter < 0.05 * full, (adapter, full)


def test_layer_decay_scales_the_adapter_by_its_block():
    from timm.optim import create_optimizer_v2

    model = apply_lora(create_model("vit_tiny_patch16_224", num_classes=3, **TINY), 4)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1.0, weight_decay=0.05, layer_decay=0.5)
    names = {id(p): n for n, p in model.named_parameters()}
    scales = {names[id(p)]: group["lr_scale"] for group in optimizer.param_groups for p in group["params"]}
    assert all("lora_" in n or ".modules_to_save." in n for n in scales)  # the frozen weights are not optimised
    depth = TINY["depth"]  # timm's layer ids: 0 the stem, 1..depth the blocks, depth + 1 the head
    for name, scale in scales.items():
        layer = int(name.split(".")[1]) + 1 if name.startswith("blocks.") else (0 if "patch_embed" in name
                                                                                 else depth + 1)
        assert scale == pytest.approx(0.5 ** (depth + 1 - layer)), name
    assert {scales[n] for n in scales if n.startswith("blocks.0.")} == {0.25}


def test_head_phase_then_lora(images, base_dir, tmp_path, caplog):
    out = tmp_path / "phases"
    result = finetune(data=str(images), pretrained=str(base_dir), output=str(out), freeze_backbone=True,
                      unfreeze_after=1, **dict(LORA, epochs=2))
    assert result.epochs_done == 2
    state = torch.load(out / CHECKPOINT, weights_only=True)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state["model"].items())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vitft"):
        finetune(resume=out, epochs=3)  # resumed past the head phase: the adapter's count, not the head's
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("trainable parameters"))
    adapter, _ = trainable_counts(apply_lora(create_model("vit_tiny_patch16_224", num_classes=3, **TINY), 4))
    assert line.startswith(f"trainable parameters: {adapter:,} of ") and "in the head phase" not in line, line


def test_missing_peft_and_bad_targets_are_one_line_errors(images, base_dir, tmp_path, monkeypatch):
    options = dict(LORA, data=str(images), pretrained=str(base_dir), output=str(tmp_path / "r"))
    with pytest.raises(VitftError, match=r"--lora-targets 'qkvv' matches no module"):
        finetune(**dict(options, lora_targets="qkv,qkvv"))
    with pytest.raises(VitftError, match=r"--ema with --lora"):
        finetune(**dict(options, ema=True))
    with pytest.raises(VitftError, match=r"--lora-alpha scales the adapter: it must be positive .*got 0"):
        finetune(**dict(options, lora_alpha=0))
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(VitftError, match=r"need the peft package: pip install 'vit-finetune\[peft\]'"):
        finetune(**options)


@pytest.mark.parametrize("target, message", [
    ("blocks", r"'blocks' matches blocks \(Sequential\), not a layer LoRA adapts \(Linear or Conv\)"),
    ("norm1", r"'norm1' matches blocks.0.norm1 \(LayerNorm\), not a layer LoRA adapts"),
    ("head", r"'head' names the head, which trains in full anyway"),
])
def test_targets_that_are_not_layers_are_one_line_errors(target, message):
    model = create_model("vit_tiny_patch16_224", num_classes=3, **TINY)
    with pytest.raises(VitftError, match=message) as err:
        apply_lora(model, 2, targets=("qkv", target))
    assert "\n" not in str(err.value)


def test_export_refuses_the_runs_own_adapter_folder(run):
    with pytest.raises(VitftError, match=r"not into the run folder .* itself or its adapter/"):
        export(run, run / "adapter", overwrite=True)  # it would replace the adapter with the merged model
    assert sorted(os.listdir(run / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.mark.parametrize("option, value", [("lora_alpha", 16.0), ("lora_dropout", 0.3)])
def test_resume_refuses_another_alpha_or_dropout(run, option, value):
    # the resumed adapter is rebuilt with the checkpoint's options: a new value would be claimed, not used
    with pytest.raises(VitftError, match=rf"a resumed run keeps its own --{option.replace('_', '-')} "):
        finetune(resume=run, epochs=3, **{option: value})


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), NO_ALBUMENTATIONS_UPDATE="1", OMP_NUM_THREADS="1")


KILL_AT = """
import os, signal, sys
from vit_finetune.engine.trainer import Trainer
step, kill_at = Trainer.optimizer_step, int(sys.argv[1])
def step_then_die(self):
    lr = step(self)
    if self.state.global_step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return lr
Trainer.optimizer_step = step_then_die
from vit_finetune.cli import main
sys.argv = ["vitft", *sys.argv[2:]]
main()
"""


@pytest.mark.slow  # subprocesses
def test_resume_after_kill_9_gives_the_uninterrupted_adapter(images, base_dir, tmp_path):
    args = ["finetune", "--data", str(images), "--pretrained", str(base_dir), "--lora", "4", "--epochs", "2",
            "--batch-size", "4", "--lr", "0.05", "--warmup-epochs", "0", "--workers", "0", "--device", "cpu",
            "--precision", "fp32", "--max-steps-per-epoch", "3", "--save-every", "1", "--quiet"]
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-c", KILL_AT, "5", *args, "--output", str(killed)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert torch.load(killed / CHECKPOINT, weights_only=True)["global_step"] == 4
    finetune(resume=killed)
    straight = tmp_path / "straight"
    finetune(data=str(images), pretrained=str(base_dir), output=str(straight), **LORA)
    resumed, uninterrupted = (torch.load(d / CHECKPOINT, weights_only=True) for d in (killed, straight))
    assert resumed["global_step"] == uninterrupted["global_step"] == 6
    for key, value in uninterrupted["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow  # torchrun
def test_two_process_ddp_trains_the_adapter_into_one_run_folder(images, base_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "vit_finetune", "finetune", "--data", str(images), "--pretrained", str(base_dir), "--lora", "4",
           "--epochs", "1", "--batch-size", "4", "--lr", "0.05", "--warmup-epochs", "0", "--max-steps-per-epoch", "2",
           "--output", str(out), "--workers", "0", "--device", "cpu", "--precision", "fp32", "--quiet"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "x2 processes" in proc.stderr + proc.stdout and "trainable parameters" in proc.stderr + proc.stdout
    assert sorted(os.listdir(out / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not list(tmp_path.glob("ddp?*"))  # one run folder
    state = torch.load(out / CHECKPOINT, weights_only=True)
    assert state["global_step"] == 2 and any("lora_B" in k and v.abs().max() > 0 for k, v in state["model"].items())


HUB_ROUND_TRIP = """
import json, sys, torch
from huggingface_hub import HfApi
from vit_finetune import create_model, load_model
from vit_finetune.engine.api import finetune
from vit_finetune.hub.export import export
base, data, tmp = sys.argv[1:4]
api = HfApi(token="t")
api.create_repo("user/base"); api.upload_folder(repo_id="user/base", folder_path=base)
run = tmp + "/run"
finetune(data=data, pretrained="hf-hub:user/base", output=run, lora=4, epochs=1, batch_size=4, lr=0.05,
         warmup_epochs=0, workers=0, quiet=True, device="cpu", precision="fp32", max_steps_per_epoch=3)
adapter = export(run, tmp + "/adapter", adapter=True, repo_id="user/lora")
api.create_repo("user/lora"); api.upload_folder(repo_id="user/lora", folder_path=str(adapter))
x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    out = {name: model.eval()(x).tolist() for name, model in (
        ("run", load_model(run)), ("folder", create_model(str(adapter), pretrained=True)),
        ("hub", create_model("hf-hub:user/lora", pretrained=True)),
        ("unmerged", create_model("hf-hub:user/lora", pretrained=True, merge=False)))}
out["base_name"] = json.load(open(str(adapter) + "/adapter_config.json"))["base_model_name_or_path"]
print(json.dumps(out))
"""


@pytest.mark.slow  # a subprocess against the test Hub
def test_create_model_on_an_adapter_folder_and_hub_repo_gives_the_merged_logits(base_dir, images, tmp_path):
    from hub_server import HubServer
    from test_hub import hub_env

    with HubServer(tokens={"t"}) as hub:
        proc = subprocess.run([sys.executable, "-c", HUB_ROUND_TRIP, str(base_dir), str(images), str(tmp_path)],
                              env=dict(hub_env(hub.url, tmp_path / "home", "t"), PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["base_name"] == "user/base"
    for name in ("folder", "hub", "unmerged"):
        torch.testing.assert_close(torch.tensor(out[name]), torch.tensor(out["run"]), atol=1e-5, rtol=0, msg=name)


PUSH_BOTH_WAYS = """
import json, sys
from huggingface_hub import HfApi
from vit_finetune.hub.push import push
run, api, files = sys.argv[1], HfApi(token="t"), {}
for step, adapter in (("merged", False), ("adapter", True), ("merged again", False)):
    push(run, "user/model", token="t", adapter=adapter, overwrite_card=True)
    files[step] = sorted(f for f in api.list_repo_files("user/model") if f.endswith((".json", ".safetensors")))
print(json.dumps(files))
"""


@pytest.mark.slow  # a subprocess against the test Hub
def test_push_adapter_over_a_merged_model_leaves_one_model_in_the_repo(run, tmp_path):
    from hub_server import HubServer
    from test_hub import hub_env

    with HubServer(tokens={"t"}) as hub:
        proc = subprocess.run([sys.executable, "-c", PUSH_BOTH_WAYS, str(run)],
                              env=dict(hub_env(hub.url, tmp_path / "home", "t"), PYTHONPATH=str(REPO)),
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    merged, adapter = ["config.json", "model.safetensors"], ["adapter_config.json", "adapter_model.safetensors"]
    assert files == {"merged": merged, "adapter": adapter, "merged again": merged}  # a stale config.json would win

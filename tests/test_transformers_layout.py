"""Checkpoints written by Hugging Face transformers (ViT, DeiT, DINOv2) load into the native ViT with the
same outputs, through every path vitft takes weights from, and export to a folder timm loads."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import timm
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[test]')")

from test_weights import put_in_hf_cache  # noqa: E402

from vit_finetune import VitftError, create_model, save_pretrained  # noqa: E402
from vit_finetune.weights.loading import describe_weights  # noqa: E402

LABELS = ["cat", "dog", "fox", "owl"]
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
             layer_norm_eps=1e-5)
TOL = dict(atol=1e-4, rtol=1e-4)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random values everywhere (transformers zero-initialises tokens and biases, which would hide mix-ups)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = p.ndim == 1 and name.endswith("weight")
            scale = 0.1 if norm_weight or p.ndim > 1 else 0.3
            p.copy_(float(norm_weight) + scale * torch.randn(p.shape, generator=g))
    return model.eval()


def hf_model(kind: str, **config):
    """A small random transformers model of class `kind` (e.g. 'ViTForImageClassification')."""
    config_class = {"ViT": transformers.ViTConfig, "DeiT": transformers.DeiTConfig,
                    "Dinov2": transformers.Dinov2Config}[kind.split("For")[0].removesuffix("Model")]
    labels = dict(id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)}) \
        if "ForImage" in kind else {}
    model = getattr(transformers, kind)(config_class(**{**SMALL, **labels, **config}))
    return randomize_(model, seed=len(kind))


def image(size: int, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def save(model, folder: Path, processor=None) -> Path:
    model.save_pretrained(folder)  # safetensors
    if processor is not None:
        processor.save_pretrained(folder)
    return folder


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# ---- parity ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, config", [
    ("ViTForImageClassification", dict(intermediate_size=96)),
    ("DeiTForImageClassification", dict(intermediate_size=128, hidden_act="gelu_new", qkv_bias=False)),
], ids=["vit", "deit"])
def test_classifier_matches_transformers(tmp_path, kind, config):
    ref = hf_model(kind, **config)
    folder = save(ref, tmp_path / "hf")
    x = image(32)
    with torch.no_grad():
        expected = ref(pixel_values=x).logits
        for name in (f"local-dir:{folder}", str(folder)):
            model = create_model(name, pretrained=True).eval()
            print(f"{kind} via {name.split(':')[0]}: max abs diff {max_diff(model(x), expected):.2e}")
            torch.testing.assert_close(model(x), expected, **TOL)
    assert model.pretrained_cfg["label_names"] == LABELS and model.num_classes == len(LABELS)
    assert model.load_report.layout == f"transformers {kind.split('For')[0].lower()}"
    assert model.embed_dim == 64 and len(model.blocks) == 2 and model.blocks[0].norm1.eps == 1e-5
    if kind.startswith("DeiT"):  # the distillation token takes part in attention as a register token
        assert model.num_reg_tokens == 1 and model.pos_embed.shape == (1, 2 + 16, 64)


def dinov2(tmp_path, **config):
    ref = hf_model("Dinov2Model", mlp_ratio=3, layerscale_value=0.5, **config)
    processor = transformers.BitImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 24, "width": 24},
                                               do_center_crop=True, resample=3, image_mean=[0.4, 0.5, 0.6],
                                               image_std=[0.2, 0.25, 0.3])
    return ref, save(ref, tmp_path / "dinov2", processor)


@pytest.mark.parametrize("swiglu", [False, True], ids=["mlp", "swiglu"])
def test_dinov2_backbone_matches_transformers(tmp_path, swiglu):
    ref, folder = dinov2(tmp_path, use_swiglu_ffn=swiglu)
    model = create_model(f"local-dir:{folder}", pretrained=True).eval()
    # the preprocessor's crop (24 px) is the model's input size; the weights' 4x4 grid is resized to 3x3
    # as transformers interpolates it at run time
    assert tuple(model.patch_embed.img_size) == (24, 24) and model.pretrained_cfg["crop_pct"] == 0.8
    assert model.pretrained_cfg["mean"] == (0.4, 0.5, 0.6) and model.pretrained_cfg["interpolation"] == "bicubic"
    assert model.pretrained_cfg["architecture"] == ("vit_giant_patch14_dinov2" if swiglu else "vit_base_patch14_dinov2")
    assert model.num_classes == 0
    with torch.no_grad():
        for size in (24, 32):
            if size == 32:
                model = create_model(f"local-dir:{folder}", pretrained=True, img_size=32).eval()
            x = image(size)
            out = ref(pixel_values=x)
            print(f"dinov2 {'swiglu ' if swiglu else ''}{size}px: last_hidden_state max abs diff "
                  f"{max_diff(model.forward_features(x), out.last_hidden_state):.2e}, "
                  f"pooled {max_diff(model(x), out.pooler_output):.2e}")
            torch.testing.assert_close(model.forward_features(x), out.last_hidden_state, **TOL)
            torch.testing.assert_close(model(x), out.pooler_output, **TOL)


def test_dinov2_classifier_loads_as_backbone_and_says_so(tmp_path):
    ref = hf_model("Dinov2ForImageClassification")
    folder = save(ref, tmp_path / "cls")
    model = create_model(f"local-dir:{folder}", pretrained=True, num_classes=6).eval()
    x = image(32)
    with torch.no_grad():
        hidden = ref.dinov2(pixel_values=x).last_hidden_state
        torch.testing.assert_close(model.forward_features(x), hidden, **TOL)
    lines = describe_weights(model)
    assert "head: new, 6 classes" in lines[1]
    assert "classifier.weight" in lines[1] and "mean patch token" in lines[1]


def test_vit_backbone_pooler_is_left_out(tmp_path):
    ref = hf_model("ViTModel", intermediate_size=96)
    folder = save(ref, tmp_path / "vit")
    model = create_model(str(folder), pretrained=True).eval()
    x = image(32)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), ref(pixel_values=x).last_hidden_state, **TOL)
    assert model.num_classes == 0 and "label_names" not in model.pretrained_cfg
    assert any("pooler.dense.weight" in d for d in model.load_report.dropped)


# ---- bare files, named architectures ------------------------------------------------------------------
def test_bare_file_with_named_architecture(tmp_path):
    ref = hf_model("DeiTForImageClassification", intermediate_size=128)
    folder = save(ref, tmp_path / "deit")
    # no config: the architecture comes from the name; the file adds its distillation token
    model = create_model("vit_tiny_patch16_224", pretrained=folder / "model.safetensors", embed_dim=64, depth=2,
                         num_heads=2, mlp_ratio=2.0, patch_size=8, img_size=32, norm_eps=1e-5,
                         num_classes=len(LABELS)).eval()
    x = image(32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(pixel_values=x).logits, **TOL)
    assert model.load_report.layout == "transformers deit" and model.num_reg_tokens == 1


def test_folder_as_pretrained_of_its_architecture(tmp_path):
    ref, folder = dinov2(tmp_path)
    model = create_model("vit_base_patch14_dinov2", pretrained=folder).eval()
    x = image(24)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), ref(pixel_values=x).last_hidden_state, **TOL)
    with pytest.raises(VitftError, match=r"dinov2 holds a vit_base_patch14_dinov2 model, not vit_small_patch16_224; "
                                         r"drop --model or pick vit_base_patch14_dinov2"):
        create_model("vit_small_patch16_224", pretrained=folder)


# ---- errors -----------------------------------------------------------------------------------------
def test_unsupported_model_type_is_one_clear_error(tmp_path):
    folder = tmp_path / "swin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "swin", "architectures": ["SwinModel"]}))
    with pytest.raises(VitftError, match=r"model_type 'swin' \(SwinModel\) cannot be converted"):
        create_model(f"local-dir:{folder}", pretrained=True)


def test_deit_with_teacher_becomes_timms_distilled_deit(tmp_path):
    """Both heads kept: the class token's as head, the distillation token's as head_dist; eval output is their
    mean in both libraries. Through a folder, and as a bare file into the distilled architecture."""
    ref = hf_model("DeiTForImageClassificationWithTeacher", intermediate_size=128)
    folder = save(ref, tmp_path / "teacher")
    x = image(32)
    with torch.no_grad():
        expected = ref(pixel_values=x).logits
        model = create_model(f"local-dir:{folder}", pretrained=True).eval()
        assert model.head_dist is not None and model.pretrained_cfg["label_names"] == LABELS
        torch.testing.assert_close(model(x), expected, **TOL)
        bare = create_model("deit_tiny_distilled_patch16_224", pretrained=folder / "model.safetensors",
                            num_classes=len(LABELS), embed_dim=64, depth=2, num_heads=2, patch_size=8,
                            img_size=32, mlp_ratio=2.0, norm_eps=1e-5).eval()
        torch.testing.assert_close(bare(x), expected, **TOL)
    exported = save_pretrained(model, tmp_path / "export")
    timm_model = timm.create_model(f"local-dir:{exported}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(timm_model(x), expected, atol=1e-4, rtol=1e-4)


# ---- what was loaded ---------------------------------------------------------------------------------------
def test_describe_weights_says_layout_resizing_head_and_preprocessing(tmp_path):
    _, folder = dinov2(tmp_path)
    model = create_model(f"local-dir:{folder}", pretrained=True, num_classes=6)
    weights, changes, preprocessing = describe_weights(model)
    assert weights.startswith(f"weights: local-dir:{folder} [transformers dinov2 layout] as vit_base_patch14_dinov2")
    assert changes == ("  position embedding 4x4 -> 3x3; head: new, 6 classes; "
                       "not loaded: embeddings.mask_token (masked-image-modeling token)")
    assert preprocessing == "preprocessing: 24x24 (patch 8), mean (0.4, 0.5, 0.6) std (0.2, 0.25, 0.3), bicubic, " \
                            "crop_pct 0.8"
    assert describe_weights(create_model("vit_tiny_patch16_224"))[0].startswith("weights: random init")


# ---- export: a folder timm loads -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["DeiTForImageClassification", "Dinov2Model"])
def test_converted_model_saved_loads_in_timm(tmp_path, kind):
    config = dict(intermediate_size=128, layer_norm_eps=1e-12) if kind.startswith("DeiT") else dict(
        layer_norm_eps=1e-6)
    folder = save(hf_model(kind, **config), tmp_path / "hf")
    model = create_model(f"local-dir:{folder}", pretrained=True).eval()
    out = save_pretrained(model, tmp_path / "export")
    saved = json.loads((out / "config.json").read_text())
    theirs = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    again = create_model(f"local-dir:{out}", pretrained=True).eval()
    x = image(32)
    with torch.no_grad():
        print(f"{kind} export: timm vs vitft max abs diff {max_diff(theirs(x), model(x)):.2e}")
        torch.testing.assert_close(theirs(x), model(x), **TOL)
        torch.testing.assert_close(again(x), model(x), atol=0, rtol=0)
    if kind.startswith("DeiT"):  # timm's ViT has no LayerNorm eps argument: vitft keeps it to itself
        assert saved["vitft_model_args"] == {"norm_eps": 1e-12} and "norm_eps" not in saved.get("model_args", {})
        assert saved["label_names"] == LABELS and again.blocks[0].norm1.eps == 1e-12


# ---- the Hub, through the real huggingface_hub client and an offline HF cache -------------------------------
HUB_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from vit_finetune import create_model

    expected = torch.load(sys.argv[1])
    out = {}
    with torch.no_grad():
        for repo, key in (("someorg/dinov2-mini", "dinov2"), ("someorg/vit-mini", "vit")):
            model = create_model("hf-hub:" + repo, pretrained=True).eval()
            x = expected[key + "_x"]
            y = model.forward_features(x) if key == "dinov2" else model(x)
            out[key] = {"diff": (y - expected[key]).abs().max().item(), "cfg": model.pretrained_cfg,
                        "layout": model.load_report.layout}
    print(json.dumps(out, default=list))
""")


def test_hf_hub_repo_in_offline_cache(tmp_path):
    hf_home = tmp_path / "hf_home"
    ref, dino_folder = dinov2(tmp_path)
    vit = hf_model("ViTForImageClassification", intermediate_size=96)
    vit_folder = save(vit, tmp_path / "vit")  # no preprocessor_config.json: the defaults apply
    for repo, folder in (("someorg/dinov2-mini", dino_folder), ("someorg/vit-mini", vit_folder)):
        put_in_hf_cache(hf_home, repo, {p.name: p for p in folder.iterdir() if p.suffix in (".json", ".safetensors")})
    x24, x32 = image(24), image(32)
    with torch.no_grad():
        expected = {"dinov2_x": x24, "dinov2": ref(pixel_values=x24).last_hidden_state,
                    "vit_x": x32, "vit": vit(pixel_values=x32).logits}
    torch.save(expected, tmp_path / "expected.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", HUB_SCRIPT, str(tmp_path / "expected.pt")], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dinov2"]["diff"] < 1e-4 and out["vit"]["diff"] < 1e-4
    assert out["dinov2"]["layout"] == "transformers dinov2" and out["dinov2"]["cfg"]["crop_pct"] == 0.8
    assert out["dinov2"]["cfg"]["source"] == "hf-hub:someorg/dinov2-mini"
    assert out["vit"]["cfg"]["label_names"] == LABELS and out["vit"]["cfg"]["input_size"] == [3, 32, 32]


def test_finetune_first_lines_say_what_was_loaded(tmp_path):
    import numpy as np
    from PIL import Image

    from vit_finetune.config import TrainConfig
    from vit_finetune.engine.trainer import Trainer

    _, folder = dinov2(tmp_path)
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(5):
            pixels = rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "data" / name / f"{i}.png")
    cfg = TrainConfig(data=str(tmp_path / "data"), pretrained=str(folder), workers=0, val_split=0.4, batch_size=2)
    lines = Trainer(cfg, tmp_path / "run").describe()
    assert lines[:3] == describe_weights(create_model(str(folder), pretrained=True, num_classes=2))
    assert "head: new, 2 classes" in lines[1] and "position embedding 4x4 -> 3x3" in lines[1]
    assert lines[2].startswith("preprocessing: 24x24")


@pytest.mark.parametrize("kind, processor", [
    ("ViTForImageClassification", "ViTImageProcessor"),
    ("DeiTForImageClassification", "DeiTImageProcessor"),
    ("Dinov2Model", "BitImageProcessor"),
], ids=["vit", "deit", "dinov2"])
def test_no_preprocessor_config_means_the_processor_classs_defaults(tmp_path, kind, processor):
    """Saved without preprocessor_config.json, a checkpoint is preprocessed as transformers' own processor
    class would do it by default: its mean, std and resample, not ImageNet's (a review found ImageNet's)."""
    folder = save(hf_model(kind), tmp_path / "hf", processor=None)
    cfg = create_model(f"local-dir:{folder}", pretrained=True).pretrained_cfg
    defaults = getattr(transformers, processor)()
    resample = {2: "bilinear", 3: "bicubic"}[int(defaults.resample)]
    assert tuple(cfg["mean"]) == pytest.approx(tuple(defaults.image_mean))
    assert tuple(cfg["std"]) == pytest.approx(tuple(defaults.image_std))
    assert cfg["interpolation"] == resample

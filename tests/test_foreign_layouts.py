"""Checkpoints in other projects' layouts, adapted by timm's own checkpoint filter: the native model must
predict what timm's model predicts from the same file (1e-5)."""
from __future__ import annotations

import pytest
import timm
import torch

from vit_finetune import create_model
from vit_finetune.weights.layouts import TIMM_FILTER_LAYOUT

SMALL = dict(depth=2, embed_dim=64, num_heads=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _timm_model(arch: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, **SMALL, **kwargs)
    with torch.no_grad():  # timm zero-initialises some tensors (head, LayerScale): make every one count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _openai_clip(state: dict) -> dict:
    """timm's names -> OpenAI CLIP's visual tower (the inverse of timm's _convert_openai_clip), plus text keys."""
    out = {"token_embedding.weight": torch.randn(10, 8), "transformer.resblocks.0.ln_1.weight": torch.ones(8)}
    swaps = [("patch_embed.proj", "conv1"), ("norm_pre", "ln_pre"), ("blocks.", "transformer.resblocks."),
             ("norm1", "ln_1"), ("norm2", "ln_2"), ("attn.qkv.", "attn.in_proj_"), ("attn.proj", "attn.out_proj"),
             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")]
    for key, value in state.items():
        if key == "cls_token":
            out["visual.class_embedding"] = value[0, 0]
        elif key == "pos_embed":
            out["visual.positional_embedding"] = value[0]
        elif key == "head.weight":
            out["visual.proj"] = value.t().contiguous()
        elif key == "head.bias":
            continue  # CLIP's projection has no bias (timm's filter adds zeros)
        elif key.startswith("norm."):
            out["visual.ln_post." + key[len("norm."):]] = value
        else:
            for ours, theirs in swaps:
                key = key.replace(ours, theirs)
            out["visual." + key] = value
    return out


def _original_dinov2(state: dict) -> dict:
    """timm's names -> the DINOv2 repository's (mask_token; register tokens outside the position embedding)."""
    out = dict(state, mask_token=torch.zeros(1, state["cls_token"].shape[-1]))
    pos0 = torch.randn_like(state["cls_token"])  # the class token's own position embedding, folded in by timm
    out["register_tokens"] = out.pop("reg_token")
    out["cls_token"] = state["cls_token"] - pos0
    out["pos_embed"] = torch.cat([pos0, state["pos_embed"]], dim=1)
    return out


def _open_clip(state: dict) -> dict:
    return {f"visual.trunk.{k}": v for k, v in state.items()} | {"text.token_embedding.weight": torch.randn(10, 8)}


def _deit3(state: dict) -> dict:
    return {k.replace(".ls1.gamma", ".gamma_1").replace(".ls2.gamma", ".gamma_2"): v for k, v in state.items()}


CASES = {
    "openai_clip": ("vit_base_patch16_clip_quickgelu_224", dict(num_classes=32), _openai_clip),
    "open_clip": ("vit_base_patch16_clip_quickgelu_224", dict(num_classes=0), _open_clip),
    "original_dinov2": ("vit_small_patch14_reg4_dinov2", dict(num_classes=0, img_size=70), _original_dinov2),
    "deit3": ("deit3_small_patch16_224", dict(num_classes=10), _deit3),
}


@pytest.mark.parametrize("layout", CASES)
def test_foreign_layout_matches_timm(tmp_path, layout):
    arch, kwargs, to_layout = CASES[layout]
    reference = _timm_model(arch, **kwargs)
    if layout == "openai_clip":
        with torch.no_grad():
            reference.head.bias.zero_()  # CLIP's projection has no bias
    path = tmp_path / "foreign.pth"
    torch.save(to_layout(reference.state_dict()), path)
    assert "patch_embed.proj.weight" not in torch.load(path) or layout in ("original_dinov2", "deit3")

    theirs = timm.create_model(arch, pretrained=True, **SMALL, **kwargs,
                               pretrained_cfg_overlay=dict(file=str(path), num_classes=kwargs["num_classes"])).eval()
    ours = create_model(arch, pretrained=path, **SMALL, **kwargs).eval()
    assert ours.load_report.layout == TIMM_FILTER_LAYOUT
    size = kwargs.get("img_size", 224)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = reference(x), ours(x)
        assert (theirs(x) - expected).abs().max() < 1e-5  # the layout round trip is exact
        assert (got - expected).abs().max() < 1e-5


RESIZED = {  # layout -> (img_size it was trained at, img_size it is loaded at, the grids the report names)
    "openai_clip": (224, 112, "position embedding 14x14 -> 7x7"),
    "original_dinov2": (70, 42, "position embedding 5x5 -> 3x3"),
}


@pytest.mark.parametrize("layout", RESIZED)
def test_foreign_layout_at_another_size_reports_the_resized_grid(tmp_path, layout):
    """timm's filter converts these layouts; the position grid is resized once, in vitft's own step, and the
    load report says so (as for every other layout), with the logits of timm's model at that size (1e-5)."""
    arch, kwargs, to_layout = CASES[layout]
    trained_at, loaded_at, resized = RESIZED[layout]
    kwargs = dict(kwargs, img_size=trained_at)
    path = tmp_path / "foreign.pth"
    torch.save(to_layout(_timm_model(arch, **kwargs).state_dict()), path)

    kwargs["img_size"] = loaded_at
    theirs = timm.create_model(arch, pretrained=True, **SMALL, **kwargs,
                               pretrained_cfg_overlay=dict(file=str(path), num_classes=kwargs["num_classes"])).eval()
    ours = create_model(arch, pretrained=path, **SMALL, **kwargs).eval()
    assert ours.load_report.layout == TIMM_FILTER_LAYOUT and ours.load_report.resized == [resized]
    x = torch.randn(2, 3, loaded_at, loaded_at, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(x) - theirs(x)).abs().max() < 1e-5

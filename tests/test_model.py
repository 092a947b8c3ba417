"""The native VisionTransformer against timm's: same state dict, same numbers.

Random weights come from one shared pool of random numbers (views, no copies) and models are
built on the meta device, so the table-wide parity test spends its time in forward passes,
not in weight init.
"""
from __future__ import annotations

import functools
import json
import os
import re

import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import GluMlp, RmsNorm, SwiGLU, resample_abs_pos_embed

from vit_finetune import VisionTransformer, create_model, resize_pos_embed
from vit_finetune.models.archs import _table, get_arch, list_archs

ATOL = RTOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=5)

# ---- random weights without init cost ---------------------------------------------------------
_POOL_SIZE = 33_554_467  # prime, so consecutive tensors of equal shape never get the same slice
_POOLS: dict[str, torch.Tensor] = {}


def _pool(kind: str) -> torch.Tensor:
    if kind not in _POOLS:
        g = torch.Generator().manual_seed(len(_POOLS) + 1)
        base = torch.randn(_POOL_SIZE, generator=g)
        _POOLS[kind] = base.mul_(0.02) if kind == "matrix" else base.mul_(0.1).add_(kind == "scale")
    return _POOLS[kind]


def random_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Random tensors for every entry of `model.state_dict()` (which may live on 'meta').

    Matrices ~ N(0, 0.02), 1-d weights (norm scales) ~ 1 + N(0, 0.1), other vectors ~ N(0, 0.1).
    Each tensor is a fresh slice of a pool, so different tensors hold different numbers.
    """
    out, offset = {}, 0
    for name, ref in model.state_dict().items():
        kind = "matrix" if ref.ndim > 1 else "scale" if name.endswith("weight") else "shift"
        pool, n = _pool(kind), ref.numel()
        assert n <= pool.numel(), f"{name} is larger than the random pool"
        if offset + n > pool.numel():
            offset = 0
        out[name] = pool[offset:offset + n].view(ref.shape)
        offset += n
    return out


def timm_random(name: str, **kwargs) -> nn.Module:
    """timm's model for `name` (built on meta: no init) with random weights, in eval mode."""
    with torch.device("meta"):
        model = timm.create_model(name, **kwargs)
    assert not list(model.buffers()), "a buffer would be lost by building on meta"
    model.load_state_dict(random_state(model), strict=True, assign=True)
    return model.eval()


def native_from(timm_model: nn.Module, **kwargs) -> VisionTransformer:
    """The native model with `kwargs`, holding `timm_model`'s tensors (strict load both ways)."""
    with torch.device("meta"):
        model = VisionTransformer(**kwargs)
    model.load_state_dict(timm_model.state_dict(), strict=True, assign=True)
    timm_model.load_state_dict(model.state_dict(), strict=True)  # the reverse direction is strict too
    return model.eval()


def image(*size: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    h, w = size if len(size) == 2 else (size[0], size[0])
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def assert_same_outputs(timm_model, native, x, atol=ATOL, rtol=RTOL):
    feats_t = timm_model.forward_features(x)
    feats_n = native.forward_features(x)
    torch.testing.assert_close(feats_n, feats_t, atol=atol, rtol=rtol)
    torch.testing.assert_close(native.forward_head(feats_n), timm_model.forward_head(feats_t),
                               atol=atol, rtol=rtol)


# ---- every architecture in the table ----------------------------------------------------------
# test_arch_parity: each of the 169 archs (153 vision_transformer, 16 deit), built by timm from
# its name at depth 2 with random weights, against the native model from archs.json, at the
# arch's default input size (about 12 TFLOP in all: ~80 s of the ~170 s these files take on 2
# cores, one thread).
#
# VITFT_QUICK_PARITY=1 halves that: archs whose kwargs are identical except img_size
# (vit_*_224/_384, siglip 224..896, ...) share every code path but the position grid, so only one
# per such set (the smallest default size) runs at its default size; the others run through
# timm's own name-based build at a tiny input (2x3 patches), which still checks each arch's
# numerics (norm eps, activation, pooling, ...) against timm, and test_arch_state_dict_parity
# still checks their default-size position grids. test_every_arch_maps_to_a_kwargs_set checks
# that grouping.
QUICK = os.environ.get("VITFT_QUICK_PARITY") == "1"


def _group_key(name: str) -> str:
    kwargs = dict(_table()[name]["kwargs"])
    kwargs.pop("img_size")
    return json.dumps(kwargs, sort_keys=True)


def _representatives() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name in list_archs():
        groups.setdefault(_group_key(name), []).append(name)
    reps = {}
    for names in groups.values():
        names.sort(key=lambda n: (get_arch(n).img_size[0] * get_arch(n).img_size[1], n))
        reps[names[0]] = names
    return dict(sorted(reps.items()))


REPS = _representatives()


# attributes that follow the input size (or name the weights), the only things allowed to differ within a group
_SIZE_ATTRS = {"img_size", "grid_size", "num_patches", "pretrained_cfg", "default_cfg", "training"}


def _timm_structure(name: str) -> tuple:
    """What timm itself builds for `name`, input size aside: every module's settings and every tensor's shape."""
    with torch.device("meta"):
        model = timm.create_model(name)
    settings = {(path, key): repr(value) for path, module in model.named_modules()
                for key, value in vars(module).items() if not key.startswith("_") and key not in _SIZE_ATTRS}
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items() if key != "pos_embed"}
    return repr(model), settings, shapes, tuple(model.patch_embed.img_size)


def test_every_arch_maps_to_a_kwargs_set():
    """The quick parity mode runs one arch per group at full size: that is sound only if timm builds every
    member of a group as the same network but for the input size. Checked on timm's models, not on archs.json."""
    covered = {n for names in REPS.values() for n in names}
    assert covered == set(list_archs()) and len(list_archs()) == len(_table()) > 100
    for rep, names in REPS.items():
        *expected, _ = _timm_structure(rep)
        for name in names:
            *structure, img_size = _timm_structure(name)
            assert structure == expected, f"{name} is not built like {rep} apart from its input size"
            assert img_size == get_arch(name).img_size, name


@pytest.mark.parametrize("name", list_archs())
def test_arch_parity(name):
    arch = get_arch(name)
    size = arch.img_size
    if QUICK and name not in REPS:
        size = (2 * arch.patch_size[0], 3 * arch.patch_size[1])
    timm_model = timm_random(name, depth=2, img_size=size)
    native = native_from(timm_model, **dict(arch.kwargs, depth=2, img_size=size))
    assert_same_outputs(timm_model, native, image(*size))


@pytest.mark.parametrize("name", list_archs())
def test_arch_state_dict_parity(name):
    arch = get_arch(name)
    with torch.device("meta"):
        timm_model = timm.create_model(name, depth=2)
        native = VisionTransformer(**dict(arch.kwargs, depth=2))
    native.load_state_dict(timm_model.state_dict(), strict=True, assign=True)
    timm_model.load_state_dict(native.state_dict(), strict=True, assign=True)
    assert native.num_prefix_tokens == timm_model.num_prefix_tokens
    assert native.global_pool == timm_model.global_pool
    assert native.num_classes == timm_model.num_classes
    assert tuple(native.patch_embed.grid_size) == tuple(timm_model.patch_embed.grid_size)


# ---- DeiT (timm's deit module): plain, DeiT-III and distilled -------------------------------------
# test_arch_parity and test_arch_state_dict_parity above cover them in eval mode at their default size.
DEIT = list_archs("deit*")


def test_table_has_the_whole_deit_family():
    assert DEIT == sorted(timm.list_models(module="deit")) and len(DEIT) == 16
    distilled = [n for n in DEIT if get_arch(n).kwargs.get("distilled")]
    assert distilled == [n for n in DEIT if "_distilled_" in n] and len(distilled) == 4


@pytest.mark.parametrize("name", DEIT)
def test_deit_train_mode_parity(name):
    """Train mode as timm's: a distilled model returns the mean of its two heads (what fine-tuning on labels
    trains), and (logits, logits_dist) only once distilled training is switched on. A 2x3-patch input keeps
    this quick; the default grid is covered in eval mode above."""
    arch = get_arch(name)
    size = (2 * arch.patch_size[0], 3 * arch.patch_size[1])
    timm_model = timm_random(name, depth=2, img_size=size).train()
    native = native_from(timm_model, **dict(arch.kwargs, depth=2, img_size=size)).train()
    x = image(*size, batch=2)
    with torch.no_grad():
        torch.testing.assert_close(native(x), timm_model(x), atol=ATOL, rtol=RTOL)
        if not arch.kwargs.get("distilled"):
            return
        timm_model.set_distilled_training(True)
        native.set_distilled_training(True)
        ours, theirs = native(x), timm_model(x)
        assert isinstance(ours, tuple) and len(ours) == 2
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=RTOL)
        assert native.eval()(x).shape == (2, 1000)  # eval mode: the mean again


@pytest.fixture
def distilled_pair():
    kwargs = dict(SMALL, distilled=True)
    timm_model = timm_random("deit_tiny_distilled_patch16_224", **SMALL)
    return timm_model, native_from(timm_model, **kwargs)


def test_distilled_reset_classifier_replaces_both_heads(distilled_pair):
    timm_model, native = distilled_pair
    before = {k: v.clone() for k, v in native.state_dict().items()}
    native.reset_classifier(7)
    after = native.state_dict()
    assert set(after) == set(before) and native.num_classes == 7
    for key in ("head.weight", "head_dist.weight"):
        assert after[key].shape == (7, 64)
    for key, value in before.items():
        if not key.startswith(("head.", "head_dist.")):
            assert torch.equal(after[key], value), key
    assert native.eval()(image(32, batch=2)).shape == (2, 7)
    timm_model.reset_classifier(0)
    native.reset_classifier(0)
    timm_model.load_state_dict(native.state_dict(), strict=True)
    assert_same_outputs(timm_model, native, image(32, batch=2))  # features: the mean of the two tokens
    with pytest.raises(ValueError, match="distillation token"):
        native.reset_classifier(7, global_pool="avg")


def test_distilled_token_is_a_stem_parameter_without_weight_decay(distilled_pair):
    _, native = distilled_pair
    assert native.no_weight_decay() == {"pos_embed", "cls_token", "reg_token", "dist_token"}
    assert "dist_token" in dict(native.named_parameters())
    assert re.match(native.group_matcher()["stem"], "dist_token")
    assert native.get_classifier() == (native.head, native.head_dist)


def test_distilled_needs_the_class_token_pooling():
    with pytest.raises(ValueError, match="distilled=True needs global_pool='token'"):
        VisionTransformer(**dict(SMALL, distilled=True, global_pool="avg"))


# ---- hyperparameters not in the table --------------------------------------------------------
VARIANTS = {
    "pool_avg": (dict(global_pool="avg"), {}),
    "pool_avgmax": (dict(global_pool="avgmax"), {}),
    "pool_max": (dict(global_pool="max"), {}),
    "pool_none": (dict(global_pool=""), {}),
    "pool_map": (dict(global_pool="map"), {}),
    "qk_norm": (dict(qk_norm=True), {}),
    "layer_scale": (dict(init_values=1e-5), {}),
    "reg_tokens_no_embed_class": (dict(reg_tokens=4, no_embed_class=True), {}),
    "reg_tokens_avg_fc_norm": (dict(reg_tokens=4, class_token=False, global_pool="avg"), {}),
    "gelu_tanh": (dict(act_layer="gelu_tanh"), {}),
    "quick_gelu": (dict(act_layer="quick_gelu"), {}),
    "swiglu": (dict(mlp_layer="swiglu", act_layer="silu"), dict(mlp_layer=SwiGLU, act_layer=nn.SiLU)),
    "swiglu_packed": (dict(mlp_layer="swiglu_packed", act_layer="silu"),
                      dict(mlp_layer=functools.partial(GluMlp, gate_last=False), act_layer=nn.SiLU)),
    "glu": (dict(mlp_layer="glu", act_layer="sigmoid"), dict(mlp_layer=GluMlp, act_layer=nn.Sigmoid)),
    "rmsnorm": (dict(norm_layer="rmsnorm"), dict(norm_layer=functools.partial(RmsNorm, eps=1e-6))),
    "rmsnorm_qk_scale_norms": (
        dict(norm_layer="rmsnorm", norm_eps=1e-5, qk_norm=True, scale_attn_norm=True, scale_mlp_norm=True),
        dict(norm_layer=functools.partial(RmsNorm, eps=1e-5))),
    "pre_norm_no_final": (dict(pre_norm=True, final_norm=False), {}),
    "embed_norm_no_bias": (dict(embed_norm_layer="rmsnorm", embed_norm_eps=1e-5, qkv_bias=False, proj_bias=False),
                           dict(embed_norm_layer=functools.partial(RmsNorm, eps=1e-5))),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_parity(variant):
    native_kwargs, timm_layers = VARIANTS[variant]
    native_kwargs = dict(SMALL, **native_kwargs)
    timm_kwargs = {k: v for k, v in native_kwargs.items() if k not in ("norm_eps", "embed_norm_eps")}
    timm_model = timm_random("vit_tiny_patch16_224", **dict(timm_kwargs, **timm_layers))
    native = native_from(timm_model, **native_kwargs)
    assert_same_outputs(timm_model, native, image(32, batch=2))


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224"])
def test_full_depth_parity(name):
    arch = get_arch(name)
    timm_model = timm_random(name)
    native = native_from(timm_model, **arch.kwargs)
    assert len(native.blocks) == len(timm_model.blocks) == 12
    assert_same_outputs(timm_model, native, image(224))


# ---- model API ------------------------------------------------------------------------------
@pytest.fixture
def small_pair():
    timm_model = timm_random("vit_tiny_patch16_224", **SMALL)
    return timm_model, native_from(timm_model, **SMALL)


def test_forward_head_pre_logits_shape(small_pair):
    _, native = small_pair
    with torch.no_grad():
        feats = native.forward_features(image(32, batch=3))
        assert feats.shape == (3, 1 + 16, 64)
        assert native.forward_head(feats, pre_logits=True).shape == (3, 64)
        assert native.forward_head(feats).shape == (3, 5)


def test_reset_classifier_replaces_only_the_head(small_pair):
    _, native = small_pair
    before = {k: v.clone() for k, v in native.state_dict().items()}
    native.reset_classifier(7)
    after = native.state_dict()
    assert after["head.weight"].shape == (7, 64) and after["head.bias"].shape == (7,)
    assert native.num_classes == 7
    assert set(after) == set(before)
    for key, value in before.items():
        if not key.startswith("head."):
            assert torch.equal(after[key], value), key
    assert native(image(32, batch=2)).shape == (2, 7)
    native.reset_classifier(0)
    assert native(image(32)).shape == (1, 64)


def test_grad_checkpointing_same_output_and_gradients():
    torch.manual_seed(0)
    model = VisionTransformer(**SMALL).train()  # drop rates are 0 by default
    x = image(32, batch=2)

    def run(checkpointing: bool):
        model.zero_grad()
        model.set_grad_checkpointing(checkpointing)
        out = model(x)
        out.square().sum().backward()
        return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    out_plain, grads_plain = run(False)
    out_ckpt, grads_ckpt = run(True)
    assert model.grad_checkpointing
    torch.testing.assert_close(out_ckpt, out_plain, atol=1e-5, rtol=1e-5)
    assert grads_ckpt.keys() == grads_plain.keys()
    for key in grads_plain:
        torch.testing.assert_close(grads_ckpt[key], grads_plain[key], atol=1e-5, rtol=1e-5, msg=key)


def test_dynamic_img_size_matches_timm():
    kwargs = dict(SMALL, img_size=224, patch_size=16, dynamic_img_size=True)
    timm_model = timm_random("vit_tiny_patch16_224", **kwargs)
    native = native_from(timm_model, **kwargs)
    x = image(160, 224)
    assert_same_outputs(timm_model, native, x)
    with torch.no_grad():
        assert native(x).shape == (1, 5)
        assert native(image(224)).shape == (1, 5)


def test_no_weight_decay_names():
    model = VisionTransformer(**dict(SMALL, reg_tokens=4))
    names = model.no_weight_decay()
    assert names == {"pos_embed", "cls_token", "reg_token"}
    params = dict(model.named_parameters())
    assert names <= set(params)
    assert all(not name.startswith(("blocks", "head")) for name in names)


def test_wrong_input_size_raises_helpful_error():
    model = VisionTransformer(**SMALL).eval()
    with pytest.raises(ValueError, match=r"input is 48x48 but the model was built for 32x32.*dynamic_img_size"):
        model(image(48))


def test_drop_path_random_in_train_deterministic_in_eval():
    torch.manual_seed(0)
    model = VisionTransformer(**dict(SMALL, drop_path_rate=0.5))
    x = image(32, batch=8)
    with torch.no_grad():
        model.train()
        assert not torch.allclose(model(x), model(x))
        model.eval()
        torch.testing.assert_close(model(x), model(x), atol=0, rtol=0)


# ---- position embedding resizing ---------------------------------------------------------------
RESIZE_CASES = [
    ((14, 14), (20, 20), 1), ((14, 14), (10, 16), 1), ((12, 8), (20, 6), 0), ((12, 8), (20, 6), 5),
    ((16, 16), (9, 9), 5), ((7, 9), (7, 9), 1),
]


@pytest.mark.parametrize("old,new,prefix", RESIZE_CASES)
@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
@pytest.mark.parametrize("antialias", [True, False])
def test_resize_pos_embed_matches_timm(old, new, prefix, interpolation, antialias):
    posemb = torch.randn(1, prefix + old[0] * old[1], 32, generator=torch.Generator().manual_seed(3))
    ours = resize_pos_embed(posemb, new, old, prefix, interpolation=interpolation, antialias=antialias)
    theirs = resample_abs_pos_embed(posemb, list(new), list(old), prefix, interpolation=interpolation,
                                    antialias=antialias)
    assert ours.shape == (1, prefix + new[0] * new[1], 32)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert torch.equal(ours[:, :prefix], posemb[:, :prefix])


def test_resize_pos_embed_square_default_old_size_and_dtype():
    posemb = torch.randn(1, 1 + 196, 16).to(torch.bfloat16)
    out = resize_pos_embed(posemb, 10)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 101, 16)
    torch.testing.assert_close(out, resample_abs_pos_embed(posemb, [10, 10]), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"cannot infer a square grid from 96 position tokens; pass old_size=\(H, W\)"):
        resize_pos_embed(torch.randn(1, 1 + 96, 16), 10)


@pytest.mark.parametrize("img_size", [288, (160, 256)])
def test_model_at_new_img_size_matches_timm_pretrained(tmp_path, img_size):
    from safetensors.torch import save_file

    name = "vit_tiny_patch16_224"
    source = timm_random(name)
    file = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(file))

    native = create_model(name, pretrained=file, img_size=img_size).eval()
    theirs = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(file)),
                               img_size=img_size).eval()
    size = (img_size, img_size) if isinstance(img_size, int) else img_size
    assert native.pos_embed.shape == theirs.pos_embed.shape == (1, 1 + (size[0] // 16) * (size[1] // 16), 192)
    torch.testing.assert_close(native.pos_embed, theirs.pos_embed, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(native(image(*size)), theirs(image(*size)), atol=ATOL, rtol=RTOL)

"""The native Vision Transformer.

Module and parameter names mirror timm's `VisionTransformer` one for one, so any timm
ViT state dict loads with `strict=True` and no renaming. Layers are chosen by plain
names ('layernorm', 'gelu_tanh', 'swiglu', ...) so an architecture is pure data.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .pos_embed import _pair, resize_pos_embed

POOLS = ("", "token", "avg", "avgmax", "max", "map")


class QuickGELU(nn.Module):
    """CLIP's sigmoid approximation of GELU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "quick_gelu": QuickGELU,
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "sigmoid": nn.Sigmoid,
}


def make_norm(kind: str, eps: float) -> Callable[[int], nn.Module]:
    """A constructor `dim -> norm module` for 'layernorm' or 'rmsnorm'."""
    if kind == "layernorm":
        return lambda dim: nn.LayerNorm(dim, eps=eps)
    if kind == "rmsnorm":
        return lambda dim: nn.RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm_layer {kind!r}; use 'layernorm' or 'rmsnorm'")


def make_act(kind: str) -> Callable[[], nn.Module]:
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown act_layer {kind!r}; use one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[kind]


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth: drop the whole residual branch for a random subset of samples."""
    if rate == 0.0 or not training:
        return x
    keep = 1.0 - rate
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class DropPath(nn.Module):
    def __init__(self, rate: float = 0.0):
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.rate, self.training)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), float(init_values)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class PatchEmbed(nn.Module):
    """Image -> (B, H', W', C) grid of patch embeddings, by a stride-P convolution."""

    def __init__(self, img_size, patch_size, in_chans: int, embed_dim: int, bias: bool = True,
                 norm: Optional[Callable[[int], nn.Module]] = None, strict_img_size: bool = True):
        super().__init__()
        self.patch_size = _pair(patch_size)
        self.img_size = _pair(img_size)
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.strict_img_size = strict_img_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.norm = norm(embed_dim) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        if self.strict_img_size and (h, w) != self.img_size:
            raise ValueError(
                f"input is {h}x{w} but the model was built for {self.img_size[0]}x{self.img_size[1]}; "
                "resize the input, or build the model with img_size=... or dynamic_img_size=True")
        if not self.strict_img_size and (h % self.patch_size[0] or w % self.patch_size[1]):
            raise ValueError(f"input {h}x{w} is not divisible by the patch size {self.patch_size}")
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class Attention(nn.Module):
    """Multi-head self-attention: one fused qkv projection and PyTorch's SDPA kernel.

    SDPA returns no attention weights. Setting `attn_hook` (a callable taking the (B, heads, N, N) softmax) makes
    this layer compute softmax(q k^T / sqrt(d)) explicitly, from the same q and k, hand it to the hook and apply
    it to v, so gradients flow through the tensor the hook saw (explain.py's gradcam needs that). With the hook
    unset (the default), forward runs SDPA exactly as before.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 norm: Callable[[int], nn.Module] = nn.LayerNorm):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.norm = norm(dim) if scale_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)
        self.attn_hook: Optional[Callable[[torch.Tensor], None]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.attn_hook is None:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        else:
            x = self._explicit_attention(q, k, v)
        x = self.norm(x.transpose(1, 2).reshape(B, N, C))
        return self.proj_drop(self.proj(x))

    def _explicit_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """What SDPA computes, written out (as timm's non-fused path), with the weights passed to attn_hook."""
        attn = ((q * self.head_dim ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1)
        self.attn_hook(attn)
        return F.dropout(attn, self.attn_drop, self.training) @ v


class Mlp(nn.Module):
    """fc1 -> act -> (norm) -> fc2, the classic ViT feed-forward."""

    def __init__(self, dim: int, hidden: int, act: Callable[[], nn.Module], bias: bool = True, drop: float = 0.0,
                 norm: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.act = act()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm(hidden) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class GluMlp(Mlp):
    """Gated MLP with one packed fc1 whose halves are value and gate (timm's GluMlp / SwiGLUPacked)."""

    def __init__(self, dim: int, hidden: int, act: Callable[[], nn.Module], bias: bool = True, drop: float = 0.0,
                 norm: Optional[Callable[[int], nn.Module]] = None, gate_last: bool = True):
        super().__init__(dim, hidden, act, bias, drop)
        self.gate_last = gate_last
        self.norm = norm(hidden // 2) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden // 2, dim, bias=bias)

    def init_weights(self) -> None:
        gate = slice(self.fc1.weight.shape[0] // 2, None)  # timm initialises the second half as the gate
        nn.init.normal_(self.fc1.weight[gate], std=1e-6)
        if self.fc1.bias is not None:
            nn.init.ones_(self.fc1.bias[gate])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc1(x).chunk(2, dim=-1)
        x = a * self.act(b) if self.gate_last else self.act(a) * b
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


class SwiGLU(nn.Module):
    """Gated MLP with separate gate (fc1_g) and value (fc1_x) projections."""

    def __init__(self, dim: int, hidden: int, act: Callable[[], nn.Module], bias: bool = True, drop: float = 0.0,
                 norm: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        self.fc1_g = nn.Linear(dim, hidden, bias=bias)
        self.fc1_x = nn.Linear(dim, hidden, bias=bias)
        self.act = act()
        self.drop1 = nn.Dropout(drop)
        self.norm = norm(hidden) if norm else nn.Identity()
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def init_weights(self) -> None:
        nn.init.normal_(self.fc1_g.weight, std=1e-6)
        if self.fc1_g.bias is not None:
            nn.init.ones_(self.fc1_g.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1_g(x)) * self.fc1_x(x)
        return self.drop2(self.fc2(self.norm(self.drop1(x))))


MLPS = {
    "mlp": Mlp,
    "swiglu": SwiGLU,
    "swiglu_packed": lambda *a, **kw: GluMlp(*a, **kw, gate_last=False),
    "glu": GluMlp,
}


class Block(nn.Module):
    """Pre-norm encoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, *, qkv_bias: bool = False,
                 qk_norm: bool = False, scale_attn_norm: bool = False, scale_mlp_norm: bool = False,
                 proj_bias: bool = True, proj_drop: float = 0.0, attn_drop: float = 0.0,
                 init_values: Optional[float] = None, drop_path: float = 0.0,
                 act: Callable[[], nn.Module] = nn.GELU, norm: Callable[[int], nn.Module] = nn.LayerNorm,
                 mlp_layer: str = "mlp"):
        super().__init__()
        self.norm1 = norm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, scale_norm=scale_attn_norm,
                              proj_bias=proj_bias, attn_drop=attn_drop, proj_drop=proj_drop, norm=norm)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm(dim)
        self.mlp = MLPS[mlp_layer](dim, int(dim * mlp_ratio), act, bias=proj_bias, drop=proj_drop,
                                   norm=norm if scale_mlp_norm else None)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class AttentionPoolLatent(nn.Module):
    """'map' pooling: a learned latent query attends over the tokens, then an MLP (SigLIP's head)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, norm: Callable[[int], nn.Module],
                 act: Callable[[], nn.Module]):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, dim * 2)
        self.proj = nn.Linear(dim, dim)
        self.norm = norm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act)

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.latent, std=self.latent.shape[-1] ** -0.5, a=-2.0, b=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, C)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class VisionTransformer(nn.Module):
    """ViT: patch embedding, prefix tokens, position embedding, encoder blocks, pooling and head.

    Hyperparameter names and defaults are timm's; `norm_layer`, `act_layer` and `mlp_layer`
    are names rather than classes. `distilled=True` is DeiT's distilled ViT (timm's
    `VisionTransformerDistilled`): a distillation token after the class token and a second head,
    `head_dist`, reading it; the output is the mean of the two heads.
    """

    def __init__(
        self,
        img_size: int | Sequence[int] = 224,
        patch_size: int | Sequence[int] = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        scale_attn_norm: bool = False,
        scale_mlp_norm: bool = False,
        proj_bias: bool = True,
        init_values: Optional[float] = None,
        class_token: bool = True,
        no_embed_class: bool = False,
        reg_tokens: int = 0,
        distilled: bool = False,
        pre_norm: bool = False,
        final_norm: bool = True,
        fc_norm: Optional[bool] = None,
        pool_include_prefix: bool = False,
        dynamic_img_size: bool = False,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: str = "layernorm",
        norm_eps: float = 1e-6,
        embed_norm_layer: Optional[str] = None,
        embed_norm_eps: float = 1e-6,
        act_layer: str = "gelu",
        mlp_layer: str = "mlp",
    ):
        super().__init__()
        if global_pool not in POOLS:
            raise ValueError(f"unknown global_pool {global_pool!r}; use one of {POOLS}")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True")
        if distilled and (global_pool != "token" or not class_token or reg_tokens or fc_norm):
            raise ValueError("distilled=True needs global_pool='token', a class token, no reg_tokens and no fc_norm: "
                             "the two heads read the class and distillation tokens")
        if mlp_layer not in MLPS:
            raise ValueError(f"unknown mlp_layer {mlp_layer!r}; use one of {', '.join(MLPS)}")
        use_fc_norm = global_pool in ("avg", "avgmax", "max") if fc_norm is None else fc_norm
        norm = make_norm(norm_layer, norm_eps)
        act = make_act(act_layer)

        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_reg_tokens = reg_tokens
        self.num_prefix_tokens = int(class_token) + int(distilled) + reg_tokens
        self.has_class_token = class_token
        self.no_embed_class = no_embed_class
        self.pool_include_prefix = pool_include_prefix
        self.dynamic_img_size = dynamic_img_size
        self.grad_checkpointing = False
        self.pretrained_cfg: dict = {}
        self.model_args: dict = {}  # the arguments that differ from the architecture's (weights.create_model)
        self.load_report = None  # weights.LoadReport: what loading a checkpoint did (None: random init)

        self.patch_embed = PatchEmbed(
            img_size, patch_size, in_chans, embed_dim, bias=not pre_norm,
            norm=make_norm(embed_norm_layer, embed_norm_eps) if embed_norm_layer else None,
            strict_img_size=not dynamic_img_size)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        embed_len = num_patches if no_embed_class else num_patches + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.norm_pre = norm(embed_dim) if pre_norm else nn.Identity()

        rates = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()  # works under a meta device
        self.blocks = nn.Sequential(*[
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, qk_norm=qk_norm,
                  scale_attn_norm=scale_attn_norm, scale_mlp_norm=scale_mlp_norm, proj_bias=proj_bias,
                  proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, init_values=init_values, drop_path=rates[i],
                  act=act, norm=norm, mlp_layer=mlp_layer)
            for i in range(depth)])
        self.norm = norm(embed_dim) if final_norm and not use_fc_norm else nn.Identity()
        self.attn_pool = AttentionPoolLatent(embed_dim, num_heads, mlp_ratio, norm, act) \
            if global_pool == "map" else None
        self.fc_norm = norm(embed_dim) if final_norm and use_fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = (nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()) \
            if distilled else None
        self.distilled_training = False  # timm's switch: True returns both heads' logits in train mode
        self.init_weights()

    # ---- initialisation -------------------------------------------------------------------
    def init_weights(self) -> None:
        """timm's default ViT init: truncated-normal linears and position embedding, tiny tokens."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():
            if hasattr(module, "init_weights") and module is not self:
                module.init_weights()

    # ---- timm-compatible helpers ----------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "reg_token"} | ({"dist_token"} if self.dist_token is not None else set())

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups for layer-wise LR decay (timm's optimizer factory reads this)."""
        return dict(stem=r"^cls_token|dist_token|reg_token|pos_embed|patch_embed|norm_pre",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def set_distilled_training(self, enable: bool = True) -> None:
        """For training against a teacher (timm's TokenDistillationTask): train mode returns (logits, logits_dist)."""
        self.distilled_training = enable

    def get_classifier(self) -> nn.Module | tuple[nn.Module, nn.Module]:
        """The head; a distilled model's two heads as (head, head_dist), as timm's."""
        return self.head if self.head_dist is None else (self.head, self.head_dist)

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """Replace the head (and a distilled model's head_dist), freshly initialised, for `num_classes` outputs."""
        if self.head_dist is not None and global_pool not in (None, "token"):
            raise ValueError("a distilled model's heads read the class and distillation tokens: "
                             "keep global_pool='token'")
        if global_pool is not None and global_pool != self.global_pool:
            if global_pool not in POOLS or "map" in (global_pool, self.global_pool):
                raise ValueError(f"cannot switch pooling from {self.global_pool!r} to {global_pool!r}")
            if global_pool == "token" and not self.has_class_token:
                raise ValueError("global_pool='token' needs a class token")
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = self._new_head(num_classes)
        if self.head_dist is not None:
            self.head_dist = self._new_head(num_classes)

    def _new_head(self, num_classes: int) -> nn.Module:
        ref = self.pos_embed
        head = nn.Linear(self.embed_dim, num_classes, device=ref.device, dtype=ref.dtype) \
            if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            nn.init.trunc_normal_(head.weight, std=0.02)
            nn.init.zeros_(head.bias)
        return head.train(self.training)

    def set_input_size(self, img_size: int | Sequence[int]) -> None:
        """Rebuild for a new input resolution, resizing the position embedding."""
        old_grid = self.patch_embed.grid_size
        pe = self.patch_embed
        pe.img_size = _pair(img_size)
        pe.grid_size = (pe.img_size[0] // pe.patch_size[0], pe.img_size[1] // pe.patch_size[1])
        pe.num_patches = pe.grid_size[0] * pe.grid_size[1]
        if pe.grid_size != old_grid:
            prefix = 0 if self.no_embed_class else self.num_prefix_tokens
            with torch.no_grad():
                resized = resize_pos_embed(self.pos_embed.data, pe.grid_size, old_grid, prefix)
            self.pos_embed = nn.Parameter(resized, requires_grad=self.pos_embed.requires_grad)
        if self.pretrained_cfg:
            self.pretrained_cfg = {**self.pretrained_cfg, "input_size": (pe.proj.in_channels, *pe.img_size)}

    # ---- forward --------------------------------------------------------------------------
    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        pos_embed = self.pos_embed
        if (H, W) != self.patch_embed.grid_size:
            pos_embed = resize_pos_embed(pos_embed, (H, W), self.patch_embed.grid_size,
                                         0 if self.no_embed_class else self.num_prefix_tokens)
        x = x.reshape(B, H * W, C)
        prefix = [t.expand(B, -1, -1) for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        if self.no_embed_class:
            x = torch.cat(prefix + [x + pos_embed], dim=1)
        else:
            x = torch.cat(prefix + [x], dim=1) + pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Image -> normed token sequence (B, prefix + patches, C)."""
        x = self.norm_pre(self._pos_embed(self.patch_embed(x)))
        if self.grad_checkpointing and torch.is_grad_enabled():
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens the head reads: (B, D), or (B, 2, D) for the two heads of a distilled model."""
        if self.head_dist is not None:
            return x[:, :2]  # class and distillation tokens
        if self.attn_pool is not None:
            return self.attn_pool(x if self.pool_include_prefix else x[:, self.num_prefix_tokens:])
        if not self.global_pool:
            return x
        if self.global_pool == "token":
            return x[:, 0]
        x = x if self.pool_include_prefix else x[:, self.num_prefix_tokens:]
        if self.global_pool == "avg":
            return x.mean(dim=1)
        if self.global_pool == "max":
            return x.amax(dim=1)
        return 0.5 * (x.amax(dim=1) + x.mean(dim=1))  # avgmax

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.classify(self.pool(x), pre_logits)

    def classify(self, pooled: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The head from pooled features: a frozen backbone's can be computed once and cached."""
        if self.head_dist is not None:
            return self._forward_distilled_head(pooled, pre_logits)
        x = self.head_drop(self.fc_norm(pooled))
        return x if pre_logits else self.head(x)

    def _forward_distilled_head(self, x: torch.Tensor, pre_logits: bool):
        """timm's VisionTransformerDistilled head: the mean of both heads' logits, so fine-tuning on labels
        alone trains both; (logits, logits_dist) only in train mode with distilled_training set."""
        x, x_dist = self.head_drop(x[:, 0]), self.head_drop(x[:, 1])
        if pre_logits:
            return (x + x_dist) / 2
        x, x_dist = self.head(x), self.head_dist(x_dist)
        if self.distilled_training and self.training:
            return x, x_dist
        return (x + x_dist) / 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


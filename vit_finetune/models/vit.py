"""The native Vision Transformer.

Module and parameter names mirror timm's `VisionTransformer` one for one, so any timm
ViT state dict loads with `strict=True` and no renaming. Layers are chosen by plain
names ('layernorm', 'gelu_tanh', 'swiglu', ...) so an architecture is pure data.
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .archs import get_arch
from .layers import MLPS, AttentionPoolLatent, Block, PatchEmbed, make_act, make_norm
from .pos_embed import resize_pos_embed, to_int_pair

POOLS = ("", "token", "avg", "avgmax", "max", "map")


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
        self.model_args: dict = {}  # the arguments that differ from the architecture's (differing_args)
        self.load_report = None  # weights.loading.LoadReport: what loading a checkpoint did (None: random init)

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
        pe.img_size = to_int_pair(img_size)
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
        return self.norm(self.forward_tokens(x, len(self.blocks)))

    def forward_tokens(self, x: torch.Tensor, stop: int) -> torch.Tensor:
        """Image -> the tokens that enter blocks[stop] (B, prefix + patches, C): the embedding and the blocks
        before `stop`. With forward_from, the split of forward() that partial fine-tuning caches at (a frozen
        lower part's output, computed once)."""
        return self._run_blocks(self.norm_pre(self._pos_embed(self.patch_embed(x))), 0, stop)

    def forward_from(self, x: torch.Tensor, start: int, pre_logits: bool = False) -> torch.Tensor:
        """The tokens that enter blocks[start] -> logits: the blocks from `start`, the final norm, pooling and
        head. forward_from(forward_tokens(x, k), k) is forward(x) for any k in 0..depth."""
        return self.forward_head(self.norm(self._run_blocks(x, start, len(self.blocks))), pre_logits)

    def _run_blocks(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        blocks = self.blocks[start:stop]
        if self.grad_checkpointing and torch.is_grad_enabled():
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False)
            return x
        return blocks(x)

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


MODEL_DEFAULTS = {name: p.default for name, p in inspect.signature(VisionTransformer.__init__).parameters.items()
                  if name != "self"}


def differing_args(kwargs: dict, arch: str) -> dict:
    """The arguments in `kwargs` that differ from architecture `arch`'s: what a config.json records as model_args.

    The head size is recorded on its own (num_classes); LayerScale's init_values only by whether there is
    LayerScale, as its values come with the weights.
    """
    base = get_arch(arch).kwargs

    def same(key: str, ours, theirs) -> bool:
        if key == "init_values":
            return bool(ours) == bool(theirs)
        return (list(ours) if isinstance(ours, tuple) else ours) == (list(theirs) if isinstance(theirs, tuple)
                                                                      else theirs)

    return {k: v for k, v in kwargs.items()
            if k != "num_classes" and not same(k, v, base.get(k, MODEL_DEFAULTS[k]))}

"""The building blocks of the native ViT: patch embedding, attention, MLPs, LayerScale, blocks, attention pooling.

Names and parameters mirror timm's layers one for one (timm's state dicts load without renaming); norms,
activations and MLPs are chosen by plain names so that an architecture is pure data.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .pos_embed import to_int_pair


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
        self.patch_size = to_int_pair(patch_size)
        self.img_size = to_int_pair(img_size)
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

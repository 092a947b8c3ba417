"""Interpolation of learned absolute position embeddings to a new patch grid."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from timm.layers import to_2tuple


def to_int_pair(size: int | Sequence[int]) -> tuple[int, int]:
    """(height, width) from one side length or a pair of them (timm's to_2tuple), as plain ints: a numpy
    integer would reach config.json, which cannot hold one."""
    height, width = to_2tuple(size)
    return int(height), int(width)


def resize_pos_embed(
    posemb: torch.Tensor,
    new_size: int | Sequence[int],
    old_size: Optional[int | Sequence[int]] = None,
    num_prefix_tokens: int = 1,
    interpolation: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Resize a (1, prefix + H*W, C) position embedding to the grid `new_size`.

    Prefix tokens (class and register tokens) are kept as they are; the grid part is
    interpolated in float32 and cast back. `old_size` defaults to a square grid.
    Agrees with `timm.layers.resample_abs_pos_embed` for the same arguments.
    """
    new_h, new_w = to_int_pair(new_size)
    num_grid_tokens = posemb.shape[1] - num_prefix_tokens
    if old_size is None:
        side = int(math.sqrt(num_grid_tokens))
        if side * side != num_grid_tokens:
            raise ValueError(
                f"cannot infer a square grid from {num_grid_tokens} position tokens; pass old_size=(H, W)")
        old_size = (side, side)
    old_h, old_w = to_int_pair(old_size)
    if old_h * old_w != num_grid_tokens:
        raise ValueError(
            f"position embedding has {num_grid_tokens} grid tokens, which is not old_size {old_h}x{old_w}")
    if (old_h, old_w) == (new_h, new_w):
        return posemb

    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    dim = grid.shape[-1]
    grid = grid.float().reshape(1, old_h, old_w, dim).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(new_h, new_w), mode=interpolation, antialias=antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_h * new_w, dim).to(posemb.dtype)
    return torch.cat([prefix, grid], dim=1)

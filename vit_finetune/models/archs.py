"""The architecture table (data, generated from timm by scripts/gen_archs.py) and the aliases."""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from ..errors import VitftError, did_you_mean

# torchvision-style names -> a timm architecture with good default weights ("arch.tag").
ALIASES: dict[str, str] = {
    "vit_t_16": "vit_tiny_patch16_224.augreg_in21k_ft_in1k",
    "vit_s_16": "vit_small_patch16_224.augreg_in21k_ft_in1k",
    "vit_b_16": "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_b_32": "vit_base_patch32_224.augreg_in21k_ft_in1k",
    "vit_l_16": "vit_large_patch16_224.augreg_in21k_ft_in1k",
    "vit_l_32": "vit_large_patch32_384.orig_in21k_ft_in1k",
    "vit_h_14": "vit_huge_patch14_clip_224.laion2b_ft_in12k_in1k",
}


@dataclass(frozen=True)
class Arch:
    name: str
    kwargs: dict
    params_m: float
    img_size: tuple[int, int]
    patch_size: tuple[int, int]
    default_tag: Optional[str]


@lru_cache(maxsize=None)
def _table() -> dict[str, dict]:
    return json.loads((Path(__file__).with_name("archs.json")).read_text())


def list_archs(pattern: str = "*") -> list[str]:
    return sorted(n for n in _table() if fnmatch.fnmatch(n, pattern))


def get_arch(name: str) -> Arch:
    """The architecture `name` (no tag, no alias); a 'did you mean' error when unknown."""
    entry = _table().get(name)
    if entry is None:
        hint = did_you_mean(name.split(".")[0], [*_table(), *ALIASES])
        raise VitftError(f"unknown model {name!r}{hint}; `vitft models` lists the supported names")
    return Arch(name=name, kwargs=dict(entry["kwargs"]), params_m=entry["params_m"],
                img_size=tuple(entry["img_size"]), patch_size=tuple(entry["patch_size"]),
                default_tag=entry["default_tag"])


def split_name(name: str) -> tuple[str, Optional[str]]:
    """'vit_b_16' or 'arch.tag' or 'arch' -> (arch, tag or None), resolving aliases."""
    name = ALIASES.get(name, name)
    arch, _, tag = name.partition(".")
    get_arch(arch)
    return arch, tag or None

"""One reading of a model reference: what a --model / --pretrained value or a `load_model` source names.

A reference is `none` (no weights), `true` (the named model's own weights), `hf-hub:org/repo[@revision]`,
`local-dir:PATH`, an existing folder or file, a path that does not exist (written as one: a separator, `~`, or
a weights file suffix), or a name: an architecture, `arch.tag` or an alias. Parsing touches no network and
imports nothing heavy; what a name means is only looked up (in the architecture table) when asked.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from ..models.archs import split_name

TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", *TORCH_SUFFIXES)
HUB_PREFIX, LOCAL_DIR_PREFIX = "hf-hub:", "local-dir:"


class RefKind(Enum):
    NONE = "none"  # no weights: None, False, '', 'none', 'false'
    DEFAULT = "default"  # True / 'true': the weights the model name itself implies
    HUB = "hf-hub"  # hf-hub:org/repo[@revision]
    LOCAL_DIR = "local-dir"  # local-dir:PATH, timm's prefix for a model folder
    FOLDER = "folder"  # an existing folder
    FILE = "file"  # an existing file
    MISSING_PATH = "missing path"  # written as a path, but nothing is there
    NAME = "name"  # architecture, arch.tag or alias (checked only by `arch_tag`)


LOCAL_KINDS = (RefKind.LOCAL_DIR, RefKind.FOLDER, RefKind.FILE, RefKind.MISSING_PATH)
FOLDER_KINDS = (RefKind.HUB, RefKind.LOCAL_DIR, RefKind.FOLDER)  # hold their own config.json (architecture)


@dataclass(frozen=True)
class ModelRef:
    kind: RefKind
    text: str  # the reference as given (stripped)
    target: str = ""  # the repo id (HUB, without revision), the path (local kinds) or the name (NAME)
    revision: Optional[str] = None  # HUB only

    @property
    def path(self) -> Path:
        return Path(self.target).expanduser()

    @property
    def is_local(self) -> bool:
        """A file or folder on this machine (existing or not): its path is private."""
        return self.kind in LOCAL_KINDS

    @property
    def is_model_folder(self) -> bool:
        """A Hub repo or local folder, which carries its own architecture and config."""
        return self.kind in FOLDER_KINDS

    @property
    def arch_tag(self) -> tuple[str, Optional[str]]:
        """(architecture, tag or None) of a name, aliases resolved; an unknown name is a VitftError."""
        return split_name(self.text)


def parse_ref(value: Any) -> ModelRef:
    """The kind of model reference `value` is (see the module docstring); never raises."""
    if value is None or value is False:
        return ModelRef(RefKind.NONE, "none")
    if value is True:
        return ModelRef(RefKind.DEFAULT, "true")
    text = str(value).strip()
    if text.lower() in ("", "none", "false"):
        return ModelRef(RefKind.NONE, text)
    if text.lower() == "true":
        return ModelRef(RefKind.DEFAULT, text)
    if text.startswith(HUB_PREFIX):
        repo_id, _, revision = text[len(HUB_PREFIX):].partition("@")
        return ModelRef(RefKind.HUB, text, repo_id, revision or None)
    if text.startswith(LOCAL_DIR_PREFIX):
        return ModelRef(RefKind.LOCAL_DIR, text, text[len(LOCAL_DIR_PREFIX):])
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelRef(RefKind.FOLDER, text, text)
    if path.exists():
        return ModelRef(RefKind.FILE, text, text)
    if "/" in text or os.sep in text or text.startswith("~") or path.suffix in WEIGHT_SUFFIXES:
        return ModelRef(RefKind.MISSING_PATH, text, text)
    return ModelRef(RefKind.NAME, text, text)

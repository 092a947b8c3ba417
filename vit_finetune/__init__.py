"""vitft: fine-tune Vision Transformers, with a native ViT that loads every timm ViT checkpoint.

The public names are imported on first use (`vf.create_model` imports torch then), so that `import vit_finetune`
and the `vitft` command line start without torch, timm or albumentations.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
# the project's repository (pyproject.toml's [project.urls] Repository says the same): vitft is not on PyPI, so
# install instructions say `pip install git+` this, or `pip install -e .` in a clone
__url__ = "https://github.com/vitft/vit-finetune"

_PUBLIC = {  # name -> the module that defines it
    "ALIASES": "models.archs", "list_archs": "models.archs",
    "VitftError": "errors",
    "EvalReport": "tasks.report", "evaluate": "tasks.evaluate",
    "Prediction": "tasks.predict", "predict": "tasks.predict",
    "Explanation": "tasks.explain", "explain": "tasks.explain",
    "PushResult": "hub.push", "export": "hub.export", "push": "hub.push",
    "VisionTransformer": "models.vit",
    "resize_pos_embed": "models.pos_embed",
    "TrainConfig": "config",
    "RunResult": "engine.trainer", "finetune": "engine.api",
    "create_model": "weights.loading", "load_model": "weights.loading", "save_pretrained": "weights.saving",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from .config import TrainConfig  # noqa: F401
    from .engine.api import finetune  # noqa: F401
    from .engine.trainer import RunResult  # noqa: F401
    from .errors import VitftError  # noqa: F401
    from .hub.export import export  # noqa: F401
    from .hub.push import PushResult, push  # noqa: F401
    from .models.archs import ALIASES, list_archs  # noqa: F401
    from .models.pos_embed import resize_pos_embed  # noqa: F401
    from .models.vit import VisionTransformer  # noqa: F401
    from .tasks.evaluate import evaluate  # noqa: F401
    from .tasks.explain import Explanation, explain  # noqa: F401
    from .tasks.predict import Prediction, predict  # noqa: F401
    from .tasks.report import EvalReport  # noqa: F401
    from .weights.loading import create_model, load_model  # noqa: F401
    from .weights.saving import save_pretrained  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next access skips __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


"""vitft: fine-tune Vision Transformers, with a native ViT that loads every timm ViT checkpoint.

The public names are imported on first use (`vf.create_model` imports torch then), so that `import vit_finetune`
and the `vitft` command line start without torch, timm or albumentations.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {  # name -> the module that defines it
    "ALIASES": "models.archs", "list_archs": "models.archs",
    "VitftError": "errors",
    "EvalReport": "evaluate", "Prediction": "evaluate", "evaluate": "evaluate", "predict": "evaluate",
    "Explanation": "explain", "explain": "explain",
    "PushResult": "hub", "export": "hub", "push": "hub",
    "VisionTransformer": "models.vit",
    "resize_pos_embed": "models.pos_embed",
    "TrainConfig": "config",
    "RunResult": "train", "finetune": "train",
    "create_model": "weights.loading", "load_model": "weights.loading", "save_pretrained": "weights.saving",
}

__all__ = sorted(_PUBLIC)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from .config import TrainConfig  # noqa: F401
    from .errors import VitftError  # noqa: F401
    from .evaluate import EvalReport, Prediction, evaluate, predict  # noqa: F401
    from .explain import Explanation, explain  # noqa: F401
    from .hub import PushResult, export, push  # noqa: F401
    from .models.archs import ALIASES, list_archs  # noqa: F401
    from .models.pos_embed import resize_pos_embed  # noqa: F401
    from .models.vit import VisionTransformer  # noqa: F401
    from .train import RunResult, finetune  # noqa: F401
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


class _Package(types.ModuleType):
    """Keeps the functions `evaluate` and `explain` under their names when their submodules are imported (the
    import system sets `vit_finetune.evaluate` to the submodule then), as the eager imports used to."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC.get(name) == name:
            self.__dict__.pop(name, None)  # the next access imports the function through __getattr__
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

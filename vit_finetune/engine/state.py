"""What a checkpoint saves and restores: the model, the optimisation state, where the run is, and every RNG.

A checkpoint holds tensors and plain values only, so that it loads with torch.load(weights_only=True). A LoRA run's
checkpoint holds the adapter and the head, not the frozen weights: a resume reads those again from --pretrained.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn as nn

from ..config import TrainConfig
from ..errors import VitftError
from ..weights.adapters import adapter_state, is_adapted, load_adapter_state
from ..weights.loading import create_model
from .model_setup import build_model


@dataclass
class TrainState:
    """The run's moving parts and its position: `state_dict()` is last/checkpoint.pt."""

    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: Optional[Any] = None  # timm's ModelEmaV3
    epoch: int = 0  # epochs done
    step_in_epoch: int = 0  # optimizer steps done in the current epoch
    global_step: int = 0
    best_top1: float = -1.0
    best_epoch: int = -1
    rows: list[dict] = field(default_factory=list)  # metrics.csv's rows
    budget: Optional[Any] = None  # a --time-budget's TimeBudget: its plan and the time used

    def state_dict(self) -> dict:
        return {
            "model": adapter_state(self.model) if is_adapted(self.model) else self.model.state_dict(),
            "pretrained_cfg": self.model.pretrained_cfg,
            "model_args": self.model.model_args,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema else None,
            "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "global_step": self.global_step,
            "best_top1": self.best_top1, "best_epoch": self.best_epoch, "rows": self.rows,
            "rng": rng_state(),
            "config": self.config.to_dict(),
            "budget": self.budget.state_dict() if self.budget else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """The optimisation state and position; the model's weights were restored before anything was built from
        it (model_from_checkpoint)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema and state["ema"]:
            self.ema.load_state_dict(state["ema"])
        self.epoch, self.step_in_epoch, self.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        self.best_top1, self.best_epoch, self.rows = state["best_top1"], state["best_epoch"], state["rows"]
        set_rng_state(state["rng"])
        if self.budget and state.get("budget"):
            self.budget.load_state_dict(state["budget"])

    def record(self, top1: float) -> bool:
        """Count the epoch just validated; whether its top-1 is the best so far."""
        self.epoch += 1
        self.step_in_epoch = 0
        if top1 <= self.best_top1:
            return False
        self.best_top1, self.best_epoch = top1, self.epoch
        return True


def model_from_checkpoint(state: dict, classes: list[str], data: str) -> nn.Module:
    """The run's model with its checkpointed weights and preprocessing, for data with the same classes."""
    trained_on = state["pretrained_cfg"].get("label_names")
    if trained_on is not None and list(trained_on) != list(classes):
        raise VitftError(f"this run was trained on classes {', '.join(trained_on)} but {data} has "
                         f"{', '.join(classes)}; resume with the same data")
    if state["config"].get("lora"):  # the frozen base weights again, then the adapter
        model = build_model(TrainConfig.from_dict(state["config"]), len(classes))
        load_adapter_state(model, state["model"])
    else:
        model = create_model(state["pretrained_cfg"]["architecture"], num_classes=len(classes), **state["model_args"])
        model.load_state_dict(state["model"])
    model.pretrained_cfg = dict(state["pretrained_cfg"])
    model.model_args = state["model_args"]
    return model


def rng_state() -> dict:
    """Every RNG's state as tensors and plain numbers, so that a checkpoint loads with weights_only=True."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, words, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                      "gauss": float(gauss)},
            "python": {"version": version, "words": list(words), "gauss_next": gauss_next}}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype(np.uint32), numpy["pos"], numpy["has_gauss"],
                         numpy["gauss"]))
    python = state["python"]
    random.setstate((python["version"], tuple(python["words"]), python["gauss_next"]))

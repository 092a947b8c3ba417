"""Where partial fine-tuning keeps the frozen lower blocks' token activations: in memory when they fit, else in a
memory-mapped file in the run folder's scratch/, else nowhere (the frozen blocks then run at every step).

A row is (prefix + patches) x width values per image and view: 50 kB for a DINOv2 ViT-S/14 at 112 px in bf16,
0.8 MB for a ViT-B/16 at 224 px in fp32, so a data set's activations may well not fit in memory. They are stored
in the training precision's storage type (bf16/fp16 when the run computes in it: the blocks would round their
input to it anyway, else fp32).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from ..run_folder import RunFolder

MEMORY_SHARE = 0.5  # the most of the memory available now that the cache may take: training needs the rest
DISK_SHARE = 0.8  # the most of the free disk that the cache's file may take
MEMORY, FILE, RECOMPUTE = "memory", "a memory-mapped file", "recompute"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def storage_dtype(precision: str) -> torch.dtype:
    """The dtype activations are stored in: the run's half type when it computes in one, else float32."""
    return _DTYPES.get(precision, torch.float32)


def available_memory() -> int:
    """Bytes of memory available to a new allocation: Linux's MemAvailable (page cache counts as free), else the
    free physical pages; psutil is not a dependency."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def row_shape(model: nn.Module) -> tuple[int, int]:
    """(tokens, width) of one image's activations between two blocks."""
    return model.patch_embed.num_patches + model.num_prefix_tokens, model.embed_dim


@dataclass
class Storage:
    """Where `rows` activations of `shape` go, in `dtype`, and what they take."""

    where: str  # MEMORY, FILE or RECOMPUTE
    rows: int
    shape: tuple[int, int]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.rows * self.shape[0] * self.shape[1] * self.dtype.itemsize

    @property
    def size(self) -> str:
        digits = 2 if self.nbytes < 10 * 2**20 else 0
        return f"{self.nbytes / 2**20:,.{digits}f} MB {str(self.dtype).removeprefix('torch.')}"

    def describe(self) -> str:
        if self.where == RECOMPUTE:
            return f"{self.size}, more than fits in memory or on disk: the frozen blocks run at every step instead"
        return f"{self.size} in {self.where}"


def plan_storage(rows: int, shape: tuple[int, int], precision: str, folder: RunFolder, processes: int = 1) -> Storage:
    """In memory when the activations take at most MEMORY_SHARE of the memory available (shared by the `processes`
    of this machine), else in a file when they take at most DISK_SHARE of the free disk, else recompute."""
    storage = Storage(RECOMPUTE, rows, shape, storage_dtype(precision))
    if storage.nbytes <= MEMORY_SHARE * available_memory() / processes:
        storage.where = MEMORY
    elif storage.nbytes <= DISK_SHARE * folder.scratch_space() / processes:
        storage.where = FILE
    return storage


class ActivationBuffer:
    """The rows of a Storage: a tensor in memory, or memory-mapped to a scratch file that release() deletes."""

    def __init__(self, storage: Storage, folder: RunFolder, rank: int):
        self.folder, self.name = folder, f"activations-rank{rank}.bin"
        shape = (storage.rows, *storage.shape)
        self.file: Optional[str] = None
        if storage.where == FILE:
            self.tensor = folder.scratch_tensor(self.name, shape, storage.dtype)
            self.file = str(folder.scratch_dir / self.name)
        else:
            self.tensor = torch.empty(shape, dtype=storage.dtype)

    def release(self) -> None:
        """Drop the rows (and delete the file): the caller must hold no view of them any longer."""
        self.tensor = None
        if self.file is not None:
            self.folder.remove_scratch(self.name)
            self.file = None

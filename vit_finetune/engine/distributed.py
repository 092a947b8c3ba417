"""The processes of a run: torchrun's environment, sums over ranks, and the gradient average DDP cannot do."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime import resolve_device


def process_rank() -> int:
    """This process's rank under torchrun (RANK), 0 outside it: readable before the group is joined."""
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """Rank 0, which alone checks and writes the run folder and prints."""
    return process_rank() == 0


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed(device_choice: str) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: join the group (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(), resolve_device(device_choice)
    ddp = Dist(process_rank(), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_choice)
    if device.type == "cuda":
        device = torch.device("cuda", ddp.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ddp, device


def all_sum(values: list[float], ddp: Dist, device: torch.device) -> list[float]:
    """`values` summed over all ranks (themselves on one process)."""
    if not ddp.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def main_process_choice(value, ddp: Dist):
    """Rank 0's `value` on every rank: a choice each rank would make on its own (a timing) must be the same."""
    if not ddp.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def average_gradients(model: nn.Module, ddp: Dist) -> None:
    """Average the gradients over the ranks by hand: for a forward that runs outside DDP's wrapper (the head on
    cached features)."""
    if not ddp.enabled:
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= ddp.world


def leave(ddp: Dist) -> None:
    """The ranks leave together: a rank that exits while gloo's threads still run aborts."""
    if ddp.enabled:
        dist.barrier()
        dist.destroy_process_group()

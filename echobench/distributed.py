"""Process-group setup from the usual torchrun / SLURM environment, and small helpers."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no GPU: use --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    if requested == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {requested!r}: choose auto, cuda or cpu")


def init_distributed(device: str = "auto", timeout_s: float = 300.0) -> DistInfo:
    """Reads RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun); NCCL on GPUs, gloo on CPU.

    The collective timeout bounds how long a live rank waits for a dead one.
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
        )
    return DistInfo(rank, world, local_rank, dev)


def all_gather_object(obj, info: DistInfo) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

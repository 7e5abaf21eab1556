"""Process-group setup from the usual torchrun / SLURM environment, and small helpers."""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import sys
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


def dist_info(device: str = "auto") -> DistInfo:
    """This process's place in the job, from RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun);
    no process group yet."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return DistInfo(rank, world, local_rank, pick_device(device, local_rank))


def form_process_group(info: DistInfo, timeout_s: float = 300.0) -> None:
    """NCCL on GPUs, gloo on CPU. The collective timeout bounds how long a live rank waits for
    a dead one."""
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if info.enabled and not dist.is_initialized():
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=info.device if info.device.type == "cuda" else None,
        )


def all_gather_object(obj, info: DistInfo) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


_group_ended = False  # this process formed a process group, and shutdown() ended it


def shutdown(abort: bool = False) -> None:
    """Ends the process group. A rank that failed aborts it instead: its peers may sit in a
    collective it will never join, and a graceful destroy can wait on them (NCCL flushes pending
    work); an abort closes the connections, so the peers fail now, not at the collective timeout."""
    global _group_ended
    if not dist.is_initialized():
        return
    _group_ended = True
    if abort:
        try:  # a private API (torch 2.13 has it, for gloo and NCCL): destroy where it is missing
            from torch.distributed.distributed_c10d import _abort_process_group  # here: may be missing (except)

            _abort_process_group()
            return
        except (ImportError, RuntimeError, ValueError):
            pass
    dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Ends a process that had a process group without Python's interpreter teardown (output
    flushed first); returns in one that had none, and in a worker torchrun forked from a forkserver
    (launch.rank_preload), which must return: torchrun waits for the entry point's return value.

    A gloo worker thread may still be dropping the tensors of the last collective when Python
    finalises; it then needs the GIL, cannot have it, and aborts the process ("terminate called
    without an active exception", a known torch race: the group outlives destroy_process_group
    while DDP's reducer or FSDP's state still holds it). The record is written by then, but
    torchrun would report the run as failed.
    """
    if not _group_ended or multiprocessing.parent_process() is not None:
        return  # a forkserver's worker: multiprocessing ends it by os._exit after the return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

"""Training backends: each turns the plain model into something that trains on this process group.

A backend returns a TrainSetup; the benchmark loop (echobench.bench) owns timing and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class TrainSetup:
    model: torch.nn.Module  # model(batch, draws=..., reduction=...) -> scalar loss
    optimizer: torch.optim.Optimizer
    clip_grad: Callable[[], torch.Tensor]  # clips gradients in place, returns the total norm
    autocast_dtype: torch.dtype | None  # None: run in the parameters' dtype
    info: dict = field(default_factory=dict)  # what ran (kernels, sharding...), kept in the record
    # The process group whose replicas average their gradients (None: one replica). The loop sums
    # the loss's frame count over it, so that every layout minimises the global batch's mean.
    dp_group: Any = None


def build_training(cfg, dist_info, dtype: torch.dtype) -> TrainSetup:
    if cfg.framework == "torchtitan":
        from echobench.backends.torchtitan import build

        return build(cfg, dist_info, dtype)
    if cfg.framework == "megatron":
        from echobench.backends.megatron import build

        return build(cfg, dist_info, dtype)
    raise ValueError(f"unknown framework {cfg.framework!r}: choose torchtitan or megatron")


def parallelism_problem(cfg) -> str | None:
    """Why this run's layout cannot work (None when it can), without starting any process.

    Used by `echobench run` before launching and by the matrix expansion to list skipped runs.
    Each backend module has a `validate(cfg) -> str | None` that imports nothing heavy.
    """
    if cfg.framework == "torchtitan":
        from echobench.backends.torchtitan import validate
    elif cfg.framework == "megatron":
        from echobench.backends.megatron import validate
    else:
        return f"unknown framework {cfg.framework!r}: choose torchtitan or megatron"
    return validate(cfg)

"""Training backends: each turns the plain model into something that trains on this process group.

Each backend is one registered object (as torchtitan's ModelSpec carries a model's parallelize
function): its name, the layouts it runs, its check (checks.py: why a run cannot work, None when it
can; without torch, a process group or megatron-core, so that a plan or a sweep never imports
them) and its module, which holds `build(cfg, dist_info, dtype)` (the TrainSetup) and is imported
only when first used. The benchmark loop (echobench.train.bench) owns timing and metrics.

May import: model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from echobench.backends import checks

if TYPE_CHECKING:
    import torch


@dataclass
class TrainSetup:
    model: torch.nn.Module  # model(batch, draws=..., reduction=...) -> scalar loss; a card's model(tokens, reduction=...)
    optimizer: torch.optim.Optimizer
    clip_grad: Callable[[], torch.Tensor]  # clips gradients in place, returns the total norm
    autocast_dtype: torch.dtype | None  # None: run in the parameters' dtype
    info: dict = field(default_factory=dict)  # what ran (kernels, sharding...), kept in the record
    # The process group whose replicas average their gradients (None: one replica). The loop sums
    # the loss's frame count over it, so that every layout minimises the global batch's mean.
    dp_group: Any = None
    # Turns the gradient reduction of the next backward on or off (off before the last micro-batch
    # of a step, grad_accum > 1); None where gradients are not reduced across replicas in backward.
    gradient_sync: Callable[[bool], None] | None = None


@dataclass(frozen=True)
class Backend:
    name: str
    layouts: tuple[str, ...]  # the kinds of layout it runs (records.layout.KINDS; tpN: any width N >= 1)
    module: str  # holds build(cfg, dist_info, dtype) -> TrainSetup (imports torch)
    problem: Callable[[Any], str | None]  # why a run of a layout of its own cannot work (checks.py: no torch)
    float8: bool = False  # runs fp8: its module's float8_plan(cfg) says whether this run's can (with torch)

    def has_layout(self, layout) -> bool:
        """Whether it runs this layout (a records.layout.Layout, as a RunConfig's `layout`)."""
        return layout.kind in self.layouts

    def validate(self, cfg) -> str | None:
        """Why this run cannot work on this backend (None when it can), its layout being one of its own."""
        if problem := self.problem(cfg):
            return problem
        if cfg.precision == "fp8" and self.float8 and cfg.card is None:  # builds Echo on the meta device: a second, with torch
            return importlib.import_module(self.module).float8_plan(cfg).problem
        return None

    def build(self, cfg, dist_info, dtype: torch.dtype, workload=None) -> TrainSetup:
        module = importlib.import_module(self.module)
        return module.build(cfg, dist_info, dtype, workload)


BACKENDS = {b.name: b for b in (
    Backend("torchtitan", ("single", "ddp", "fsdp2", "hsdp"), "echobench.backends.torchtitan", checks.torchtitan_problem,
            float8=True),
    Backend("megatron", ("tpN",), "echobench.backends.megatron", checks.megatron_problem),
)}


def build_training(cfg, dist_info, dtype: torch.dtype, workload=None) -> TrainSetup:
    """The backend's setup of Echo, or of a card run's decoder (workload: a model.config.CardWorkload)."""
    if problem := parallelism_problem(cfg) or (workload is not None and checks.card_problem(cfg, workload)):
        raise ValueError(problem)
    return BACKENDS[cfg.framework].build(cfg, dist_info, dtype, workload)


def parallelism_problem(cfg) -> str | None:
    """Why this run's layout cannot work (None when it can), without starting any process: a layout
    the backend lacks, then the backend's own check. `echobench run` asks it before launching, the
    matrix expansion to list skipped runs."""
    backend = BACKENDS[cfg.framework]
    if not backend.has_layout(cfg.layout):
        return f"{backend.name} has no parallelism {cfg.parallelism} (it has {', '.join(backend.layouts)})"
    try:
        return backend.validate(cfg)
    except ImportError as exc:  # e.g. fp8's check builds the model, which needs transformers
        return f"the {backend.name} backend is not available here ({exc})"


def layout_problem(cfg, executor: str) -> str | None:
    """Why a run cannot be run here: the executor's reasons, then the backend's (parallelism_problem)."""
    if executor == "local" and cfg.nodes > 1:
        return f"the local executor runs on this one machine: nodes={cfg.nodes} needs --executor slurm"
    return parallelism_problem(cfg)

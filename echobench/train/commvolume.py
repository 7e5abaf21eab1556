"""The bytes each collective of a training step moves: counted in a real step, and derived from
the settings (what a performance model uses).

Counting: count_collectives() is a torch dispatch mode that sees every c10d collective
(torch.ops.c10d.*: what torch.distributed's functions, DDP's C++ reducer and FSDP2 issue) and
every functional collective (torch.ops._c10d_functional.*: DTensor's redistributions, e.g. the
sharded gradient norm), with its message size and group size. torch's own CommDebugMode
(torch.distributed.tensor.debug) sees the same ops but counts calls only, no bytes, so this
records them itself. count_step() runs real steps of a layout (the backends' build and
bench.train_step) and counts the last one; step_collectives() does it on N local gloo processes.

Deriving is hardware/traffic.py's (step_bytes: a step's collectives from the settings, without
torch's process groups or the loop, so that predict imports it); tests/test_comm.py holds it
against the steps counted here.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from echobench.backends import build_training
from echobench.train.bench import resolve_dtype, train_step
from echobench.records.config import RunConfig
from echobench.data import build_tokenizer, make_loader
from echobench.train.distributed import dist_info, exit_process, shutdown
from echobench.hardware.traffic import OpTotal
from echobench.model.echo import diffusion_draws

# c10d op (torch.ops.c10d.NAME) -> (collective, which argument holds the message: nccl-tests' size)
_C10D = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_coalesced_": ("all_gather", "output_lists"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "broadcast_": ("broadcast", "tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
}
# functional collectives: the message is the input (times the group for an all-gather's output)
_FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}


@dataclass(frozen=True)
class CollectiveCall:
    op: str  # all_reduce, all_gather, reduce_scatter (or broadcast, all_to_all, ...)
    nbytes: int  # nccl-tests' message size
    group_size: int
    dtype: str


@dataclass
class CollectiveLog:
    """The collectives one rank issued, in order."""

    calls: list[CollectiveCall] = field(default_factory=list)

    def by_op(self) -> dict[str, OpTotal]:
        """Per collective: calls and bytes (nccl-tests' sizes, summed)."""
        out: dict[str, OpTotal] = {}
        for c in self.calls:
            t = out.get(c.op, OpTotal(0, 0))
            out[c.op] = OpTotal(t.calls + 1, t.bytes + c.nbytes)
        return out

    def to_json(self) -> list[dict]:
        return [asdict(c) for c in self.calls]

    @classmethod
    def from_json(cls, rows: list[dict]) -> CollectiveLog:
        return cls([CollectiveCall(**r) for r in rows])


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _group_size(value) -> int | None:
    if isinstance(value, str):  # a functional collective's group name
        return _resolve_process_group(value).size()
    try:
        return dist.ProcessGroup.unbox(value).size()
    except (RuntimeError, TypeError):
        return None


def _record(func, args, kwargs) -> CollectiveCall | None:
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace not in ("c10d", "_c10d_functional") or name == "wait_tensor" or name.startswith("_wrap"):
        return None
    bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | dict(kwargs)
    if namespace == "c10d":
        if name not in _C10D:
            return None
        op, arg = _C10D[name]
        tensors = _tensors(bound.get(arg))
        size = _group_size(bound.get("process_group"))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
    else:
        if name not in _FUNCTIONAL:
            return None
        op = _FUNCTIONAL[name]
        tensors = _tensors(bound.get("input", bound.get("inputs", bound.get("tensor"))))
        size = bound.get("group_size") or _group_size(bound.get("group_name"))
        nbytes = sum(t.numel() * t.element_size() for t in tensors) * (size if op == "all_gather" else 1)
    dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else "?"
    return CollectiveCall(op, int(nbytes), int(size or 0), dtype)


@contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Records every collective issued while the block runs, on this thread and on the autograd
    engine's (the mode is part of the thread-local state autograd carries): yields the log, filled
    as they happen. Checked on gloo (CPU) for DDP's reducer, FSDP2, megatron-core's TP layers and
    DTensor's functional collectives (tests/test_comm.py)."""
    log = CollectiveLog()

    from torch.distributed.tensor import DTensor  # lazy: DTensor takes a second or more to import

    class _Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **(kwargs or {}))
            # A mode runs before tensor subclasses: handing a DTensor op back lets DTensor turn it
            # into its collectives first (its redistributions), which then come here (as
            # torch's CommDebugMode does); otherwise they would run with this mode switched off.
            if any(t is DTensor for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            call = _record(func, args, kwargs)
            if call is not None:
                log.calls.append(call)
            return func(*args, **kwargs)

    with _Counting():
        yield log


# ---- counting a real step ----

def count_step(cfg, info, warmup_steps: int = 2) -> CollectiveLog:
    """This rank's collectives in one real training step of `cfg` on the formed process group: the
    backend's setup (backends.build_training), `warmup_steps` steps first (DDP broadcasts the
    weights in its first forward and rebuilds its buckets in its second: neither is a step's
    traffic), then one step under count_collectives(). The data and draws are those of a run
    (bench.run_loop's loader and diffusion_draws)."""
    dtype = resolve_dtype(cfg.precision, info.device)
    setup = build_training(cfg, info, dtype)
    model_cfg = cfg.model_config()
    dp_rank, dp_size = info.rank // cfg.tp, max(1, info.world_size // cfg.tp)
    loader = make_loader(cfg.data, micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, cfg.tokenizer),
                         rank=dp_rank, world_size=dp_size, seed=cfg.seed, skip_bad_samples=cfg.skip_bad_samples)
    generator = torch.Generator(device=info.device)
    setup.model.train()
    try:
        for step in range(warmup_steps + 1):
            batch = next(loader)
            ids = batch.index.tolist()
            batch = batch.to(info.device)
            draws = diffusion_draws(cfg.seed, ids, cfg.audio_frames, model_cfg.latent_dim, model_cfg.cfg_dropout,
                                    info.device, generator)
            if step < warmup_steps:
                train_step(setup, [(batch, draws)], info.device.type, dp_size)
                continue
            with count_collectives() as log:
                train_step(setup, [(batch, draws)], info.device.type, dp_size)
    finally:
        loader.close()
    return log


def _step_worker(rank: int, world: int, store: str, settings: list[dict], out_dir: str, warmup_steps: int) -> None:
    """One rank of step_collectives: a gloo group through a file store (no port to race for)."""
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    info = dist_info("cpu")
    logs = [count_step(RunConfig(**s), info, warmup_steps).to_json() for s in settings]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(logs))
    dist.barrier()
    shutdown()
    exit_process(0)  # not Python's teardown: gloo's threads may still hold DDP's group (distributed.exit_process)


def step_collectives(cfgs: Sequence, warmup_steps: int = 2) -> list[list[CollectiveLog]]:
    """Counts one real step of each of `cfgs` (RunConfigs of one world size, device cpu) on that
    many local gloo processes, one after another in the same processes. Returns, per config, every
    rank's log (rank order)."""
    worlds = {c.world_size for c in cfgs}
    if len(worlds) != 1:
        raise ValueError(f"step_collectives: the configs have world sizes {sorted(worlds)}; give one")
    world = worlds.pop()
    settings = [c.to_dict() for c in cfgs]
    with tempfile.TemporaryDirectory(prefix="echobench-steps-") as tmp:
        mp.spawn(_step_worker, args=(world, f"{tmp}/store", settings, tmp, warmup_steps), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return [[CollectiveLog.from_json(ranks[r][i]) for r in range(world)] for i in range(len(cfgs))]


# ---- deriving a step's collectives from the settings ----

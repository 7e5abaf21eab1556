"""`echobench calibrate --comm`: the whole calibration of a hardware profile (echobench.hardware.profile)
on this process group, from echobench.calibrate.commbench's measurements. Which runs' shapes it measures
(comm_runs: every run of a matrix, a card run at its card's own shapes, else one Echo run of a scale
and lengths), how its process group comes about (started by torchrun: `torchrun ... -m echobench
calibrate --comm`; else `echobench calibrate --comm --nproc N` launches torchrun as `echobench run
--nproc` does), the profile it assembles (calibrate_comm) and where rank 0 writes it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from echobench.calibrate import commbench
from echobench.hardware.commfit import fit_links
from echobench.records.config import FIELDS, RunConfig
from echobench.records.layout import Layout
from echobench.records.results import now_iso
from echobench.train.distributed import DistInfo, dist_info, form_process_group, pick_device, shutdown
from echobench.hardware.device import default_dtype, device_name, git_commit
from echobench.hardware.profile import (
    AlphaBeta,
    CommPoint,
    HardwareProfile,
    ProfileError,
    StepJitter,
    calibrated_profile_path,
    load_profile,
    save_profile,
)
from echobench.train.launch import child_env, rank_preload, torchrun_command, under_torchrun
from echobench.sweep.matrix import expand, load_matrix

DEFAULT_MAX_BYTES = {"cuda": 2**30, "cpu": 64 * 2**20}
DEFAULT_COMM_BUDGET_S = {"cuda": 120.0, "cpu": 20.0}
CACHE_BYTES = 2**20  # a CPU's element-wise tensors of a tiny run (0.2 .. 1 MB for tiny at micro-batch 4): in L2
MEMORY_BYTES = {"cuda": 2**30, "cpu": 64 * 2**20}  # per tensor: far beyond the caches


class CalibrateError(Exception):
    """calibrate --comm cannot go on: no shapes to measure, this node's torchrun exited non-zero (`code`:
    its exit code; its output said why), or no profile where rank 0 wrote it."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def comm_runs(device_type: str, scale: str | None, matrix: Path | None, settings: dict,
              site: Path | None = None) -> tuple[list, list[str]]:
    """calibrate --comm's runs, whose shapes it measures, and the worker flags that give them again:
    every run of `matrix` (expanded as `echobench plan` does), else the one of `scale` and the lengths
    (`settings`: RunConfig fields, None for the field's default). ValueError (MatrixError too) for
    a matrix or settings that give none."""
    if matrix is not None:
        loaded = load_matrix(matrix, site)  # `site`: --site, over the matrix's own site: key
        runs = expand(loaded, loaded.spec.executor, None).runs
        if not runs:
            raise ValueError(f"--matrix {matrix}: no runs to take shapes from (see `echobench plan {matrix}`)")
        return [r.cfg for r in runs], ["--matrix", str(matrix.resolve()), *(["--site", str(site.resolve())] if site else [])]
    run = RunConfig(scale=scale or ("3B" if device_type == "cuda" else "tiny"), device=device_type,
                    **{k: FIELDS[k].default if v is None else v for k, v in settings.items()})
    return [run], ["--scale", run.scale, "--micro-batch", str(run.micro_batch), "--audio-frames", str(run.audio_frames),
                   "--text-tokens", str(run.text_tokens), "--speaker-frames", str(run.speaker_frames)]


def calibrate_command(dev: torch.device, dtype_flag: str, dtype: torch.dtype | None, shapes: tuple,
                      budget_s: float | None, nproc: int | None, out: Path | None, max_bytes: int | None,
                      comm_budget_s: float | None,
                      rendezvous: tuple[int, int, str | None, int]) -> tuple[HardwareProfile | None, list]:
    """`calibrate --comm`: in a torchrun worker (or alone with one process on one node) measure here;
    else launch torchrun for this node (launch_node: `nproc` processes, one of --nnodes) running this
    command, then, on node 0, check what rank 0 wrote (it showed it). `shapes`: comm_runs' arguments
    after the device. (the profile to show, or None where another process shows it; every path it
    was saved to). CalibrateError for shapes or a profile not to be had, or when torchrun failed."""
    try:
        runs, shape_args = comm_runs(dev.type, *shapes)
    except ValueError as exc:
        raise CalibrateError(str(exc)) from exc
    gpu = dev.type == "cuda"
    path = calibrated_profile_path(device_name(dev), str(dtype or default_dtype(dev)).removeprefix("torch."))
    paths = list(dict.fromkeys([path, *([out] if out is not None else [])]))
    gemm_budget_s = budget_s if budget_s is not None else (15.0 if gpu else 5.0)
    nproc = nproc or (max(1, torch.cuda.device_count()) if gpu else 2)
    nnodes, node_rank, master_addr, _ = rendezvous
    if not under_torchrun() and (nproc > 1 or nnodes > 1 or master_addr is not None):
        args = ["--device", dev.type, "--dtype", dtype_flag, *shape_args, "--budget-s", gemm_budget_s,
                "--out", out or path, *(["--max-bytes", max_bytes] if max_bytes else []),
                *(["--comm-budget-s", comm_budget_s] if comm_budget_s else [])]
        code = launch_node(list(map(str, args)), nproc, *rendezvous,
                           preload=rank_preload(dev.type, ["echobench.calibrate.commcalibrate"]))
        where = f"{nproc} processes" + (f" of node {node_rank} of {nnodes}" if nnodes > 1 else "")
        if code:
            raise CalibrateError(f"calibrate --comm on {where}: torchrun exited with code {code} (its output is "
                                 "above)", code)
        if node_rank == 0:  # node 0's rank 0 wrote the profile to every path and showed it
            try:
                load_profile(out or path)
            except ProfileError as exc:
                raise CalibrateError(str(exc)) from exc
        return None, paths
    profile = calibrate_in_group(dev.type, runs, paths, dtype=dtype, max_bytes=max_bytes,
                                 comm_budget_s=comm_budget_s, gemm_budget_s=gemm_budget_s)
    return profile, paths


def shapes_note(runs) -> str:
    """The runs' shapes in a few words: `tiny at micro-batch 2, 100 audio frames, ...`, one per shape;
    a card run's `card NAME at micro-batch 4, seq 256` (and its TP where it has one)."""
    def words(r) -> str:
        if hit := commbench.card_of(r):
            return f"card {r.workload} at micro-batch {r.micro_batch}, seq {hit[1].seq}" + \
                (f", tp {r.tp}" if r.tp > 1 else "")
        return (f"{r.scale} at micro-batch {r.micro_batch}, {r.audio_frames} audio frames, {r.text_tokens} text tokens, "
                f"{r.speaker_frames} speaker frames")

    return "; ".join(dict.fromkeys(words(r) for r in commbench.as_runs(runs)))


def calibrate_comm(device: torch.device, runs, *, dtype: torch.dtype | None = None, max_bytes: int | None = None,
                   comm_budget_s: float | None = None, gemm_budget_s: float = 5.0,
                   compute_budget_s: float = 4.0) -> HardwareProfile | None:
    """The hardware profile of this process group (or of this one process when there is none):
    collectives over plan_groups (needs >= 2 ranks), GEMMs, attention, memory bandwidth and the
    optimizer at the shapes of `runs` (a RunConfig or several: scale, layout, micro-batch, lengths, or a card;
    the profile then prices each of them at its own shapes). Call on every rank; rank 0 returns the
    profile (not saved), the others None. Defaults: max_bytes 1 GiB on GPU, 64 MiB on CPU, bounded
    by free memory (a third of it: an all-gather holds about 2x its message); comm_budget_s 120 s
    on GPU, 20 s on CPU."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    dtype = dtype or default_dtype(device)
    grouped = dist.is_initialized() and dist.get_world_size() > 1
    world = dist.get_world_size() if grouped else 1
    rank = dist.get_rank() if grouped else 0
    started = time.perf_counter()
    links: dict[str, dict[str, AlphaBeta]] = {}
    link_kinds: dict[str, dict[str, list[AlphaBeta]]] = {}
    hosts = [socket.gethostname()]
    backend = dist.get_backend() if dist.is_initialized() else None
    # The optimizer first, in the allocator's state of a fresh process, as training meets it: on a CPU
    # the step's fresh temporaries fault their pages in; once the process has freed large blocks
    # (the collectives' and element-wise buffers) glibc serves them from its heap and the step runs
    # several times faster than any training step does.
    optimizer = commbench.measure_adamw(device, commbench.adamw_shapes(runs, device), compute_budget_s * 0.2)
    if grouped:
        node_of = commbench.node_indices(world)
        hosts = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        limit = min(max_bytes or DEFAULT_MAX_BYTES[kind], commbench.free_bytes(device) // 3)
        limit = int(commbench.agree(limit, device, dist.ReduceOp.MIN))
        plans = commbench.plan_groups(node_of)
        points = commbench.measure_collectives(plans, device, limit, comm_budget_s or DEFAULT_COMM_BUDGET_S[kind])
        gathered = [None] * world
        dist.all_gather_object(gathered, points)
        if rank == 0:
            merged: dict[tuple[str, str, int], list[CommPoint]] = {}
            for r, mine in enumerate(gathered):  # a group's points from its lowest rank (all members agree)
                for key, pts in mine.items():
                    for p in pts:
                        if not any(q.group_size == p.group_size and q.nbytes == p.nbytes for q in merged.get(key, [])):
                            merged.setdefault(key, []).append(p)
            links, link_kinds = fit_links(merged, f"measured: echobench calibrate --comm ({backend}",
                                          nccl=backend == "nccl")
        node_count = len(set(node_of))
    else:
        node_count = 1
    runs = commbench.as_runs(runs)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # CPU: the host steps' own shapes too, which predict prices to take the host's share of them
    priced = runs + ([RunConfig(**commbench.HOST_RUN), RunConfig(**commbench.REFERENCE_RUN)] if kind == "cpu" else [])
    gemm = commbench.measure_gemms(device, dtype, priced, gemm_budget_s, local)
    attn = commbench.measure_attention(device, dtype, priced, compute_budget_s * 0.6)
    memory = commbench.measure_memory(device, min(MEMORY_BYTES[kind], commbench.free_bytes(device) // 8),
                                      compute_budget_s * 0.2)
    if kind == "cpu":  # a small run's element-wise tensors stay in the core's cache: its bandwidth there too
        memory += commbench.measure_memory(device, CACHE_BYTES, compute_budget_s * 0.1)
    memory.append(optimizer)
    own_steps: dict[str, list[float]] = {}
    host = commbench.measure_host(DistInfo(rank, world, int(os.environ.get("LOCAL_RANK", 0)), device), dtype,
                        compute_budget_s, local, own_steps)
    # each rank's own steps, none waiting on another: its jitter
    singles = [next((v for k, v in own_steps.items() if Layout.parse(k).single), [])]
    if grouped:
        everyone = [None] * world
        dist.all_gather_object(everyone, (gemm, attn, memory, host, singles[0]))
        gemm, attn, memory = (commbench.slowest([e[i] for e in everyone], key)
                              for i, key in ((0, "tflops"), (1, "tflops"), (2, "gbps")))
        host = [max(points, key=lambda p: p.step_s) for points in zip(*(e[3] for e in everyone))]  # slowest rank
        singles = [e[4] for e in everyone]
    cv = commbench.step_jitter(singles)
    jitter = None if cv is None else StepJitter(
        cv=min(cv, 0.2), source=f"measured: echobench calibrate --comm, the root mean square of each rank's tiny single "
                                f"steps (commbench.measure_host) over its own median, less 1, pooled over {len(singles)} "
                                "rank(s) stepping at once: the host's and device's step-to-step spread at that size")
    if rank != 0:
        return None
    timing = "CUDA events per call" if kind == "cuda" else "host clock per call"
    ranks = f"slowest of {world} ranks measuring at once" if world > 1 else "one process"
    gemm = [p.model_copy(update={"source": f"measured: torch.mm {str(dtype).removeprefix('torch.')}, median of "
                                           f"{p.iters} ({timing}), {ranks}"}) for p in gemm]
    attn = [p.model_copy(update={"source": f"measured: SDPA forward + backward ({p.source}), median of {p.iters} "
                                           f"({timing}), {ranks}"}) for p in attn]
    memory = [p.model_copy(update={"source": (f"measured: float32 {p.op}" if p.op != "adamw" else
                                              f"measured: AdamW steps (torchtitan.build_optimizer) over "
                                              f"{p.nbytes // 4 / 1e6:.4g}M float32 parameters of the model's shapes, "
                                              "fresh gradients each step, predict.ADAMW_BYTES per parameter")
                                             + f", median of {p.iters} ({timing}), {ranks}"}) for p in memory]
    host = [p.model_copy(update={"source": f"measured: commbench.measure_host, {p.framework} {p.parallelism} "
                                           f"training steps (bench.train_step) of {p.scale} at micro-batch "
                                           f"{p.micro_batch} on {p.processes} process(es), median of {p.iters} (host "
                                           f"clock around device syncs), {p.ops} ATen ops counted in one more step, "
                                           f"the slowest rank's"}) for p in host]
    name = device_name(device)
    nccl = None
    if kind == "cuda":
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = None
    return HardwareProfile(
        name=f"calibrated {name} {str(dtype).removeprefix('torch.')}",
        device=name, dtype=str(dtype).removeprefix("torch."), measured=True, backend=backend,
        note=(f"measured by `echobench calibrate --comm` on {world} process(es), {node_count} node(s) "
              f"({', '.join(dict.fromkeys(hosts))}), shapes of {shapes_note(runs)}; "
              f"{time.perf_counter() - started:.1f} s"),
        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world if node_count == 1 else 0)) or None,
        gemm=gemm, attention=attn, memory=memory, host_steps=host, jitter=jitter, links=links, link_kinds=link_kinds,
        link_notes={"intra": "ranks on one node", "inter": "ranks on different nodes"} if links else {},
        versions={"torch": torch.__version__, "echobench": git_commit(), "cuda": torch.version.cuda, "nccl": nccl},
        date=now_iso(), host=socket.gethostname())


def calibrate_in_group(device: str, runs, paths: Sequence, **options) -> HardwareProfile | None:
    """calibrate_comm where this process runs: in a torchrun worker (launch.under_torchrun) on the
    process group it forms (distributed.form_process_group: NCCL on GPUs, gloo on CPU), else on this
    process alone, whatever RANK / WORLD_SIZE a container's hooks set. Rank 0 saves the profile to
    every path of `paths` and returns it; other ranks None. `options`: calibrate_comm's keywords."""
    info = dist_info(device) if under_torchrun() else DistInfo(device=pick_device(device))
    form_process_group(info, timeout_s=900.0)  # a rank waits while the others time their sub-groups
    try:
        profile = calibrate_comm(info.device, runs, **options)
        for path in paths if profile is not None else ():
            save_profile(profile, path)
    except BaseException:
        shutdown(abort=True)  # the peers may sit in a collective this rank will never join
        raise
    shutdown()
    return profile


def launch_node(args: list[str], nproc: int, nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                master_port: int = 29500, preload: Sequence[str] = ()) -> int:
    """torchrun for this node (launch.torchrun_command: standalone on one node, else the rendezvous
    of node_rank of nnodes, as `echobench run` launches a node) running `echobench calibrate --comm
    ARGS` on nproc processes with the environment `run --nproc` gives its workers
    (launch.child_env), forked from `preload` where it names modules (launch.rank_preload); torchrun's
    exit code."""
    with tempfile.TemporaryDirectory(prefix="echobench-calibrate-") as tmp:
        cmd = torchrun_command(["--comm", *args], nproc, nnodes, node_rank, master_addr, master_port,
                               Path(tmp) / f"node-{node_rank}.json", command="calibrate", preload=preload)
        return subprocess.call(cmd, env=child_env(nproc))

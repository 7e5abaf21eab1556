"""The measured training loop: the one place that owns timing and FLOPs (echobench.train.bench_record turns
the ranks' figures into the result record). It trains a Workload (train.workload): Echo (bench_echo) or
a model card's plain decoder (bench_card), through one loop, one train_step and one run_benchmark.

Timing (docs/explanation/mfu.md): warm-up (every micro-batch shape the window can meet, then the
warm-up steps: compile happens there) is excluded, and a measured window in which torch compiled
anything is measured again; on GPU each step is timed by CUDA events on the compute stream (no host
sync inside the loop), on CPU by the host clock; each step counts at its slowest rank. The data wait is on the same clock: on GPU the
time the GPU sat idle while the host waited for the loader, on CPU the host's wait. Model FLOPs
are counted by the workload on every measured sample (bench_echo.count_measured, bench_card.card_counts).
"""

from __future__ import annotations

import gc
import os
import resource
import signal
import statistics
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from echobench.hardware.device import default_dtype, resolve_peak
from echobench.model.config import CardWorkload
from echobench.records.atomic import write_json_atomic
from echobench.records.config import RunConfig
from echobench.records.results import Record
from echobench.records.states import RunState
from echobench.train.bench_card import DecoderWorkload
from echobench.train.bench_echo import ECHO_LOSS, EchoWorkload
from echobench.train.bench_profile import (PROFILED_STEPS, PROFILER_WARMUP, discard_profiler, make_profiler, profiled_steps,
                                           profiling_stopped, trace_path)
from echobench.train.bench_record import start_record, summarize
from echobench.train.breakdown import DATA_WAIT, write_breakdown
from echobench.train.distributed import DistInfo, all_gather_object, dist_info, form_process_group, shutdown
from echobench.train.kernels import CompileWatch, compile_counts, pin_sdpa_backend
from echobench.train.metrics_log import finish as finish_metrics, open_metrics_log, result_figures
from echobench.train.progress import Progress
from echobench.train.workload import StepLoss, Workload

GIB = 1024**3


class InjectedFailure(RuntimeError):
    pass


STARTUP_STEP = -1  # fail_at_step -1: fail at start-up, before the process group forms


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "auto":
        return default_dtype(device)
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16}[precision]


def maybe_inject_failure(cfg: RunConfig, step: int, rank: int) -> None:
    if cfg.fail_at_step is None or step != cfg.fail_at_step:
        return
    if cfg.fail_rank is not None and cfg.fail_rank != rank:
        return
    where = "start-up" if step == STARTUP_STEP else f"step {step}"
    if cfg.fail_kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory at {where} on rank {rank}")
    if cfg.fail_kind == "sigkill":  # as the kernel's OOM killer or a user's kill -9: no handler runs
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.fail_kind == "hang":  # as a rank stuck in a collective: idle, in its loop, until killed
        while True:
            time.sleep(3600)
    raise InjectedFailure(f"injected failure at {where} on rank {rank}")


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        # Allocator retries (cudaMalloc failed, caches flushed, tried again) slow the steps they
        # hit; counted over the whole run, warm-up included.
        stats = torch.cuda.memory_stats(device)
        return {
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "device_total_gib": torch.cuda.get_device_properties(device).total_memory / GIB,
            "num_alloc_retries": stats.get("num_alloc_retries", 0),
            "num_ooms": stats.get("num_ooms", 0),
        }
    # ru_maxrss is in KiB on Linux: the process's peak resident set.
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}


def resident_gib() -> float:
    """This process's resident set now (Linux's /proc/self/statm), else its peak so far (ru_maxrss)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return pages * os.sysconf("SC_PAGE_SIZE") / GIB


def live_tensor_gib() -> float:
    """The bytes of the CPU tensors Python objects hold now, each storage once (tensors held by C++
    alone, DDP's gradient buckets, are not seen)."""
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance on a dead weakref.proxy raises ReferenceError
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):
                # a wrapper subclass (DTensor: its local tensor is seen) or a storage FSDP2 freed
                continue
    return sum(storages.values()) / GIB


def baseline_gib(device: torch.device) -> float | None:
    """On a CPU, the resident set besides the tensors once the model is built: the interpreter, torch and
    the libraries the build imported, their threads and allocators; the memory estimate's overhead there,
    which no plan can count. None on a GPU (the estimate's CUDA context stands)."""
    if device.type != "cpu":
        return None
    return resident_gib() - live_tensor_gib()


class StepTimer:
    """Step boundaries and data waits on ONE clock: CUDA events on the compute stream on GPU (no
    host sync per step), the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.clock = "cuda_events" if self.cuda else "host"
        self.marks: list = []
        self.waits: list = []  # (stamp before, stamp after) taking a measured step's batch

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def mark(self) -> None:
        self.marks.append(self.stamp())

    def durations(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
        return [self.elapsed(a, b) for a, b in zip(self.marks, self.marks[1:])]

    def wait_durations(self) -> list[float]:
        """On GPU: how long the GPU sat idle while the host waited for the batch (nothing was queued
        between the two events; zero when the GPU was still busy); on CPU: the host's wait."""
        if self.cuda:
            torch.cuda.synchronize()
        return [self.elapsed(a, b) for a, b in self.waits]


def train_step(setup, micro_batches: list, device_type: str, dp_size: int,
               objective: StepLoss = ECHO_LOSS) -> torch.Tensor:
    """One optimizer step over its micro-batches (grad_accum of them; Echo's: (batch, draws) pairs):
    each forward under autocast and backward, the gradients reduced across replicas in the last
    backward only; then clip and update. Returns the step's loss, on the device."""
    normaliser = objective.normaliser(micro_batches, setup.dp_group)
    total = None
    for k, micro_batch in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        if setup.gradient_sync is not None and len(micro_batches) > 1:
            setup.gradient_sync(last)
        with torch.autocast(device_type, dtype=setup.autocast_dtype or torch.float32,
                            enabled=setup.autocast_dtype is not None):
            err = objective.loss_sum(setup.model, micro_batch)
        if k == 0:
            normaliser.wait()  # the count's all-reduce overlapped the first forward
        # Every micro-batch over the step's count: the accumulated gradient is the whole step's mean;
        # the replicas average their gradients: x dp_size makes that the global batch's mean.
        loss = err / normaliser.value() * dp_size
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    setup.clip_grad()
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return total


# A measured window in which torch compiled something (on any rank) is measured again, up to this many
# windows in all; the last one's figures are the record's, and a compile in it makes the run an error.
MAX_WINDOWS = 3


@dataclass
class Window:
    """One measured window: its step boundaries and data waits (StepTimer); per measured micro-batch
    what the workload noted of it (Workload.prepare: Echo's real lengths, padded shape and attention
    paths); per step the compiles seen so far in the window (CompileWatch)."""

    timer: StepTimer
    compiles_at_start: int
    notes: list = field(default_factory=list)
    compiles: list = field(default_factory=list)

    def take(self, before, note) -> None:
        """A measured micro-batch, taken from the data since `before` (a timer stamp)."""
        self.timer.waits.append((before, self.timer.stamp()))
        self.notes.append(note)

    def step_done(self, compiles_total: int) -> None:
        self.timer.mark()
        self.compiles.append(compiles_total - self.compiles_at_start)

    def compile_steps(self) -> dict[int, int]:
        """{step of the window: compiles in it} for the steps in which torch compiled."""
        before = [0, *self.compiles]
        return {i: n - before[i] for i, n in enumerate(self.compiles) if n > before[i]}


def measure_windows(cfg: RunConfig, info: DistInfo, run_step, current_step, watch: CompileWatch,
                    progress: Progress) -> tuple[Window, list[dict]]:
    """The measured window: `steps` calls of run_step(window), measured again (at most MAX_WINDOWS in
    all) where torch compiled anything in it on any rank (the ranks compare after the window, outside
    it). Returns the last window and the restarts (window, its first step, the compiles per rank);
    current_step() is the loop's step count."""
    restarts = []
    for attempt in range(MAX_WINDOWS):
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)
        window = Window(StepTimer(info.device), watch.total)
        window.timer.mark()  # start of the first measured step
        progress.start(current_step())
        for _ in range(cfg.steps):
            run_step(window)
        # After the window (its host sync is outside it): did any rank compile in it?
        compiled = all_gather_object(window.compile_steps(), info)
        if not any(compiled):
            break
        restarts.append({"window": attempt + 1, "first_step": current_step() - cfg.steps,
                         "compiles": [{"rank": rank, "step": i, "count": n} for rank, steps in enumerate(compiled)
                                      for i, n in steps.items()]})
        if attempt + 1 < MAX_WINDOWS:
            run_step()  # the gather drained the device's queue: one step refills it before the next window
    return window, restarts


def run_loop(cfg: RunConfig, info: DistInfo, out_dir: Path, work: Workload, peak_tflops: float | None = None,
             metrics=None) -> dict:
    """Builds the workload's training setup, warms every micro-batch shape the window can meet
    (Workload.warm_up), runs the warm-up steps, then the measured window: `steps` steps, measured
    again (at most MAX_WINDOWS in all) where torch compiled anything in it on any rank (CompileWatch,
    read on the host after each step; the ranks compare after the window, outside it). Returns this
    rank's figures. `metrics`: rank 0's metrics_log logger (log_metrics), fed by the progress lines.

    The run's time limit (run_benchmark) ends with the last measured window; --trace's steps,
    trace export and breakdown after it have their own bound (trace_limit_s), which stops
    profiling, never the run: the measured figures stand and the breakdown says why it is missing.
    """
    dtype = resolve_dtype(cfg.precision, info.device)
    pin_sdpa_backend(cfg.sdpa_backend)
    watch = CompileWatch().start()  # before the backend compiles anything
    # Rank 0's progress lines (progress_every_s): a step's model FLOPs, shared by the ranks.
    flops_per_sample = work.flops_report(cfg.ac)["model_flops_per_sample"]
    progress = Progress(cfg.progress_every_s, cfg.warmup_steps + cfg.steps, cfg.global_batch,
                        flops_per_sample * cfg.global_batch / max(1, info.world_size), peak_tflops, info.device,
                        enabled=info.is_main, metrics=metrics)
    progress.phase(f"building {work.title()} {cfg.framework} {cfg.parallelism} on {info.world_size} rank(s), "
                   f"{info.device.type}")
    setup = work.build(info, dtype)
    baseline = baseline_gib(info.device)  # after the build's imports, before the steps' tensors
    # Data-parallel rank: tensor-parallel peers read the same batch.
    dp_rank, dp_size = info.rank // cfg.tp, max(1, info.world_size // cfg.tp)
    setup.model.train()
    device_type = info.device.type
    losses, profiled = [], {}
    step = 0
    profiler = None

    def run_step(window: Window | None = None, traced: bool = False) -> None:
        nonlocal step
        if cfg.gc_every and step and step % cfg.gc_every == 0:
            gc.collect(1)
        micro_batches = []
        for _ in range(cfg.grad_accum):
            before = window.timer.stamp() if window else None
            # The breakdown's data wait: only in the profiled steps, so that the timed steps stay bare.
            with torch.profiler.record_function(DATA_WAIT) if traced else nullcontext():
                batch = work.next_batch()
            item = work.prepare(batch)
            if window is not None:
                window.take(before, work.note(item))
            micro_batches.append(work.to_device(item))
        maybe_inject_failure(cfg, step, info.rank)
        loss = train_step(setup, micro_batches, device_type, dp_size, work.loss)
        if not traced:  # the record's losses: warm-up and measured steps, not the profiled ones
            losses.append(loss.detach())
        step += 1
        if window is not None:
            window.step_done(watch.total)
        if not traced:  # reading the loss inside the window would sync a GPU: there, only on the CPU
            progress.step(step, "measured" if window else "warm-up",
                          loss if window is None or device_type == "cpu" else None)

    if cfg.gc_every:  # collect at fixed steps only (torchtitan's way): no pause at a random step
        gc.disable()
        gc.collect()
    try:
        work.open(setup, dp_rank, dp_size)
        progress.phase(f"warm-up: {work.warmup_label()}, then {cfg.warmup_steps} step(s)"
                       + (" (compiling)" if str(setup.info.get("compiled", "")).startswith("torch.compile") else ""))
        progress.start()
        work.warm_up(setup)
        for _ in range(cfg.warmup_steps):
            run_step()
        progress.phase(f"measuring {cfg.steps} step(s)")
        window, restarts = measure_windows(cfg, info, run_step, lambda: step, watch, progress)
        stop_time_limit()
        # the measured steps' memory, before any profiled steps add the profiler's
        memory = memory_stats(info.device) | ({} if baseline is None else {"baseline_rss_gib": baseline})
        kernels = work.profile_kernels(setup) if device_type == "cuda" else None
        if cfg.trace:
            progress.phase(f"profiling {PROFILER_WARMUP + PROFILED_STEPS} step(s) after the measured ones (untimed)")
            profiler = make_profiler(cfg, info, out_dir, profiled)
            profiled["steps"] = profiled_steps(step)
            start_profile_limit(cfg.trace_limit_s)
            try:
                for _ in range(PROFILER_WARMUP + PROFILED_STEPS):
                    run_step(traced=True)
                    profiler.step()
                stop_time_limit()
            except ProfileTimeout as exc:
                stop_time_limit()
                profiling_stopped(profiled, exc, trace_path(out_dir, info.rank), info.rank)
    finally:
        work.close()
        gc.enable()
        watch.stop()
        if profiler is not None:
            discard_profiler(profiler)

    return {
        **rank_report(info, window, losses, memory),
        # samples, model / hardware / padded FLOPs, tokens per stream, the workload's own figures
        **work.figures(setup, window.notes, dtype),
        "backend_info": setup.info,
        "attention_kernels": kernels,
        "compile_counts": compile_counts(),
        "compiles": dict(watch.events),
        "compiles_in_window": sum(window.compile_steps().values()),
        "window_restarts": restarts,
        "profiled_steps": profiled.get("steps"),
        # The chrome trace, when its export completed (profiling stopped by its bound may leave none).
        "trace": profiled.get("trace"),
        # A profiled rank whose trace never completed says so (summary and explain read every rank's entry).
        "breakdown": profiled.get("breakdown") or ({"rank": info.rank, "error": "the profiler wrote no trace"}
                                                   if profiler is not None else None),
    }


def rank_report(info: DistInfo, window, losses: list, memory: dict) -> dict:
    """What every run reports of its measured window, Echo's or a card's: this rank's step times and
    data waits, the losses of its steps and its `memory` (memory_stats, on a CPU with baseline_gib as
    baseline_rss_gib)."""
    step_times, waits = window.timer.durations(), window.timer.wait_durations()
    return {
        "rank": info.rank,
        "hostname": os.uname().nodename,
        "step_times_s": step_times,
        "median_step_time_s": statistics.median(step_times),
        "data_wait_s": waits,
        "data_wait_frac": sum(waits) / max(sum(step_times), 1e-12),
        "data_wait_clock": window.timer.clock,
        "losses": [float(x) for x in torch.stack(losses).float().cpu()],
        "memory": memory,
    }


class RunTimeout(BaseException):
    """A BaseException, like KeyboardInterrupt: torch.compile's `except Exception` handlers must not
    swallow it (a limit reached inside an inductor compile was lost that way)."""


class ProfileTimeout(BaseException):
    """--trace's bound (trace_limit_s) reached: stops profiling, not the run (run_loop). A
    BaseException for the same reason as RunTimeout."""


_armed = None  # the SIGALRM handler of the limit running now (None: none)


def _arm(seconds: float | None, kind: type[BaseException], message: str) -> None:
    """SIGALRM interrupts whatever runs (a compile too) once `seconds` have passed, raising
    kind(message), and again every 5 s until stop_time_limit(), in case a handler somewhere still
    swallows it. No limit for None or 0."""
    global _armed
    if not seconds:
        return

    def expire(signum, frame):
        if _armed is expire:  # a signal already on its way when the limit was stopped: ignored
            raise kind(message)

    _armed = expire
    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 5.0)


def start_time_limit(seconds: float | None) -> None:
    """The run's time limit (time_limit_s): RunTimeout, status timeout."""
    _arm(seconds, RunTimeout, f"time limit of {seconds or 0:g} s reached")


def start_profile_limit(seconds: float | None) -> None:
    """The profiling bound (trace_limit_s), from the end of the measured steps: ProfileTimeout."""
    _arm(seconds, ProfileTimeout, f"profiling stopped at its {seconds or 0:g} s bound (trace_limit_s)")


def stop_time_limit() -> None:
    """Stops the limit or bound running (none: nothing to do, another SIGALRM timer is left alone)."""
    global _armed
    if _armed is None:
        return
    _armed = None
    signal.setitimer(signal.ITIMER_REAL, 0)


def failure_kind(exc: BaseException) -> RunState:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return RunState.OOM
    if isinstance(exc, RunTimeout):
        return RunState.TIMEOUT
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or a scheduler's SIGINT
        return RunState.CANCELLED
    return RunState.ERROR


def match_process_group(cfg: RunConfig, info: DistInfo) -> RunConfig:
    """The record describes the processes that really ran (e.g. a user's own torchrun)."""
    if cfg.world_size == info.world_size:
        return cfg
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    return replace(cfg, gpus_per_node=per_node, nodes=max(1, info.world_size // per_node))


# A peak per device above this is a GPU's: a peak this large given to a run whose device
# resolved to the CPU means a CPU-only torch, not a fast CPU. The GPUs this suite measures have
# dense bf16 peaks of 121 (L4) to 2,500 (GB200) TFLOP/s; a CPU's vector units reach a few to a few
# tens (a 72-core Grace: about 7 in fp32, bf16 a few times that), and only Xeons with AMX exceed
# it, on paper: a run on one that gives such a peak says device: cpu, which this check leaves alone.
CPU_PEAK_TFLOPS_MAX = 50.0


class NoGpuError(RuntimeError):
    """A run that expects a GPU (gpu_expected) on a machine where torch sees none."""


def gpu_expected(cfg: RunConfig) -> list[str]:
    """What in the settings says this run is for a GPU: device cuda (a matrix whose
    hardware.device names a GPU plans its auto runs so), or with device auto a GPU-class peak."""
    why = ["device: cuda"] if cfg.device == "cuda" else []
    if cfg.device == "auto" and cfg.peak_tflops is not None and cfg.peak_tflops > CPU_PEAK_TFLOPS_MAX:
        why.append(f"a GPU peak of {cfg.peak_tflops:g} TFLOP/s")
    return why


def no_gpu_problem(cfg: RunConfig) -> str | None:
    """One line, when this run expects a GPU and torch sees none: what expects it, why torch sees
    none and the fix. None when it expects none or a GPU is there."""
    expected = gpu_expected(cfg)
    if not expected or torch.cuda.is_available():
        return None
    causes = []
    if torch.version.cuda is None and torch.version.hip is None:
        causes.append(f"torch {torch.__version__} is a CPU build")
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        causes.append(f"CUDA_VISIBLE_DEVICES={visible!r}")
    if not causes:
        causes.append(f"torch {torch.__version__} (CUDA {torch.version.cuda or torch.version.hip}) finds no usable "
                      f"GPU (driver? see nvidia-smi)")
    return (f"this run expects a GPU ({' and '.join(expected)}) but torch sees none: {'; '.join(causes)}; "
            f"install a CUDA build (scripts/setup.sh) or set device: cpu")


def loop_workload(cfg: RunConfig, card: CardWorkload | None) -> Workload:
    """What the loop trains: Echo at cfg.scale, or the card run's decoder (setting card; `card` is
    its model.config.CardWorkload, read by the command: predict.cards.run)."""
    return EchoWorkload(cfg) if card is None else DecoderWorkload(cfg, card)


def run_benchmark(cfg: RunConfig, out_dir: Path, workload: CardWorkload | None = None) -> Record:
    """Runs one benchmark in this process (one rank); rank 0 writes OUT/result.json. `workload`: a
    card run's (setting card) model.config.CardWorkload, read by the command (predict.cards.run).

    A failure is never lost: this rank's status, error and traceback tail go to
    OUT/ranks/rank-N.json, and rank 0 (or the launcher) turns them into the record.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Before dist_info: device cuda without a GPU would raise there, with no record; on the CPU the
    # run gets one, with status error and the cause.
    no_gpu = no_gpu_problem(cfg)
    # Before CUDA's allocator starts: segments that grow in place instead of fragmenting the cache
    # (the allocator's retries slow the steps they hit); a value the user set stays.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    info = dist_info("cpu" if no_gpu else cfg.device)
    cfg = match_process_group(cfg, info)
    record = start_record(cfg, info.device)
    work = loop_workload(cfg, workload)
    record.update(**work.start_fields())
    start_time_limit(cfg.time_limit_s)
    metrics = None
    try:
        if no_gpu:
            raise NoGpuError(no_gpu)
        maybe_inject_failure(cfg, STARTUP_STEP, info.rank)
        form_process_group(info, cfg.collective_timeout_s)
        record.flops_breakdown = work.flops_report(cfg.ac)
        record.update(**resolve_peak(record.env.device_name, resolve_dtype(cfg.precision, info.device),
                                     cfg.peak_tflops, record.precision))
        if info.is_main:
            metrics = open_metrics_log(cfg.log_metrics, out_dir, record.run_id, cfg.to_dict())
        mine = run_loop(cfg, info, out_dir, work, record.peak_tflops, metrics)
        stop_time_limit()
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the record
        stop_time_limit()
        status = failure_kind(exc)
        rank_record = {
            "rank": info.rank,
            "status": status,
            "error": f"rank {info.rank}: {type(exc).__name__}: {exc}".splitlines()[0][:500],
            "traceback_tail": traceback.format_exc()[-4000:],
            "memory": memory_stats(info.device),
            "failed_at": time.time(),  # the first failure is the cause; peers fail after it
        }
        write_json_atomic(out_dir / "ranks" / f"rank-{info.rank}.json", rank_record)
        record.fail([rank_record])
        if info.is_main and not info.enabled:
            record.save(out_dir)
        finish_metrics(metrics, {})
        shutdown(abort=True)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return record
    ranks = all_gather_object(mine, info)
    summarize(cfg, record, ranks)  # on every rank: each returns the run's status
    record.update(**work.record_fields(record))
    if info.is_main:
        if "fractions" in (record.breakdown or {}):
            write_breakdown(out_dir, record, [r["breakdown"] for r in ranks])
        record.save(out_dir)
        finish_metrics(metrics, result_figures(record))
    shutdown()
    return record

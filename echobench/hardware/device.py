"""Device names, GEMM calibration, the peak a run's MFU is against (resolve_peak; the datasheet
table is echobench.records.peaks) and the software environment."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import torch

from echobench.model.flops import speaker_patches
from echobench.records.atomic import write_json_atomic
from echobench.records.config import FIELDS, RunConfig
from echobench.records.paths import cache_dir, cached_name
from echobench.records.peaks import peak_precision_of, table_peak
from echobench.records.results import cpu_device_name, now_iso, scheduler_context  # torch-free there: launch's records read it too

class UnknownPeakError(RuntimeError):
    pass


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device_name()


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; fp32 on CPUs, where bf16 GEMMs are ~100x slower without AMX."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def precision_name(precision: str, device: torch.device) -> str:
    """The precision a run's setting means on this device (auto: its default dtype's)."""
    if precision != "auto":
        return precision
    return "bf16" if default_dtype(device) == torch.bfloat16 else "fp32"


# ---- calibration: the achievable GEMM rate of this device ----

def calibration_path(name: str, dtype: torch.dtype) -> Path:
    return cache_dir() / "calibration" / f"{cached_name(name)}-{str(dtype).removeprefix('torch.')}.json"


@dataclass(frozen=True)
class GemmShape:
    """One matmul of the sweep: (m, k) activations times a (n, k) weight, as nn.Linear runs it
    (m rows, k input features, n output features)."""

    name: str
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def gemm_shapes(cfg, micro_batch: int, audio_frames: int, text_tokens: int, speaker_frames: int) -> list[GemmShape]:
    """The linear layers of one DiT block of `cfg` (an EchoConfig) at a micro-batch's rows, forward,
    at TP=1: the plain model (echobench/model/dit.py) and megatron's TP model
    (echobench/model/megatron.py) fuse the same projections. Rows: micro_batch x audio_frames for the latent stream,
    x text_tokens for the text keys / values, x speaker patches for the speaker ones, micro_batch
    for the AdaLN (one conditioning vector per sample). Shapes met twice are timed once, under
    both names."""
    d, ds, hidden, rank = cfg.width, cfg.speaker_width, cfg.mlp, cfg.adaln_rank
    latent, text = micro_batch * audio_frames, micro_batch * text_tokens
    speaker = micro_batch * speaker_patches(cfg, speaker_frames)
    listed = [
        GemmShape("attn q+k+v+gate", latent, 4 * d, d),
        GemmShape("attn out", latent, d, d),
        GemmShape("mlp gate+up", latent, 2 * hidden, d),
        GemmShape("mlp down", latent, d, hidden),
        GemmShape("text k+v", text, 2 * d, d),
        GemmShape("speaker k+v", speaker, 2 * d, ds),
        GemmShape("adaln down", micro_batch, rank, d),
        GemmShape("adaln up", micro_batch, 6 * d, rank),
    ]
    return _dedupe(listed)


def _dedupe(shapes: list[GemmShape]) -> list[GemmShape]:
    by_dims: dict[tuple[int, int, int], GemmShape] = {}
    for s in shapes:
        dims = (s.m, s.n, s.k)
        by_dims[dims] = replace(by_dims[dims], name=f"{by_dims[dims].name}; {s.name}") if dims in by_dims else s
    return list(by_dims.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


GEMM_SETS = 64  # the most operand sets time_gemm rotates through (working_set_bytes)


def operand_sets(shape: GemmShape, element_bytes: int, working_set_bytes: int) -> int:
    """How many (input, weight, output) sets of `shape` fill working_set_bytes: 1 to GEMM_SETS."""
    set_bytes = (shape.m * shape.k + shape.n * shape.k + shape.m * shape.n) * element_bytes
    return max(1, min(GEMM_SETS, -(-working_set_bytes // set_bytes)))


def time_gemm(device: torch.device, dtype: torch.dtype, shape: GemmShape, iters: int, warmup: int,
              time_left_s: float | None = None, working_set_bytes: int = 0) -> list[float]:
    """TFLOP/s of `shape`'s matmul, one figure per timed matmul, after `warmup` untimed ones.

    Inputs are random (randn: never time zeros), the output preallocated (no allocation in the
    loop). On GPU each matmul sits between its own pair of CUDA events, all launched back-to-back
    with one synchronisation at the end (as MAMF does): the events measure the kernel on the
    stream, not the host's launch overhead or a sync per matmul. On CPU, the host clock per matmul
    (torch.mm is synchronous there). With `time_left_s`, the warm-up (timed as a whole, host clock
    after a sync) estimates one matmul's time and the timed count is cut to what fits, never below
    one: the caller records how many were timed (len of the result).

    `working_set_bytes`: successive matmuls take the next of as many (input, weight, output) sets
    as that many bytes hold (at most GEMM_SETS), so that each finds its operands where a training
    step leaves them, the rest of the step's weights having passed through the caches since
    (0: one set, the operands warm in the cache, as a peak finder times them).
    """
    gen = torch.Generator(device=device).manual_seed(0)
    count = operand_sets(shape, torch.empty((), dtype=dtype).element_size(), working_set_bytes)
    sets = [(torch.randn(shape.m, shape.k, device=device, dtype=dtype, generator=gen),
             torch.randn(shape.n, shape.k, device=device, dtype=dtype, generator=gen).t(),  # x @ W^T, as nn.Linear
             torch.empty(shape.m, shape.n, device=device, dtype=dtype)) for _ in range(count)]
    turn = iter(range(1 << 62))

    def mm():
        a, wt, out = sets[next(turn) % count]
        torch.mm(a, wt, out=out)

    _sync(device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        mm()
    _sync(device)
    if time_left_s is not None and warmup:
        per_matmul = max((time.perf_counter() - t0) / warmup, 1e-9)
        iters = max(1, min(iters, int(time_left_s / per_matmul)))
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends):
            start.record()
            mm()
            end.record()
        torch.cuda.synchronize(device)
        seconds = [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
    else:
        seconds = []
        for _ in range(iters):
            t = time.perf_counter()
            mm()
            seconds.append(time.perf_counter() - t)
    return [shape.flops / max(s, 1e-9) / 1e12 for s in seconds]


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, size: int, iters: int = 10, warmup: int = 3) -> list[float]:
    """TFLOP/s of size^3 matmuls, one figure per iteration (after warm-up)."""
    return time_gemm(device, dtype, GemmShape("square", size, size, size), iters, warmup)


def _spin_up(device: torch.device, dtype: torch.dtype, shape: GemmShape, seconds: float) -> None:
    """Matmuls for `seconds` before anything is timed: clocks and power settle (GPU)."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(shape.m, shape.k, device=device, dtype=dtype, generator=gen)
    b = torch.randn(shape.k, shape.n, device=device, dtype=dtype, generator=gen)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            torch.mm(a, b)
        _sync(device)


MIN_GPU_ITERS = 50  # a GPU ceiling is the median of at least this many timed matmuls per shape


def calibrate(device: torch.device, dtype: torch.dtype | None = None, size: int | None = None,
              iters: int | None = None, *, scale: str | None = None, micro_batch: int | None = None,
              audio_frames: int | None = None, text_tokens: int | None = None, speaker_frames: int | None = None,
              warmup: int | None = None, budget_s: float = 15.0, spin_up_s: float | None = None) -> dict:
    """The achievable GEMM rate of this device (the "GEMM ceiling"), MAMF-style: the best median
    rate over a sweep of shapes, each timed `iters` times after `warmup` untimed matmuls.

    Shapes: a size^3 square (default 8192 on GPU, 1024 on CPU) and the DiT block's linear layers
    (gemm_shapes) of the `scale` preset (default 3B on GPU, tiny on CPU) at the run's rows (the
    micro-batch and lengths default to RunConfig's). Defaults: 50 timed matmuls per shape after
    25 warm-up ones on GPU (at least 50: fewer is an error), 5 after 1 on CPU. `budget_s` caps the
    warm-up and timed matmuls together (a 1 s spin-up on GPU included): the shapes run smallest
    first, each gets its share of what is left, and a shape that cannot fit its iterations times
    fewer (its `iters` says how many). At the GPU defaults (3B, micro-batch 8) the 12 shapes are
    ~2.4 TFLOP a round, 75 rounds ~0.23 s at 800 TFLOP/s (8B: ~0.41 s): the budget only binds for
    far larger shapes or counts.

    Returns the record also written to the cache: tflops (the best shape's median: the ceiling),
    tflops_min / tflops_max (that shape's samples), iters (that shape's timed count), size (the
    square's), best_shape (its name), shapes (every shape: m, n, k, name, iters, tflops_median,
    tflops_max, tflops_min, in the order listed), wall_s, and what they came from.
    """
    start = time.perf_counter()
    gpu = device.type == "cuda"
    dtype = dtype or default_dtype(device)
    size = size or (8192 if gpu else 1024)
    iters = iters if iters is not None else (MIN_GPU_ITERS if gpu else 5)
    warmup = warmup if warmup is not None else (25 if gpu else 1)
    spin_up_s = spin_up_s if spin_up_s is not None else (1.0 if gpu else 0.0)
    if iters < 1 or size < 1 or warmup < 0 or budget_s <= 0:
        raise ValueError(f"iters={iters}, size={size}, warmup={warmup}, budget_s={budget_s}: iters and size must be "
                         f">= 1, warmup >= 0, the budget positive")
    if gpu and iters < MIN_GPU_ITERS:
        raise ValueError(f"iters={iters}: a GPU ceiling needs at least {MIN_GPU_ITERS} timed matmuls per shape")
    given = {"micro_batch": micro_batch, "audio_frames": audio_frames, "text_tokens": text_tokens,
             "speaker_frames": speaker_frames}
    run = RunConfig(scale=scale or ("3B" if gpu else "tiny"),
                    **{k: FIELDS[k].default if v is None else v for k, v in given.items()})
    square = GemmShape("square", size, size, size)
    shapes = _dedupe([square, *gemm_shapes(run.model_config(), run.micro_batch, run.audio_frames,
                                           run.text_tokens, run.speaker_frames)])

    if spin_up_s > 0:
        _spin_up(device, dtype, square, min(spin_up_s, budget_s / 4))
    rates: dict[str, list[float]] = {}
    order = sorted(shapes, key=lambda s: s.flops)  # smallest first: what they leave goes to the big ones
    for i, shape in enumerate(order):
        left = budget_s - (time.perf_counter() - start)
        rates[shape.name] = time_gemm(device, dtype, shape, iters, warmup, time_left_s=left / (len(order) - i))
    rows = [{"name": s.name, "m": s.m, "n": s.n, "k": s.k, "iters": len(rates[s.name]),
             "tflops_median": statistics.median(rates[s.name]), "tflops_max": max(rates[s.name]),
             "tflops_min": min(rates[s.name])} for s in shapes]
    best = max(rows, key=lambda r: r["tflops_median"])
    name = device_name(device)
    record = {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "iters": best["iters"],
        "tflops": best["tflops_median"],
        "tflops_min": best["tflops_min"],
        "tflops_max": best["tflops_max"],
        "datasheet_tflops": (table_peak(name) or (None,))[0],
        "torch": torch.__version__,
        "time": now_iso(),
        "best_shape": best["name"],
        "shapes": rows,
        "shapes_from": {"scale": run.scale, "micro_batch": run.micro_batch, "audio_frames": run.audio_frames,
                        "text_tokens": run.text_tokens, "speaker_frames": run.speaker_frames},
        "iters_requested": iters,
        "warmup": warmup,
        "budget_s": budget_s,
        "timing": "CUDA events per matmul, launched back-to-back" if gpu else "host clock per matmul",
        "wall_s": round(time.perf_counter() - start, 3),
    }
    path = calibration_path(name, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    record["path"] = str(path)
    return record


def load_calibration(name: str, dtype: torch.dtype) -> dict | None:
    path = calibration_path(name, dtype)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def resolve_peak(name: str, dtype: torch.dtype, flag: float | None = None, precision: str | None = None) -> dict:
    """The MFU denominator per GPU: the flag, else the datasheet table, else a calibration.

    Returns peak_tflops, peak_source, peak_precision (the precision the peak is for: a flag or
    the table gives the dense bf16 peak; a calibration is for its GEMM dtype), ceiling_tflops
    when a calibration exists, and for an fp8 run peak_fp8_tflops (the table's dense fp8 peak).
    An unknown device with neither is an error, never a silent default.
    """
    cal = load_calibration(name, dtype)
    ceiling = cal["tflops"] if cal else None
    fp8 = table_peak(name, "fp8") if precision == "fp8" else None
    extra = {"ceiling_tflops": ceiling, "peak_fp8_tflops": fp8[0] if fp8 else None}
    if flag is not None:
        if flag <= 0:
            raise ValueError(f"--peak-tflops must be positive, got {flag}")
        peak, source = flag, "flag"
    elif (hit := table_peak(name)) is not None:
        peak, source = hit
    elif cal is not None:
        peak, source = ceiling, f"calibrated:{cal['dtype']} GEMM {cal['time']}"
    else:
        raise UnknownPeakError(
            f"no peak FLOP/s known for device {name!r}: pass --peak-tflops X (or hardware.peak_tflops in the matrix), "
            f"or run `echobench calibrate` on this machine first"
        )
    return {"peak_tflops": peak, "peak_source": source, "peak_precision": peak_precision_of(source), **extra}


# ---- environment ----

def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """This checkout's commit: ECHOBENCH_GIT_COMMIT when set (a copied tree's .git can be stale: the
    lent GPU's copy answered an older HEAD than the tree it ran), else git's HEAD."""
    if os.environ.get("ECHOBENCH_GIT_COMMIT"):
        return os.environ["ECHOBENCH_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def driver_version() -> str | None:
    try:  # the kernel module's own line: "NVRM version: NVIDIA UNIX ... Kernel Module  570.86.15 ..."
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9.]+)", text)
    return found.group(1) if found else None


def env_info(device: torch.device) -> dict:
    """Where and with what this process runs: the fields of the record's `env` (results.Env)."""
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = None
    return dict(
        device_name=device_name(device),
        device_type=device.type,
        hostname=socket.gethostname(),
        pid=os.getpid(),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        nccl=nccl,
        cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") if device.type == "cuda" else None,
        cudnn=str(torch.backends.cudnn.version()) if device.type == "cuda" and torch.backends.cudnn.is_available() else None,
        transformers=_version("transformers"),
        megatron_core=_version("megatron-core") or _version("megatron_core"),
        transformer_engine=_version("transformer-engine") or _version("transformer_engine"),
        torchao=_version("torchao"),
        echobench=_version("echobench"),
        git_commit=git_commit(),
        time=now_iso(),
        driver=driver_version(),
        **scheduler_context(),
    )

"""Device names, GEMM calibration, the peak a run's MFU is against (resolve_peak; the datasheet
table is echobench.peaks) and the software environment."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import statistics
import subprocess
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

from echobench.atomic import write_json_atomic
from echobench.peaks import peak_precision_of, table_peak

class UnknownPeakError(RuntimeError):
    pass


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model} ({os.cpu_count()} cores)"


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs; fp32 on CPUs, where bf16 GEMMs are ~100x slower without AMX."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def precision_name(precision: str, device: torch.device) -> str:
    """The precision a run's setting means on this device (auto: its default dtype's)."""
    if precision != "auto":
        return precision
    return "bf16" if default_dtype(device) == torch.bfloat16 else "fp32"


# ---- calibration: the achievable GEMM rate of this device ----

def cache_dir() -> Path:
    return Path(os.environ.get("ECHOBENCH_CACHE", Path.home() / ".cache" / "echobench"))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def calibration_path(name: str, dtype: torch.dtype) -> Path:
    return cache_dir() / "calibration" / f"{_slug(name)}-{str(dtype).removeprefix('torch.')}.json"


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, size: int, iters: int = 10, warmup: int = 3) -> list[float]:
    """TFLOP/s of size^3 matmuls, one figure per iteration (after warm-up)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)  # never time zeros
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    flops = 2 * size**3
    for _ in range(warmup):
        torch.mm(a, b)
    rates = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.mm(a, b)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            torch.mm(a, b)
            seconds = time.perf_counter() - t0
        rates.append(flops / seconds / 1e12)
    return rates


def calibrate(device: torch.device, dtype: torch.dtype | None = None, size: int | None = None, iters: int = 10) -> dict:
    dtype = dtype or default_dtype(device)
    size = size or (8192 if device.type == "cuda" else 1024)
    rates = measure_gemm_tflops(device, dtype, size, iters)
    name = device_name(device)
    record = {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "size": size,
        "iters": iters,
        "tflops": statistics.median(rates),
        "tflops_min": min(rates),
        "tflops_max": max(rates),
        "datasheet_tflops": (table_peak(name) or (None,))[0],
        "torch": torch.__version__,
        "time": now_iso(),
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
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
        transformers=_version("transformers"),
        megatron_core=_version("megatron-core") or _version("megatron_core"),
        transformer_engine=_version("transformer-engine") or _version("transformer_engine"),
        torchao=_version("torchao"),
        echobench=_version("echobench"),
        git_commit=git_commit(),
        time=now_iso(),
    )

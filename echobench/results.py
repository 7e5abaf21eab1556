"""The result record (`result.json`, one per run): schema, atomic writes, reading back."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from echobench.config import RunConfig, configuration_id

# 2: throughput and MFU over the whole measured window (1: from the median step); repeats,
#    peak_precision, fp8 MFU, allocator counters. Readers migrate older records (migrate()).
SCHEMA_VERSION = 2
STATUSES = ("ok", "oom", "error", "timeout", "cancelled", "node_fail")

REQUIRED_FIELDS = (
    "schema_version", "run_id", "repeat", "status", "error",
    "scale", "framework", "parallelism", "tp", "dp", "nodes", "gpus_per_node", "world_size",
    "micro_batch", "global_batch", "audio_frames", "text_tokens", "speaker_frames",
    "precision", "compile", "ac", "steps", "warmup_steps",
    "step_time_s", "step_time_p10_s", "step_time_p90_s", "samples_per_s", "audio_seconds_per_s",
    "model_flops_per_sample", "flops_breakdown", "tflops_per_gpu", "mfu", "hfu",
    "peak_tflops", "peak_source", "peak_precision", "peak_mem_gib", "data_wait_frac", "per_rank", "env",
)


def window_figures(*, measured_time_s: float, samples: int, model_flops: int, hardware_flops: int,
                   audio_seconds: float, world_size: int, peak_tflops: float, ceiling_tflops: float | None = None,
                   peak_fp8_tflops: float | None = None) -> dict:
    """Throughput and MFU over the whole measured window: the one place of this convention.

    measured_time_s is the sum of the measured steps, each at its slowest rank; samples and
    FLOPs are those of the measured steps (data-parallel replicas, real lengths).
    """
    tflops_per_gpu = model_flops / measured_time_s / world_size / 1e12
    return {
        "samples_per_s": samples / measured_time_s,
        "audio_seconds_per_s": audio_seconds / measured_time_s,
        "model_flops_per_sample": model_flops / samples,
        "hardware_flops_per_sample": hardware_flops / samples,
        "tflops_per_gpu": tflops_per_gpu,
        "mfu": model_flops / (measured_time_s * world_size * peak_tflops * 1e12),
        "hfu": hardware_flops / (measured_time_s * world_size * peak_tflops * 1e12),
        "mfu_vs_ceiling": tflops_per_gpu / ceiling_tflops if ceiling_tflops else None,
        "mfu_fp8_peak": tflops_per_gpu / peak_fp8_tflops if peak_fp8_tflops else None,
    }


def step_figures(step_times_s: list[float]) -> dict:
    """Median, p10 / p90 and mean of the measured steps, and how far the mean sits above the median."""
    n = len(step_times_s)
    median = statistics.median(step_times_s)
    mean = sum(step_times_s) / n
    return {
        "step_time_s": median,
        "step_time_p10_s": percentile(step_times_s, 0.1),
        "step_time_p90_s": percentile(step_times_s, 0.9),
        "step_time_mean_s": mean,
        "step_time_mean_vs_median": mean / median - 1,
        "measured_steps": n,
        "measured_time_s": sum(step_times_s),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def peak_precision_of(source: str | None) -> str | None:
    """The precision a peak is for, from its peak_source: a flag or the datasheet table give the
    dense bf16 peak; a calibration is for its GEMM's dtype."""
    if not source:
        return None
    if source == "flag" or source.startswith("datasheet:"):
        return "bf16"
    if source.startswith("calibrated:"):
        dtype = source.removeprefix("calibrated:").split()[0]
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return None


# ---- older records ----

def _from_v1(record: dict) -> None:
    """Version 1 took samples/s and MFU from the median step. Its records keep the slowest rank's
    time of every measured step, so the window figures are recomputed from them; the counts v1
    did not keep are derived (samples = samples/s x median step x steps) or left None."""
    record.setdefault("repeat", 0)
    record.setdefault("peak_precision", peak_precision_of(record.get("peak_source")))
    for key in ("num_alloc_retries", "num_ooms", "mfu_fp8_peak", "peak_fp8_tflops", "measured_steps",
                "measured_time_s", "measured_samples", "measured_model_flops", "measured_hardware_flops",
                "step_time_mean_s", "step_time_mean_vs_median"):
        record.setdefault(key, None)
    times = record.get("step_times_s")
    needed = ("samples_per_s", "step_time_s", "model_flops_per_sample", "audio_seconds_per_s", "peak_tflops",
              "world_size")
    if record.get("status") != "ok" or not times or any(record.get(k) is None for k in needed):
        return
    n, median = len(times), record["step_time_s"]
    samples = round(record["samples_per_s"] * median * n)
    hw_per_sample = record.get("hardware_flops_per_sample") or record["model_flops_per_sample"]
    if record.get("precision") == "fp8" and (record.get("env") or {}).get("device_name"):
        from echobench.hardware import table_peak  # imports torch: only for fp8 records

        fp8 = table_peak(record["env"]["device_name"], "fp8")
        record["peak_fp8_tflops"] = fp8[0] if fp8 else None
    record.update(step_figures(times))
    record.update(measured_samples=samples, measured_model_flops=round(record["model_flops_per_sample"] * samples),
                  measured_hardware_flops=round(hw_per_sample * samples))
    record.update(window_figures(
        measured_time_s=record["measured_time_s"], samples=samples, model_flops=record["measured_model_flops"],
        hardware_flops=record["measured_hardware_flops"],
        audio_seconds=record["audio_seconds_per_s"] * median * n, world_size=record["world_size"],
        peak_tflops=record["peak_tflops"], ceiling_tflops=record.get("ceiling_tflops"),
        peak_fp8_tflops=record["peak_fp8_tflops"]))


MIGRATIONS = {1: _from_v1}  # version -> the function that brings a record to the next version


def migrate(record: dict, where: str = "record") -> dict:
    """Brings a record of an older schema version up to SCHEMA_VERSION, in place."""
    version = record.get("schema_version", 1)
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"{where}: schema_version {version!r} is not one this echobench reads (1 to "
                         f"{SCHEMA_VERSION}): a newer echobench wrote it, or it is not a result record")
    while version < SCHEMA_VERSION:
        MIGRATIONS[version](record)
        record["migrated_from"] = record.get("migrated_from", version)
        version += 1
        record["schema_version"] = version
    return record


def write_json_atomic(path: Path, obj) -> None:
    """Write-then-rename: a reader never sees half a file, a crash never leaves one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def write_record(out_dir: Path, record: dict) -> Path:
    missing = [k for k in REQUIRED_FIELDS if k not in record]
    if missing:
        raise ValueError(f"result record lacks required field(s): {', '.join(missing)}")
    if record["status"] not in STATUSES:
        raise ValueError(f"status {record['status']!r} is not one of {', '.join(STATUSES)}")
    path = Path(out_dir) / "result.json"
    write_json_atomic(path, record)
    return path


def read_record(path: Path) -> dict:
    """Reads one record; raises ValueError naming the file when it is not a valid record."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable result record ({exc})") from exc
    if not isinstance(record, dict) or "status" not in record or "run_id" not in record:
        raise ValueError(f"{path}: not a result record (no run_id / status)")
    return migrate(record, str(path))


# ---- collection: reports and status read only stored records ----

def find_record_files(paths) -> list[Path]:
    """result.json files under each path (a record file, a run dir or a sweep dir). A sweep's
    earlier attempts (RUN/attempts/N/result.json) are left out: they never stand in for a run's
    current record (an attempt directory named itself is read)."""
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            for f in sorted(p.rglob("result.json")):
                rel = f.relative_to(p).parts
                if not (len(rel) >= 3 and rel[-3] == "attempts" and rel[-2].isdigit()):
                    found.append(f)
    return found


def load_records(paths) -> tuple[list[dict], list[str]]:
    """All records under paths, newest per run_id; corrupt ones reported, never fatal.

    Returns (records, problems) where problems are one-line messages naming the file.
    """
    newest: dict[str, dict] = {}
    problems = []
    for path in find_record_files(paths):
        try:
            record = read_record(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        record["_path"] = str(path)
        key = record["run_id"]
        stamp = (record.get("env") or {}).get("time") or ""
        if key not in newest or stamp >= ((newest[key].get("env") or {}).get("time") or ""):
            newest[key] = record
    return list(newest.values()), problems


# ---- what a reader must know beside the MFU ----

def peak_notes(record: dict) -> list[str]:
    """Warnings that belong next to a record's MFU: a calibrated denominator, a peak for another
    precision than the run's, an fp8 run (whose MFU against the fp8 peak is a figure of its own).
    The same for every repeat of a configuration: no per-run numbers."""
    notes = []
    source, pp, precision = record.get("peak_source") or "", record.get("peak_precision"), record.get("precision")
    if source.startswith("calibrated"):
        notes.append(f"MFU is against a calibrated GEMM rate ({source.removeprefix('calibrated:')}), not a datasheet "
                     "peak: it reads higher than datasheet-based MFU")
    if precision == "fp8":
        notes.append(f"fp8 run: MFU is against the {pp or 'given'} peak, "
                     + ("and against the dense fp8 peak in a figure of its own" if record.get("mfu_fp8_peak") is not None
                        else "and no fp8 peak is known for this device"))
    elif precision and pp and precision != pp:
        notes.append(f"{precision} run measured against the {pp} peak")
    return notes


# ---- repeats: records of one configuration ----

def record_settings(record: dict) -> dict:
    """The settings a run was launched with: the record's `config` (its RunConfig), else (a record
    without one) its top-level fields of the same names."""
    if isinstance(record.get("config"), dict):
        return record["config"]
    return {k: record[k] for k in RunConfig.__dataclass_fields__ if k in record}


def configuration_key(record: dict) -> str:
    """What the runs of one configuration at one node count share (echobench.config.configuration):
    reports give the median over them, `compare` pairs them. Unlike the run id, it leaves out how
    long and how often we measured: runs of two sweeps with different step counts pool."""
    return configuration_id(record_settings(record))


def over_repeats(values) -> dict | None:
    """Median, min, max and count of one figure over repeats (missing and non-finite values left out)."""
    values = [x for x in (float(v) for v in values if v is not None) if math.isfinite(x)]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


TABLE_COLUMNS = [
    "run_id", "repeat", "status", "error", "scale", "framework", "parallelism", "tp", "dp", "nodes", "gpus_per_node",
    "world_size", "micro_batch", "global_batch", "audio_frames", "text_tokens", "speaker_frames", "precision",
    "compile", "ac", "encoder_model", "frozen_encoder", "steps", "warmup_steps", "step_time_s", "step_time_p10_s", "step_time_p90_s",
    "step_time_mean_s", "step_time_mean_vs_median", "measured_time_s",
    "samples_per_s", "audio_seconds_per_s", "model_flops_per_sample", "tflops_per_gpu", "mfu", "hfu",
    "mfu_vs_ceiling", "mfu_fp8_peak", "peak_tflops", "peak_source", "peak_precision", "peak_fp8_tflops",
    "ceiling_tflops", "peak_mem_gib", "num_alloc_retries", "num_ooms", "data_wait_frac",
]


def records_frame(records: list[dict]):
    """One row per record: the flat fields plus env's device, host, versions and time."""
    import pandas as pd

    rows = []
    for r in records:
        row = {c: r.get(c) for c in TABLE_COLUMNS}
        env = r.get("env") or {}
        for key in ("device_name", "hostname", "torch", "cuda", "megatron_core", "transformer_engine", "git_commit", "time"):
            row[key] = env.get(key)
        row["samples_per_s_per_gpu"] = (r["samples_per_s"] / r["world_size"]) if r.get("samples_per_s") else None
        row["path"] = r.get("_path")
        rows.append(row)
    return pd.DataFrame(rows, columns=TABLE_COLUMNS + ["device_name", "hostname", "torch", "cuda", "megatron_core",
                                                       "transformer_engine", "git_commit", "time",
                                                       "samples_per_s_per_gpu", "path"])


# ---- records the job could not write itself ----

def stub_record(cfg, status: str, error: str, **extra) -> dict:
    """A complete record for a run that died before writing one (timeout, cancel, node failure,
    a crash before the benchmark started): the settings, no figures, and why."""
    import socket
    from datetime import datetime, timezone

    from echobench.config import run_id

    record = {k: None for k in REQUIRED_FIELDS}
    record.update(cfg.to_dict())
    record.update(
        schema_version=SCHEMA_VERSION, run_id=run_id(cfg), status=status, error=error,
        tp=cfg.tp, dp=cfg.dp, world_size=cfg.world_size, global_batch=cfg.global_batch,
        per_rank=[], config=cfg.to_dict(),
        env={"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "hostname": socket.gethostname(),
             "recorded_by": "echobench sweep (the job left no record of its own)"},
    )
    record.update(extra)
    return record


def export_table(frame, out_dir: Path, stem: str = "results") -> list[Path]:
    """Writes the table as CSV and Parquet (atomically); returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, write in ((".csv", lambda p: frame.to_csv(p, index=False)),
                          (".parquet", lambda p: frame.to_parquet(p, index=False))):
        path = out_dir / f"{stem}{suffix}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write(tmp)
        os.replace(tmp, path)
        written.append(path)
    return written

"""The result record (`result.json`, one per run): schema, atomic writes, reading back."""

from __future__ import annotations

import json
import os
from pathlib import Path

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "error", "timeout", "cancelled", "node_fail")

REQUIRED_FIELDS = (
    "schema_version", "run_id", "status", "error",
    "scale", "framework", "parallelism", "tp", "dp", "nodes", "gpus_per_node", "world_size",
    "micro_batch", "global_batch", "audio_frames", "text_tokens", "speaker_frames",
    "precision", "compile", "ac", "steps", "warmup_steps",
    "step_time_s", "step_time_p10_s", "step_time_p90_s", "samples_per_s", "audio_seconds_per_s",
    "model_flops_per_sample", "flops_breakdown", "tflops_per_gpu", "mfu", "hfu",
    "peak_tflops", "peak_source", "peak_mem_gib", "data_wait_frac", "per_rank", "env",
)


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
    return record


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


TABLE_COLUMNS = [
    "run_id", "status", "error", "scale", "framework", "parallelism", "tp", "dp", "nodes", "gpus_per_node",
    "world_size", "micro_batch", "global_batch", "audio_frames", "text_tokens", "speaker_frames", "precision",
    "compile", "ac", "encoder_model", "frozen_encoder", "steps", "warmup_steps", "step_time_s", "step_time_p10_s", "step_time_p90_s",
    "samples_per_s", "audio_seconds_per_s", "model_flops_per_sample", "tflops_per_gpu", "mfu", "hfu",
    "mfu_vs_ceiling", "peak_tflops", "peak_source", "ceiling_tflops", "peak_mem_gib", "data_wait_frac",
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

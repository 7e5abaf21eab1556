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

"""Atomic file writes: records, plans, sweep state and calibrations all go through here."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: Path, obj) -> None:
    """Write-then-rename: a reader never sees half a file, a crash never leaves one."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """write_json_atomic for text that is already formatted (shard indexes: fixed-width lines)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

"""Where echobench keeps files: its cache, and the files a sweep or tune directory holds that more
than one layer reads (a run directory's own files are the executors'; its record is results.RECORD_FILE)."""

from __future__ import annotations

import os
import re
from pathlib import Path

SWEEP_FILE = "sweep.json"  # a sweep directory's state (the sweep's SweepState)
TUNE_FILE = "tune.json"  # TUNE/tune.json (tune's output writes it, the dashboard reads it)


def cache_dir() -> Path:
    """ECHOBENCH_CACHE, else ~/.cache/echobench: calibrations, shard indexes, profiles."""
    return Path(os.environ.get("ECHOBENCH_CACHE", Path.home() / ".cache" / "echobench"))


def cached_name(text: str) -> str:
    """A device's name as a cache file's stem: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def sweep_profile(sweep_dir: Path) -> Path:
    """SWEEP/profile.yaml: the hardware profile the sweep measured (hardware.calibrate_comm)."""
    return sweep_dir.resolve() / "profile.yaml"


def comm_calibrated(sweep_dir: Path) -> bool:
    """Whether the sweep has its hardware profile already (written whole or not at all: save_profile)."""
    return sweep_profile(sweep_dir).is_file()


def measured_profile(path: Path | str) -> Path | None:
    """The hardware profile the sweep that `path` lies in measured (hardware.calibrate_comm): the
    sweep_profile of the nearest directory at or above `path` (a record, a run or sweep directory) with
    a sweep.json, where there is one; None otherwise."""
    path = Path(path).resolve()
    for d in (path, *path.parents):
        if (d / SWEEP_FILE).is_file():
            return sweep_profile(d) if comm_calibrated(d) else None
    return None

"""A run directory's files, named and read here: the node side (the job scripts, the launcher) and the
sweep side (sweep.executors, sweep.status, sweep.loop) both go through these names and readers.

    RUN_DIR/run.yaml      the run's settings (RunConfig keys), written by the sweep before its job
    RUN_DIR/job-state     written by the job itself: "running ID TIME", then "exited ID RC TIME"
    RUN_DIR/result.json   the record (results.RECORD_FILE)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from echobench.records.config import RunConfig, upgraded
from echobench.records.states import RunState

RUN_YAML = "run.yaml"
JOB_STATE = "job-state"


def write_run_yaml(run_dir: Path, cfg: RunConfig) -> None:
    (Path(run_dir) / RUN_YAML).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def read_run_settings(run_dir: Path) -> dict:
    """RUN_DIR/run.yaml as stored (older keys under their new names); a ValueError naming the file
    where it is missing or not a mapping of settings."""
    path = Path(run_dir) / RUN_YAML
    try:
        settings = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        settings = None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} is missing or invalid")
    return upgraded(settings)


def read_run_config(run_dir: Path) -> RunConfig:
    """The run's settings from RUN_DIR/run.yaml; a ValueError naming the file where they are missing or
    invalid."""
    settings = read_run_settings(run_dir)
    try:
        return RunConfig.from_dict(settings)
    except (ValueError, TypeError):
        raise ValueError(f"{Path(run_dir) / RUN_YAML} is missing or invalid") from None


@dataclass
class JobNote:
    """What a job last wrote of itself in RUN_DIR/job-state."""

    state: RunState  # running | exited
    job_id: str
    exit_code: int | None = None  # exited: the job's exit code


def read_job_note(run_dir: Path) -> JobNote | None:
    """RUN_DIR/job-state, None where there is none (or it is not one a job writes)."""
    try:
        words = (Path(run_dir) / JOB_STATE).read_text().split()
    except OSError:
        return None
    if len(words) >= 3 and words[0] == RunState.EXITED and words[2].lstrip("-").isdigit():
        return JobNote(RunState.EXITED, words[1], int(words[2]))
    if len(words) >= 2 and words[0] == RunState.RUNNING:
        return JobNote(RunState.RUNNING, words[1])
    return None

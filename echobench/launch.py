"""`echobench run --nproc N`: launch torchrun for this node, then make sure a record exists.

torchrun ends every worker when one fails, so a dead rank never leaves the others hanging.
The ranks that failed left OUT/ranks/rank-N.json; if rank 0 could not write result.json,
this process (the launcher, on node 0) assembles it from those files: no failure is lost.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from echobench.config import RunConfig
from echobench.results import RECORD_FILE, Record


def rank_failures(out_dir: Path) -> list[dict]:
    """The failures ranks recorded in OUT/ranks/rank-N.json (unreadable files skipped)."""
    failures = []
    for rank_file in sorted((Path(out_dir) / "ranks").glob("rank-*.json")):
        try:
            failures.append(json.loads(rank_file.read_text()))
        except (OSError, ValueError):
            continue
    return failures


def clear_previous(out_dir: Path) -> None:
    """A rerun into the same directory must not report the previous run's result."""
    (out_dir / RECORD_FILE).unlink(missing_ok=True)
    shutil.rmtree(out_dir / "ranks", ignore_errors=True)


def torchrun_command(run_args: list[str], nproc: int, nnodes: int, node_rank: int,
                     master_addr: str | None, master_port: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}",
                f"--master-addr={master_addr or '127.0.0.1'}", f"--master-port={master_port}"]
    return cmd + ["-m", "echobench", "run", *run_args]


def source_root() -> Path:
    """The directory that holds this echobench package (a source checkout, or site-packages)."""
    return Path(__file__).resolve().parent.parent


def with_source_path(env: dict) -> dict:
    """`env` with source_root() first on PYTHONPATH: works from a source checkout too, the
    children import this very package."""
    env["PYTHONPATH"] = str(source_root()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def child_env(nproc: int, cfg: RunConfig | None = None) -> dict:
    env = with_source_path(dict(os.environ))
    # Share the cores between the local ranks instead of oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if cfg is not None and cfg.framework == "megatron" and cfg.tp > 1:
        # One hardware queue per device: megatron-core's TP communication then overlaps the GEMMs
        # it is issued beside (read when the CUDA context starts; the record's env keeps it).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def launch(cfg: RunConfig, out_dir: Path, nproc: int | None, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int = 29500) -> tuple[Record | None, int]:
    """Runs torchrun for this node (one `echobench run` process when nproc is None); the workers
    read the resolved settings from a YAML file.

    Returns (the run's record, torchrun's exit code); the record is None on nodes other than 0."""
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    if node_rank == 0:
        clear_previous(out_dir)
    config_path = out_dir / f"run-node{node_rank}.yaml"
    config_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    run_args = ["--config", str(config_path), "--out", str(out_dir)]
    if nproc is None:
        cmd = [sys.executable, "-m", "echobench", "run", *run_args]
    else:
        cmd = torchrun_command(run_args, nproc, nnodes, node_rank, master_addr, master_port)
    env = child_env(nproc or 1, cfg)
    started = time.time()
    code = subprocess.call(cmd, env=env)
    if node_rank != 0:
        return None, code
    return finalize(cfg, out_dir, code, started), code


def launch_repeats(cfg: RunConfig, out_dir: Path, repeats: int, nproc: int | None = None, nnodes: int = 1,
                   node_rank: int = 0, master_addr: str | None = None, master_port: int = 29500) -> tuple[list[Record], int]:
    """`run --repeats N`: N independent launches (fresh processes each) into OUT/repeat-K, the
    repeat index counted from cfg.repeat; returns their records (none on nodes other than 0) and
    the first non-zero torchrun exit code (0 when every launch exited 0)."""
    records, first_code = [], 0
    for k in range(repeats):
        record, code = launch(replace(cfg, repeat=cfg.repeat + k), out_dir / f"repeat-{k}", nproc, nnodes, node_rank,
                              master_addr, master_port)
        first_code = first_code or code
        if record is not None:
            records.append(record)
    return records, first_code


def finalize(cfg: RunConfig, out_dir: Path, exit_code: int, started: float) -> Record:
    """Returns the run's record, writing one from the rank files when rank 0 could not."""
    path = out_dir / RECORD_FILE
    if path.exists() and path.stat().st_mtime >= started - 1:
        return Record.load(path)
    from echobench.distributed import pick_device

    record = Record.start(cfg, pick_device(cfg.device))
    if failures := rank_failures(out_dir):
        record.fail(failures)
    else:
        record.update(status="error", error=f"torchrun exited with code {exit_code} and no rank left a record; see the log")
    record.save(out_dir)
    return record

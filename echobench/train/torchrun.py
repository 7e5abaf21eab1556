"""torchrun for one node, leaving a note of how it ended:
`python -m echobench.train.torchrun REPORT [--preload=MODULES] ARGS`.

A run's record is assembled from files the ranks write when they fail (OUT/ranks/rank-N.json).
A worker killed by a signal (SIGKILL from the kernel's OOM killer or a user, a segfault) writes
none, and its peers then fail with "connection reset by peer": only torchrun knows which worker
died and how. This runs torchrun (torch.distributed.run) in this process, as the `torchrun`
command does, and writes REPORT (OUT/ranks/node-K.json) when it ends: its node (SLURM's name, else
the host's), each failed worker's global and local rank, pid and exit code or signal. Output and exit code are torchrun's own,
but for its failure report: when workers fail, torchrun's traceback (ChildFailedError's table of
failures) and its "failed (exitcode ...)" line go to the launcher's log beside REPORT
(OUT/ranks/node-K.log), named in one line on stderr, so that echobench's own line on the cause
(the record's error) is not printed after 30 lines of the launcher's.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from echobench.records.atomic import write_json_atomic
from echobench.train.launch import ignore_stack_signal


def worker_failure(rank: int, failure) -> dict:
    """One failed worker of torchrun's ChildFailedError (a ProcessFailure) as plain JSON."""
    return {"rank": int(rank), "local_rank": failure.local_rank, "pid": failure.pid, "exit_code": failure.exitcode,
            "signal": failure.signal_name() if failure.exitcode < 0 else None}


def launcher_log(report: Path) -> Path:
    """The launcher's log: torchrun's own lines on failed workers (OUT/ranks/node-K.log)."""
    return report.with_suffix(".log")


class IntoLog(logging.Filter):
    """Sends torchrun's "failed (exitcode ...)" lines to the launcher's log instead of stderr."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.getMessage().startswith("failed (exitcode"):
            return True
        with open(self.path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {record.name}: {record.getMessage()}\n")
        return False


def failed_words(failures: list[dict]) -> str:
    """'rank 1 exit code 1, rank 0 SIGKILL': torchrun's failed workers, in one line."""
    return ", ".join(f"rank {w['rank']} " + (w["signal"] or f"exit code {w['exit_code']}") for w in failures)


def main(argv: list[str]) -> None:
    report, torchrun_args = Path(argv[0]), argv[1:]
    if torchrun_args and torchrun_args[0].startswith("--preload="):  # launch.torchrun_command's forked workers
        preload, torchrun_args = torchrun_args[0].removeprefix("--preload=").split(","), torchrun_args[1:]
        # multiprocessing's forkserver imports these once (a module that fails is skipped there: its
        # worker then fails on the same import, with its own error) and forks every worker from them.
        multiprocessing.set_forkserver_preload(preload)
    ignore_stack_signal()  # SLURM's USR1 before the time limit reaches the agent too: it must not end it
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # lazy: after the USR1 guard
    from torch.distributed.run import main as torchrun  # lazy: torch takes seconds, USR1 must not end them

    # The node as SLURM names it (what a user can act on: on the local cluster every node has one host name).
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    note = {"host": socket.gethostname(), "node": node, "ended": "ok", "failures": []}
    log = launcher_log(report)
    log.parent.mkdir(parents=True, exist_ok=True)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(IntoLog(log))
    try:
        torchrun(torchrun_args)
    except ChildFailedError as exc:
        note.update(ended="workers failed", failures=[worker_failure(r, f) for r, f in sorted(exc.failures.items())])
        with open(log, "a") as f:
            f.write(traceback.format_exc())
        print(f"echobench: torchrun on {node}: workers failed ({failed_words(note['failures'])}); torchrun's "
              f"traceback: {log}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except SystemExit as exc:
        if exc.code not in (0, None):
            note["ended"] = f"torchrun exited with code {exc.code}"
        raise
    except BaseException as exc:  # the agent itself stopped (a signal, a rendezvous error): say so
        note.update(ended=f"torchrun stopped: {type(exc).__name__}: {exc}".splitlines()[0][:300])
        raise
    finally:
        stop_forkserver()
        note["at"] = time.time()
        write_json_atomic(report, note)


def stop_forkserver() -> None:
    """Ends the forkserver of forked workers, if one was started, and waits for it: it goes when torchrun
    does, and its CPU (the workers' too) is counted with this process's children, as exec'd workers' is.
    multiprocessing's own stop (private, as its tests use it): nothing where this Python lacks it."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        with contextlib.suppress(OSError):
            stop()


if __name__ == "__main__":
    main(sys.argv[1:])

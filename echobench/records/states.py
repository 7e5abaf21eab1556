"""Where a run stands, in one vocabulary: how it ended (a record's status), what the sweep knows of it
before a record exists, and what its job said (the job-state file it writes, the scheduler's answer).
RunState is a str enum: its values are the words records, sweep.json, job-state files and
`echobench status` have always held, so files written before read the same."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class RunState(StrEnum):
    # how a run ended: a record's status
    OK = "ok"
    OOM = "oom"
    ERROR = "error"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"  # Ctrl-C, scancel, a scheduler's SIGINT
    NODE_FAIL = "node_fail"  # a node (or its launcher) lost
    PREEMPTED = "preempted"  # SLURM PREEMPTED: the cluster took the nodes back, not the user
    # before a record: the sweep's view of a run
    NOT_STARTED = "not started"  # planned, no job ever ran it: the next `sweep` of the matrix runs it
    QUEUED = "queued"  # in this sweep's queue, not yet submitted
    NEW = "new"  # its files, no record and no job
    WAITING = "waiting"  # its files written, no job yet (a submit limit, a busy scheduler): retried
    PENDING = "pending"  # queued
    RUNNING = "running"
    CORRUPT = "corrupt"  # a record that cannot be read: a failure, never new
    UNREADABLE = "unreadable"  # its run.yaml missing or invalid: `status` cannot look at it
    # what a job said before its record: exited (RUN_DIR/job-state), or unknown to the scheduler
    EXITED = "exited"
    GONE = "gone"


# A record's status: how the run ended.
ENDED = (RunState.OK, RunState.OOM, RunState.ERROR, RunState.TIMEOUT, RunState.CANCELLED, RunState.NODE_FAIL,
         RunState.PREEMPTED)
Status = Literal[tuple(state.value for state in ENDED)]  # the record field's type
# A job the scheduler (or this machine) still holds.
ACTIVE = (RunState.PENDING, RunState.RUNNING)

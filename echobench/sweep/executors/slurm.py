"""The SLURM executor: one sbatch script per run (echobench.sweep.executors.slurm_script renders it and
the sweep's own jobs), submitted with `sbatch --parsable`, and the scheduler's answers read back.

A job is tracked by its own status file first (RUN_DIR/job-state), then by one batched sacct per
poll where accounting exists, then one batched squeue, each with its pending reason (NEVER_STARTS:
the reasons of a job that can never start). A job that ended without a record (TIMEOUT, CANCELLED,
NODE_FAIL, OUT_OF_MEMORY, or a crash before the benchmark) gets one from the sweep.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from echobench.records.console import esc
from echobench.sweep.executors import JobState, SubmitLater, calibrated, comm_size, read_job_state, sweep_cache
from echobench.records.paths import comm_calibrated
from echobench.sweep.executors.slurm_script import (comm_log, render_calibration_script, render_comm_calibration_script,
                                              render_script, sbatch_path)
from echobench.records.peaks import table_peak
from echobench.records.rundir import read_job_note
from echobench.records.states import ACTIVE, RunState

# Scheduler states -> record statuses, for a job that is over.
ENDED = {
    "TIMEOUT": RunState.TIMEOUT,
    "DEADLINE": RunState.TIMEOUT,
    "CANCELLED": RunState.CANCELLED,
    "PREEMPTED": RunState.PREEMPTED,  # its own status: the cluster took the nodes back, not the user
    "REVOKED": RunState.CANCELLED,
    "NODE_FAIL": RunState.NODE_FAIL,
    "BOOT_FAIL": RunState.NODE_FAIL,
    "OUT_OF_MEMORY": RunState.OOM,
    "FAILED": RunState.ERROR,
    "COMPLETED": RunState.ERROR,  # completed without a record of its own
    "SPECIAL_EXIT": RunState.ERROR,
}
PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "CONFIGURING", "SUSPENDED",
           "STOPPED", "RESIZING"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}


@dataclass
class SlurmJobFields:
    """What sacct or squeue said of one job."""
    state: str
    detail: str = ""  # sacct: "exit N:S"
    reason: str = ""  # the pending reason, or why it ended
    nodes: str = ""  # its node list


def slurm_field_set(word: str) -> bool:
    """Whether a field of SLURM's says anything: it prints None (or nothing) where it has no reason."""
    return bool(word) and word not in ("None", "(null)", "n/a")


def hostlist(nodes: str) -> list[str]:
    """A SLURM node list (node[1-3],gpu07) as names; the list as given where scontrol cannot expand it."""
    try:
        proc = _run(["scontrol", "show", "hostnames", nodes], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return [nodes]
    return proc.stdout.split() or [nodes]


# Pending reasons of a job that can never start as it is (its own size, the account's used-up budget),
# each with its fix. Others pass with time (Priority, Resources, ReqNodeNotAvail, and the group limits
# on what runs at once, AssocGrpGRES & co, while the group's other jobs run): shown, waited for.
NEVER_STARTS = [
    (r"BadConstraints", "no node has all the job asks for (slurm.constraint, gpus_per_node, mem, cpus): compare "
                        "with sinfo -o '%N %f %G %c %m'"),
    (r"PartitionNodeLimit", "more nodes than the partition allows one job, or than it has up (scontrol show "
                            "partition): fewer nodes, or another slurm.partition"),
    (r"PartitionTimeLimit", "a time limit over the partition's MaxTime: lower slurm.time"),
    (r"(?:QOS|Assoc)Max\w*PerJob\w*", "more than the QOS or account allows one job (sacctmgr show qos, sacctmgr "
                                       "show assoc): fewer nodes, GPUs or time, or another slurm.qos"),
    (r"QOSMin\w+", "less than the QOS's minimum for one job: ask for more, or another slurm.qos"),
    (r"(?:QOS|Assoc)Grp(?!\w*Run)\w*Minutes\w*", "the account's or QOS's budget of minutes is used up (sshare): "
                                                  "another slurm.account, or more budget"),
    (r"InvalidAccount|InvalidQOS|AccountNotAllowed|QOSNotAllowed", "the account or qos is not valid for you there: "
                                                                  "fix slurm.account / slurm.qos"),
    (r"DependencyNeverSatisfied", "a job it waits for failed and the cluster keeps such jobs: see that job's log"),
]


def never_starts(reason: str) -> str | None:
    """The fix, when a pending reason says the job can never start as it is; None otherwise."""
    return next((fix for pattern, fix in NEVER_STARTS if re.fullmatch(pattern, reason or "")), None)


# A sweep driven from inside an allocation (salloc, a batch job; SLURM_JOB_ID set) has that job's
# SLURM_* / SBATCH_* variables, which sbatch reads as options for the new job (as submitit, drop
# them); SLURM_CONF says where the cluster's configuration is, and stays. From a login shell the
# environment goes as it is: SBATCH_ACCOUNT, SBATCH_PARTITION, SBATCH_QOS, SBATCH_RESERVATION
# are the user's own defaults.
SUBMIT_ENV_DROP = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_")


def submit_env(environ=None) -> dict:
    environ = dict(os.environ if environ is None else environ)
    if not environ.get("SLURM_JOB_ID"):
        return environ
    return {k: v for k, v in environ.items() if k == "SLURM_CONF" or not k.startswith(SUBMIT_ENV_DROP)}


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = submit_env() if cmd[0] == "sbatch" else None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


class SlurmError(RuntimeError):
    pass


class SlurmExecutor:
    """Submits with sbatch, reads every tracked job's state in one look per poll (`states`), and
    tells a refusal to retry (a submit limit, a busy scheduler: SubmitLater) from one that is the
    job's own (a bad partition or option: SlurmError, the run's record)."""

    name = "slurm"
    max_active = None  # slurm.max_submitted: the sweep's jobs in the queue at once (None: the scheduler queues them all)
    poll_s = 5.0
    submit_timeout_s = 60.0  # sbatch: past this the job may be queued or not: squeue is asked before anything else
    query_timeout_s = 60.0  # sacct, squeue: past this the look is no news (asked again at the next poll)
    batch = 500  # job ids per sacct / squeue call
    # What sacct prints where the cluster keeps no accounting: then it is never asked again. Any other
    # failure (a timeout, slurmdbd down) is transient: sacct is asked again at the next poll.
    ACCOUNTING_OFF = ("accounting storage is disabled",)
    # sbatch's words for a refusal that is not about the job: a submit limit, a controller too busy.
    SUBMIT_LATER = re.compile(r"MaxSubmitJob|SubmitJobsLimit|submit limit|Socket timed out|temporarily unable|"
                              r"Resource temporarily unavailable|Unable to contact slurm controller|"
                              r"Job violates accounting/QOS policy|Connection (?:refused|timed out|reset)|"
                              r"Transport endpoint is not connected|try again later", re.IGNORECASE)
    # A QOS / association reason named in the refusal: only the submit-count ones pass with time.
    LIMIT_REASON = re.compile(r"\b(?:QOS|Assoc)\w*Limit\b")

    def __init__(self, max_submitted: int | None = None):
        self.max_active = max_submitted
        self.accounting: bool | None = None  # unknown until sacct has answered (False: the cluster has none)
        self.calibration: str | None = None  # the sweep's calibration job: runs without a peak wait for it
        self.comm_calibration: str | None = None  # hardware.calibrate_comm's job: every run waits for it
        self.unsure: set[str] = set()  # job names whose sbatch timed out: looked up in squeue before another
        self.transport: str | None = None  # the network the sweep's preflight saw NCCL choose (into the records)

    def check_dir(self, sweep_dir: Path) -> None:
        sbatch_path(sweep_dir)  # the path goes into #SBATCH lines, which sbatch does not unquote

    def job_script(self, run, run_dir: Path, matrix, time_limit: str, log: Path | None = None) -> str:
        env = dict(matrix.spec.slurm.env)
        if run.cfg.peak_tflops is None:  # where the sweep's calibration job writes (calibrate)
            env.setdefault("ECHOBENCH_CACHE", str(sweep_cache(run_dir.parent)))
        if self.transport:  # what the preflight saw NCCL choose: the record's env.nccl_transport
            env.setdefault("ECHOBENCH_NCCL_TRANSPORT", self.transport)
        return render_script(run.cfg, run_dir, matrix.spec.slurm.model_copy(update={"time": time_limit, "env": env}),
                             log)

    def calibrate(self, sweep_dir: Path, matrix, device: str, log) -> None:
        """One calibration job on a compute node (the login node's device says nothing about the
        nodes'), which the runs without a peak then wait for; none when hardware.device names a
        device with a datasheet peak, or when the sweep has calibrated already."""
        if calibrated(sweep_dir):
            return
        if device_name := matrix.spec.hardware.device:
            if table_peak(device_name):
                return
        script = sweep_dir / "calibrate.sh"
        script.write_text(render_calibration_script(sweep_dir, matrix.spec.slurm, device))
        (sweep_dir / "logs").mkdir(exist_ok=True)
        try:
            self.calibration = self.sbatch(script, "the calibration job")
        except SubmitLater as exc:
            raise ValueError(f"{exc}; nothing submitted: run the sweep again later (or set hardware.peak_tflops "
                             f"in the matrix)") from None
        except SlurmError as exc:
            raise ValueError(f"{exc}; nothing submitted (or set hardware.peak_tflops in the matrix)") from None
        job = esc(self.calibration)
        log(f"no peak_tflops in the matrix: calibrating once on a compute node (job {job}, "
            f"log {esc(sweep_dir / 'logs')}/calibrate-{job}.out); the runs without a peak wait for it")

    def calibrate_comm(self, sweep_dir: Path, matrix, runs, device: str, log, previous: str | None = None) -> str | None:
        """One job on the largest node count of the runs (comm_size), after the GEMM calibration if
        any; every run then waits for it (afterany: whatever becomes of it). An earlier sweep's that is
        still queued or running is waited for instead. A refused submission is said and the runs go on.
        Returns the job's log, which the sweep names should no profile come of it."""
        if comm_calibrated(sweep_dir):
            return None
        if previous and (job := self.states({previous: sweep_dir}).get(previous)) and job.state in ACTIVE:
            self.comm_calibration = previous
            log(f"hardware.calibrate_comm: the profile job {esc(previous)} of an earlier sweep is still {job.state}: "
                f"the runs wait for it")
            return str(comm_log(sweep_dir, previous))
        nodes, nproc = comm_size(runs)
        script = sweep_dir / "calibrate-comm.sh"
        script.write_text(render_comm_calibration_script(sweep_dir, matrix, nodes, nproc, device))
        (sweep_dir / "logs").mkdir(exist_ok=True)
        try:
            # After the GEMM calibration: two calibrations sharing a node would time each other.
            self.comm_calibration = self.sbatch(script, "the comm calibration job", [self.calibration])
        except (SubmitLater, SlurmError) as exc:
            log(f"[red]hardware profile not measured[/]: {esc(exc)}; the runs go on without it")
            return None
        log(f"hardware.calibrate_comm: measuring a hardware profile once on {nodes} node(s) x {nproc} processes (job "
            f"{esc(self.comm_calibration)}, log {esc(comm_log(sweep_dir, self.comm_calibration))}); the runs wait for it")
        return str(comm_log(sweep_dir, self.comm_calibration))

    def submit(self, run, run_dir: Path, time_limit_s: int | None = None) -> str:
        # The time limit is in the script (#SBATCH --time).
        return self.sbatch(run_dir / "job.sh", run.id,
                           [self.calibration if run.cfg.peak_tflops is None else None, self.comm_calibration])

    def sbatch(self, script: Path, what: str, after: Sequence[str | None] = ()) -> str:
        """The job id of `script` once queued. Raises SubmitLater for a refusal that passes with time
        (and for an sbatch that timed out with no job of that name in the queue), SlurmError for one
        that is the job's own. After a timeout the next call looks in squeue before submitting again.
        `after`: the jobs it waits for (None: none)."""
        name = self.job_name(script)
        if name in self.unsure:
            if job_id := self.queued(name, script):
                self.unsure.discard(name)
                return job_id
            self.unsure.discard(name)
        # afterany: the run starts whether or not the calibrations worked (a node with a datasheet peak needs none).
        depend = [f"--dependency=afterany:{':'.join(jobs)}"] if (jobs := [j for j in after if j]) else []
        try:
            proc = _run(["sbatch", "--parsable", *depend, str(script)], timeout=self.submit_timeout_s)
        except FileNotFoundError:
            raise SlurmError("sbatch not found: is this a SLURM login node? (locally: bash scripts/slurm-local.sh up)")
        except subprocess.TimeoutExpired:
            if name is None:
                raise SlurmError(f"sbatch of {what} did not answer within {self.submit_timeout_s:.0f} s") from None
            # The controller may have queued the job all the same: never submit it twice.
            self.unsure.add(name)
            if job_id := self.queued(name, script):
                self.unsure.discard(name)
                return job_id
            raise SubmitLater(f"sbatch did not answer within {self.submit_timeout_s:.0f} s and no job {name} is "
                              f"queued (squeue is asked again before it is submitted again)") from None
        if proc.returncode != 0:
            message = " | ".join(line.strip() for line in (proc.stderr.strip() or proc.stdout.strip()).splitlines())
            if self.refusal_passes(message):
                raise SubmitLater(f"sbatch refused {what} for now: {message}")
            raise SlurmError(f"sbatch rejected {what}: {message}")
        job_id = proc.stdout.strip().split(";")[0]  # "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
        return job_id

    def refusal_passes(self, message: str) -> bool:
        """Whether sbatch's refusal passes with time: a submit-count limit (QOSMaxSubmitJobPerUserLimit,
        AssocMaxSubmitJobLimit, ...) or a scheduler that could not answer. A refusal naming another limit
        (QOSMaxWallDurationPerJobLimit: the job asks for more than the QOS allows) is the job's own."""
        if reasons := self.LIMIT_REASON.findall(message):
            return all("SubmitJob" in reason for reason in reasons)
        return bool(self.SUBMIT_LATER.search(message))

    @staticmethod
    def job_name(script: Path) -> str | None:
        """The #SBATCH --job-name of a job script (the name squeue finds it by), None without one."""
        try:
            found = re.search(r"^#SBATCH --job-name=(\S+)", script.read_text(), re.MULTILINE)
        except OSError:
            return None
        return found.group(1) if found else None

    def queued(self, name: str, script: Path) -> str | None:
        """The job an sbatch that timed out may have queued: its own job-state file, else squeue by
        the job's name (this user's jobs). Raises SubmitLater when squeue does not answer either."""
        if (note := read_job_note(script.parent)) is not None and note.job_id.isdigit():
            return note.job_id
        try:
            proc = _run(["squeue", "-h", "-u", str(os.getuid()), f"--name={name}", "-o", "%i"],
                        timeout=self.query_timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired):
            proc = None
        if proc is None or proc.returncode != 0:
            raise SubmitLater(f"sbatch did not answer within {self.submit_timeout_s:.0f} s, nor did squeue: whether "
                              f"job {name} is queued is asked again before it is submitted again")
        ids = [word for word in proc.stdout.split() if word.isdigit()]
        return max(ids, key=int) if ids else None

    # ---- the scheduler's view: the job's own file, then one sacct, then one squeue for all ----

    def _sacct(self, job_ids: list[str]) -> tuple[dict[str, SlurmJobFields], bool]:
        """({job id: what sacct says}, whether sacct answered). Accounting is switched off only when
        sacct says there is none; any other failure is no answer this time."""
        if self.accounting is False:
            return {}, True
        seen: dict[str, SlurmJobFields] = {}
        for k in range(0, len(job_ids), self.batch):
            chunk = job_ids[k:k + self.batch]
            try:
                proc = _run(["sacct", "-n", "-X", "-P", "-j", ",".join(chunk), "-o", "JobID,State,ExitCode,Reason,NodeList"],
                            timeout=self.query_timeout_s)
            except FileNotFoundError:
                self.accounting = False
                return {}, True
            except subprocess.TimeoutExpired:
                return seen, False
            if proc.returncode != 0:
                if any(words in f"{proc.stderr} {proc.stdout}".lower() for words in self.ACCOUNTING_OFF):
                    self.accounting = False
                    return {}, True
                return seen, False
            self.accounting = True
            for line in proc.stdout.splitlines():
                job_id, state, code, reason, nodes = (line.strip().split("|") + [""] * 4)[:5]
                if job_id in chunk and state.split() and job_id not in seen:
                    # "CANCELLED by 0" -> CANCELLED
                    seen[job_id] = SlurmJobFields(state.split()[0], f"exit {code}" if code else "", reason, nodes)
        return seen, True  # a job missing here is not in the database yet

    def _squeue(self, job_ids: list[str]) -> tuple[dict[str, SlurmJobFields], bool]:
        """({job id: what squeue says}, whether squeue answered): finished jobs too (-t all), for
        MinJobAge after they end. An id the controller no longer knows is left out."""
        seen: dict[str, SlurmJobFields] = {}
        for k in range(0, len(job_ids), self.batch):
            chunk = job_ids[k:k + self.batch]
            try:
                proc = _run(["squeue", "-h", "-t", "all", "-j", ",".join(chunk), "-o", "%i|%T|%r|%N"],
                            timeout=self.query_timeout_s)
            except (FileNotFoundError, subprocess.TimeoutExpired):
                return seen, False
            if proc.returncode != 0:
                if "invalid job id" in proc.stderr.lower():  # one id only, and purged: "Invalid job id specified"
                    continue
                return seen, False
            for line in proc.stdout.splitlines():
                job_id, state, reason, nodes = (line.strip().split("|") + [""] * 3)[:4]
                if job_id in chunk and state:
                    seen[job_id] = SlurmJobFields(state, "", reason, nodes)
        return seen, True

    def states(self, jobs: dict[str, Path]) -> dict[str, JobState]:
        """Every job's state (job id -> run directory) in one look: its own status file first, then
        one sacct for all where accounting exists, then one squeue for the jobs sacct did not know.
        A job neither answered about is left out (no news: asked again at the next poll); it is
        `gone` only when both answered and neither knows it."""
        out: dict[str, JobState] = {}
        ask = []
        for job_id, run_dir in jobs.items():
            own = read_job_state(run_dir, job_id)
            if own is not None and own.state == RunState.EXITED:
                out[job_id] = own
            else:
                ask.append(job_id)
        if not ask:
            return out
        seen, sure = self._sacct(ask)
        if rest := [job_id for job_id in ask if job_id not in seen]:
            more, answered = self._squeue(rest)
            seen.update(more)
            sure = sure and answered
        failed = [seen[j].nodes for j in ask if j in seen and seen[j].state in ("NODE_FAIL", "BOOT_FAIL")]
        down = self.down_nodes(failed) if failed else {}
        for job_id in ask:
            if job_id in seen:
                out[job_id] = self.job_state(job_id, seen[job_id], down)
            elif sure:
                out[job_id] = JobState(RunState.GONE, f"SLURM job {job_id} is unknown to the scheduler (purged?) and left "
                                               f"no exit status")
        return out

    def down_nodes(self, nodelists: list[str]) -> dict[str, str]:
        """{node: "state (reason)"} of the nodes of these node lists that are down, failing or not
        responding (one sinfo for all): the node a NODE_FAIL job lost."""
        try:
            proc = _run(["sinfo", "-h", "-N", "-n", ",".join(n for n in nodelists if n), "-o", "%N|%T|%E"],
                        timeout=self.query_timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return {}
        out = {}
        for line in proc.stdout.splitlines():
            node, state, reason = (line.strip().split("|") + [""] * 2)[:3]
            if re.search(r"down|fail|drain|not_responding|\*", state, re.IGNORECASE):
                out[node] = state + (f" ({reason})" if slurm_field_set(reason) else "")
        return out

    @classmethod
    def job_state(cls, job_id: str, seen: SlurmJobFields, down: dict[str, str] | None = None) -> JobState:
        reason = seen.reason if slurm_field_set(seen.reason) else ""
        words = " ".join(filter(None, [seen.state, f"({reason})" if reason else "", seen.detail]))
        if seen.state in PENDING:
            return JobState(RunState.PENDING, words, reason=reason, never=never_starts(reason) or "")
        if seen.state in RUNNING:
            return JobState(RunState.RUNNING, words)
        why = f"({', '.join(filter(None, [reason, seen.detail]))})" if reason or seen.detail else ""
        lost = [f"{node} {state}" for node, state in (down or {}).items()
                if node in hostlist(seen.nodes)] if seen.state in ("NODE_FAIL", "BOOT_FAIL") else []
        where = f": lost node {', '.join(lost)}" if lost else ""
        return JobState(ENDED.get(seen.state, RunState.ERROR), f"SLURM job {job_id} ended {seen.state} {why}".rstrip() + where)

    def state(self, job_id: str, run_dir: Path) -> JobState:
        """One job's state (the sweep asks `states` for all at once)."""
        return self.states({job_id: run_dir}).get(job_id) or JobState(
            RunState.PENDING, "the scheduler did not answer (sacct / squeue): asked again at the next look")

    def cancel(self, job_ids: list[str]) -> None:
        """scancel of these jobs, in one call. Ids already over are no error (cancelling twice is
        harmless); raises SlurmError when scancel cannot do it."""
        try:
            proc = _run(["scancel", *job_ids], timeout=self.query_timeout_s)
        except FileNotFoundError:
            raise SlurmError("scancel not found: is this a SLURM login node?")
        except subprocess.TimeoutExpired:
            raise SlurmError(f"scancel did not answer within {self.query_timeout_s:.0f} s") from None
        problems = [line.strip() for line in proc.stderr.splitlines() if line.strip() and not re.search(
            r"already completing or completed|Invalid job id", line, re.IGNORECASE)]
        if proc.returncode != 0 and problems:
            raise SlurmError(f"scancel {' '.join(job_ids)}: {' | '.join(problems)}")

    def cancel_all(self) -> list[str]:
        return []  # Ctrl-C while waiting leaves SLURM jobs running (see detach_message; `echobench cancel DIR`)

    def detach_message(self) -> str:
        return "the SLURM jobs keep running: `echobench status DIR` follows them, `echobench cancel DIR` stops them"


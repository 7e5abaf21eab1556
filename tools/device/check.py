"""One prepared measurement pass on a single GPU, made for the lent H200: one device call of at most
10 minutes, on a machine with no network. `tools/device/check.sh OUTDIR` runs it.

The steps, in priority order (steps()): the set-up (the carried wheels installed as the device
installs them, pip --no-index --no-deps --target; the environment; whether triton can build its
launcher, a C compiler and Python.h; shards of realistic lengths for the padded-data run), then the
speed steps: 3B compiled at micro-batch 16 x 4 accumulated in the lean recipe (bf16 master weights,
dropped conditioning without a mask), the same with the key mask, the micro-batch 8 baseline in the
former recipe (fp32 autocast, masked; profiled), float8 rowwise, 800M at its best setting, a
padded-data run from shards, and the headline run on lengths drawn in memory (padded, beside its
synthetic full-length twin); then the `gpu` tests, the kernel probe (tools/device/kernel_probe.py), the eager and
megatron runs, published rows' 1-GPU slices, the device's profile and the other comparisons, while
time is left. No step waits on another that may be skipped (only on the set-up).
Every step has its own limit and the least time worth starting it; one global deadline gives each
step min(its limit, time left - the reserve), and a step that cannot get its minimum, or whose
prerequisite in the set-up failed (no compiler, no shards), is skipped at once with the reason. The
steps marked `always` fit the call with a margin (tests/test_device_check.py checks the sum, and
DEVICE_CHECK_DRY=1 walks the same steps on the CPU with the tiny model). The runs share one
torch.compile cache (inductor's, triton's inside it), packed into OUTDIR at the end.

After every step the summary, the records and the logs archive are rewritten in OUTDIR, so whatever
stops the call still returns them:
  summary.md        steps passed / skipped / failed, every step's figures, the comparisons, and
                    `echobench report --table md` (at the end)
  records.jsonl     one line per step: a run's result.json and breakdown.json, a test's counts
  env.txt           device, driver, versions, carried wheels, knobs, the command, the commit
  trace-NAME.json.gz  the best profiled 3B run's chrome trace
  logs.tar.gz       every step's log and the runs' records
  device-check.log  this script's whole output
  inductor-cache.tar.gz  the runs' torch.compile caches (inductor, triton), for a later call

  tools/device/check.sh OUTDIR                      # on the device (carry .whl)
  DEVICE_CHECK_DRY=1 tools/device/check.sh /tmp/dry  # CPU: the same steps on the tiny model
  tools/device/twin.sh                              # CPU, on the device's versions (the rehearsal)

Knobs: DEVICE_CHECK_DEADLINE_S (default 555 s; dry: 555 x DEVICE_CHECK_SCALE), DEVICE_CHECK_SCALE
(every limit, minimum and the deadline x this; default 1, dry 0.6), DEVICE_CHECK_RESERVE_S (kept
for the closing report, default 30), DEVICE_CHECK_ONLY="NAME ..." (only those steps, besides the
set-up), DEVICE_CHECK_WORK (scratch folder), ECHOBENCH_GIT_COMMIT (the commit, when .git does not
travel; device-check.sh reads it from the file COMMIT if there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout, where every step runs

CALL_S = 600  # what one device call may take
DEADLINE_S = 555  # this script's own end: a margin under the call for the return of the files
RESERVE_S = 30  # kept at the end for the report table and the last summary
PROFILE_S = 45  # the profiled steps' own bound (--trace-limit-s), after the measured steps
END_S = 10  # after a run's limit: the record, the teardown
WHEELS_S, PROBE_S, SHARDS_S = 30, 30, 30  # the set-up's limits: the wheels, the environment probe, the shards
PYTEST_TEST_S = 120  # one gpu test's limit: a compiled tiny model's graph set compiles in about 50 s
SHARDS = "@shards"  # in a step's arguments: the set-up's shards of realistic lengths (make_shards)
SETUP_STEPS = ("wheels", "env", "launcher", "shards")  # set-up lines: never skipped, so a step may need them


@dataclass(frozen=True)
class Step:
    name: str
    kind: str  # run | bare | probe | pytest | calibrate | plan
    args: tuple[str, ...] = ()
    limit_s: float = 60
    min_s: float = 20
    always: bool = False  # part of the budget that must fit the call
    needs: tuple[str, ...] = ()  # steps that must have passed first ("launcher": triton can build)

    @property
    def compiles(self) -> bool:
        return "--compile" in self.args


def steps(dry: bool) -> list[Step]:
    """The device check's steps in the order they run. On the GPU: 3B / 800M at 750 frames; dry:
    the tiny preset at short lengths (96 audio frames and 32 speaker patches: at mb 2 the fp8 step's
    rows are multiples of 16, as 750 frames x mb 8 are on the GPU)."""
    s3, s8, mb, mb2, mb8 = ("tiny", "tiny", 2, 4, 3) if dry else ("3B", "800M", 8, 16, 16)
    shapes = ("--audio-frames", "96", "--text-tokens", "32", "--speaker-frames", "128") if dry else ()
    common = ("--steps", "3", "--warmup-steps", "2", *shapes) if dry else ("--steps", "20", "--warmup-steps", "5")
    # 4 micro-batches a step: fewer steps for as many micro-batches
    accum = ("--steps", "3", "--warmup-steps", "1", *shapes) if dry else ("--steps", "8", "--warmup-steps", "3")
    n3, n8 = s3.lower(), s8.lower()

    def run(name, *args, limit, least, always=False, needs=(), base=common):
        compiled = "--compile" in args
        return Step(name, "run", base + args, limit, least, always, needs + (("launcher",) if compiled else ()))

    # Issue 45: a published row's 1-GPU slice through the same harness, at the row's micro-batch,
    # accumulation, sequence and precision, eager as published (llm-foundry's MPT on H100, FSDP on 8
    # GPUs: one GPU does each rank's work without the collectives). Dry: a small card on the CPU.
    def card(name, row, mb, accum, *, limit, least, always=False):
        where = "tunes/card-small.yaml" if dry else f"validation/published-runs.yaml#{row}"
        return run(name, "--card", where, "--parallelism", "single", "--micro-batch", str(mb), "--grad-accum",
                   str(accum), "--precision", "bf16", "--no-compile", limit=limit, least=least, always=always,
                   base=("--steps", "3", "--warmup-steps", "1") if dry else ("--steps", "6", "--warmup-steps", "2"))

    def bare(name, *args, limit, least, needs=()):
        compiled = "--compile" in args
        return Step(name, "bare", common + args, limit, least, False, needs + (("launcher",) if compiled else ()))

    cal = ("--scale", s3, "--micro-batch", str(mb)) + (("--audio-frames", "96") if dry else ())
    probe = ("--scale", s3, "--micro-batch", str(mb)) + (
        ("--audio-frames", "96", "--text-tokens", "32", "--speaker-frames", "128", "--iters", "3", "--warmup", "1")
        if dry else ())
    # The speed steps first (3B compiled at micro-batch 16 x 4 accumulated, the lean recipe: bf16
    # master weights, dropped conditioning unmasked; the same with the key mask; the micro-batch 8
    # baseline in the former recipe, profiled; float8 rowwise; 800M at its best setting; a padded-data
    # run), none waiting on another: each compiles what it needs (the inductor cache under OUTDIR
    # makes a later one's compile shorter, and comes back).
    return [
        Step("calibrate", "calibrate", cal, 40, 15, always=True),
        run(f"{n3}-compile-mb{mb2}-accum4", "--scale", s3, "--compile", "--micro-batch", str(mb2), "--grad-accum", "4",
            limit=200, least=120, always=True, base=accum),
        run(f"{n3}-compile-mb{mb2}-accum4-masked", "--scale", s3, "--compile", "--micro-batch", str(mb2),
            "--grad-accum", "4", "--cfg-drop-attention", "masked", limit=170, least=90, always=True,
            base=accum),
        run(f"{n3}-compile-mb{mb}-baseline", "--scale", s3, "--compile", "--micro-batch", str(mb), "--master-weights",
            "fp32-autocast", "--cfg-drop-attention", "masked", "--trace", limit=200, least=110, always=True),
        run(f"{n3}-fp8-rowwise-compile-mb{mb2}-accum4", "--scale", s3, "--compile", "--precision", "fp8",
            "--float8-recipe", "rowwise", "--micro-batch", str(mb2), "--grad-accum", "4", limit=200, least=110,
            base=accum),
        run(f"{n8}-compile-mb{mb8}-accum4", "--scale", s8, "--compile", "--micro-batch", str(mb8), "--grad-accum", "4",
            limit=150, least=80, base=accum),
        # Data like a user's (echobench data synth's lengths, made in the set-up): every micro-batch padded.
        run(f"{n3}-compile-mb{mb}-padded", "--scale", s3, "--compile", "--micro-batch", str(mb), "--data", SHARDS,
            limit=150, least=90, needs=("shards",)),
        # The headline run on the same lengths drawn in memory (no I/O), beside its synthetic full-length
        # twin: what padding costs the lean recipe (the records' padding share and attention path mix).
        run(f"{n3}-compile-mb{mb2}-accum4-drawn", "--scale", s3, "--compile", "--micro-batch", str(mb2),
            "--grad-accum", "4", "--synthetic-lengths", "drawn", limit=170, least=90, base=accum),
        # Per test a limit that a compiled model's graphs fit (PYTEST_TEST_S).
        Step("pytest-gpu", "pytest", ("-m", "gpu"), 150, 60),
        # What the CPU cannot show: SDPA's choice and each attention kernel's time at the run's
        # shapes, a block eager vs compiled, a fused AdamW step (tools/device/kernel_probe.py).
        Step("kernel-probe", "probe", probe, 100, 30, needs=("launcher",)),
        run(f"{n3}-eager-mb{mb}", "--scale", s3, "--no-compile", "--micro-batch", str(mb), limit=90, least=35),
        run(f"{n3}-megatron-tp1-mb{mb}", "--scale", s3, "--framework", "megatron", "--parallelism", "tp1",
            "--no-compile", "--micro-batch", str(mb), limit=90, least=35),
        card("card-mpt-1b-h100-s8192", "lf-mpt-1b-h100-8gpu-s8192", 2 if dry else 3, 4, limit=110, least=40),
        # A measured hardware profile of the device (GEMMs at the 3B shapes, attention, memory
        # bandwidth; one process: no collectives) for `predict --profile`, in place of the datasheet's.
        Step("calibrate-profile", "profile", cal + ("--budget-s", "3" if dry else "8", "--comm-budget-s", "1"), 90, 40),
        card("card-mpt-3b-h100-s512", "lf-mpt-3b-h100-8gpu-s512", 4 if dry else 40, 6, limit=120, least=55),
        bare(f"bare-{n3}-compile-mb{mb}", "--scale", s3, "--compile", "--micro-batch", str(mb), limit=90, least=40),
        run(f"{n3}-fp8-compile-mb{mb}", "--scale", s3, "--compile", "--precision", "fp8", "--micro-batch", str(mb),
            limit=180, least=100),
        run(f"{n3}-compile-sac-mb{mb}", "--scale", s3, "--compile", "--ac", "selective", "--micro-batch", str(mb),
            limit=180, least=100),
        run(f"{n8}-eager-mb{mb8}", "--scale", s8, "--no-compile", "--micro-batch", str(mb8), limit=70, least=35),
        bare(f"bare-{n3}-eager-mb{mb}", "--scale", s3, "--micro-batch", str(mb), limit=60, least=30),
        run(f"{n3}-eager-sac-mb{mb}", "--scale", s3, "--no-compile", "--ac", "selective", "--micro-batch", str(mb),
            limit=70, least=40),
        run(f"{n3}-eager-mb{mb2}", "--scale", s3, "--no-compile", "--micro-batch", str(mb2), limit=70, least=35),
        Step("plan-h200-single", "plan", ("matrices/h200-single.yaml", "--json"), 30, 10),
    ]


def always_minimum_s(dry: bool = False) -> float:
    """The least time the always-attempted steps take, set-up excluded."""
    return sum(s.min_s for s in steps(dry) if s.always)


# ---- the pass ----

@dataclass
class Check:
    out: Path
    work: Path
    dry: bool
    scale: float
    deadline: float
    reserve: float
    only: set[str]
    python: str = sys.executable
    start: float = field(default_factory=time.monotonic)
    outcome: dict[str, str] = field(default_factory=dict)  # step -> passed | failed | skipped
    launcher_reason: str = ""  # why compile steps cannot run ("" when they can)

    @property
    def records(self) -> Path:
        return self.out / "records.jsonl"

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.start)

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.start:.0f}s] {text}"
        print(line, flush=True)
        with open(self.out / "device-check.log", "a") as f:
            f.write(line + "\n")

    def echobench(self, *args: str) -> list[str]:
        return [self.python, "-m", "echobench", *args]

    def execute(self, cmd: list[str], log: Path, limit: float, stdout: Path | None = None) -> tuple[int, float]:
        """Runs cmd with its output in log (stdout apart, where given); past `limit` its whole process
        group is stopped (rc 124)."""
        t0 = time.monotonic()
        with open(log, "w") as f, open(stdout or os.devnull, "w") as g:
            f.write("$ " + shlex.join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=g if stdout else f, stderr=subprocess.STDOUT if stdout is None else f,
                                    cwd=ROOT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                stop_group(proc)
                rc = 124
        return rc, time.monotonic() - t0

    def note(self, **line) -> None:
        """One record line, then the summary and the archive again (a kill keeps what is here)."""
        from tools.device import summary  # lazy: after main puts the carried wheels on sys.path

        try:
            self.outcome[line["name"]] = summary.add_line(self.records, **line)["outcome"]
        except Exception as exc:  # noqa: BLE001 - bookkeeping must not end the pass
            self.say(f"could not record {line.get('name')}: {type(exc).__name__}: {exc}")
            self.outcome[line["name"]] = "failed"
        self.write_summary()

    def write_summary(self, final: bool = False) -> None:
        from tools.device import summary  # lazy: after main puts the carried wheels on sys.path

        try:
            summary.write_summary(self.records, self.out / "summary.md", self.work / "env.txt",
                                         self.work / "report-table.md" if final else None,
                                         wall_s=time.monotonic() - self.start)
        except Exception as exc:  # noqa: BLE001
            self.say(f"summary not written: {type(exc).__name__}: {exc}")
        try:
            pack_logs(self.work, self.out / "logs.tar.gz")
        except Exception as exc:  # noqa: BLE001
            self.say(f"logs not packed: {type(exc).__name__}: {exc}")

    def skip(self, step: Step, why: str) -> None:
        self.say(f"skip {step.name}: {why}")
        self.note(kind="skipped", name=step.name, command=" ".join(step.args), note=why)

    def run_step(self, step: Step) -> None:
        for need in step.needs:
            if need == "launcher":
                if self.launcher_reason:
                    return self.skip(step, self.launcher_reason)
            elif self.outcome.get(need) != "passed":
                return self.skip(step, f"{need} {self.outcome.get(need) or 'did not run'}")
        limit = min(step.limit_s * self.scale, self.left() - self.reserve)
        least = step.min_s * self.scale
        if limit < least:
            return self.skip(step, f"time: {max(limit, 0):.0f} s left for it, it needs {least:.0f} s")
        log = self.work / "logs" / f"{step.name}.log"
        extra: dict = {}
        args = tuple(str(self.work / "shards") if a == SHARDS else a for a in step.args)
        if step.kind == "run":
            run_dir = self.work / "runs" / step.name
            profile_s = PROFILE_S * self.scale if "--trace" in step.args else 0
            # The run stops itself at its limit (status timeout, record written) before the backstop;
            # the profiled steps after the measured ones have their own bound.
            cmd = self.echobench("run", *args, "--time-limit-s", f"{limit - END_S - profile_s:.0f}",
                                 *(("--trace-limit-s", f"{profile_s:.0f}") if profile_s else ()),
                                 "--out", str(run_dir))
            extra["run_dir"] = run_dir
        elif step.kind == "bare":
            result = self.work / "bare" / f"{step.name}.json"
            cmd = [self.python, "-m", "tools.device.bare_step", *step.args, "--json", str(result)]
            extra["file"] = result
        elif step.kind == "calibrate":
            result = self.work / "calibrate.json"
            cmd = self.echobench("calibrate", *step.args, "--json")
            extra["file"] = result
        elif step.kind == "profile":
            result = self.work / "profile.yaml"
            cmd = self.echobench("calibrate", "--comm", "--nproc", "1", *step.args, "--out", str(result))
            extra["file"] = result
        elif step.kind == "probe":
            result = self.work / "kernel-probe.json"
            cmd = [self.python, "-m", "tools.device.kernel_probe", *step.args, "--json", str(result)]
            extra["file"] = result
        elif step.kind == "plan":
            cmd = self.echobench("plan", *step.args)
        elif step.kind == "pytest":
            # One stuck test must not take the others' time (pytest-timeout is on the image).
            per_test = (("--timeout", f"{min(PYTEST_TEST_S * self.scale, limit):.0f}")
                        if importlib.util.find_spec("pytest_timeout") else ())
            # -v names each test as it ends; ECHOBENCH_LIVE_FAILURES (set in main) prints a failure's cause at once.
            cmd = [self.python, "-m", "pytest", *step.args, *per_test, "-v", "-p", "no:cacheprovider", "tests"]
        else:
            raise ValueError(step.kind)
        self.say(f"== {step.name} (limit {limit:.0f} s)")
        rc, wall = self.execute(cmd, log, limit, stdout=extra["file"] if step.kind == "calibrate" else None)
        tail = (log.read_text().strip().splitlines()[-1:] if log.exists() else []) or [""]
        if step.kind == "calibrate" and extra["file"].exists():
            tail = [calibration_line(extra["file"])]
        self.note(kind=step.kind, name=step.name, command=shlex.join(cmd), rc=rc, wall_s=round(wall, 1),
                  limit_s=round(limit), log=log, **extra)
        self.say(f"   {self.outcome.get(step.name)} (exit {rc}) in {wall:.0f} s: {tail[0][:160]}")
        if step.kind == "run" and "--trace" in step.args and self.outcome.get(step.name) == "passed":
            self.pack_trace()

    def pack_trace(self) -> None:
        from tools.device import summary  # lazy: after main puts the carried wheels on sys.path

        try:
            self.say(summary.pack_trace(self.records, self.out, scale="tiny" if self.dry else "3B"))
        except Exception as exc:  # noqa: BLE001
            self.say(f"trace not packed: {type(exc).__name__}: {exc}")


def calibration_line(path: Path) -> str:
    try:
        r = json.loads(path.read_text())
        return f"{r['device']} {r['dtype']} ceiling {r['tflops']:.4g} TFLOP/s ({r.get('best_shape', 'square')})"
    except (OSError, ValueError, KeyError) as exc:
        return f"no calibration record: {type(exc).__name__}: {exc}"


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group (the run writes its record on it), SIGKILL 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def pack_logs(work: Path, dest: Path) -> None:
    """The logs, the environment and every run's records into one archive, replaced atomically."""
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in ("logs", "env.txt", "report-table.md", "calibrate.json", "kernel-probe.json", "profile.yaml", "bare"):
            if (work / name).exists():
                tar.add(work / name, arcname=name)
        for run in sorted((work / "runs").glob("*")):
            for part in ("result.json", "breakdown.json", "plan.json"):
                if (run / part).exists():
                    tar.add(run / part, arcname=f"runs/{run.name}/{part}")
    tmp.replace(dest)


def pack_cache(cache: Path, dest: Path, check: Check) -> None:
    """torch.compile's caches (inductor's, triton's inside it) as one archive in OUTDIR, for a later
    call to start warm (TORCHINDUCTOR_CACHE_DIR unpacked there); none where nothing compiled."""
    if not cache.is_dir() or not any(cache.iterdir()):
        return
    try:
        with tarfile.open(dest, "w:gz") as tar:
            tar.add(cache, arcname="inductor")
        check.say(f"compile caches: {dest.name}, {dest.stat().st_size / 2**20:.1f} MiB")
    except OSError as exc:
        check.say(f"compile caches not packed: {exc}")


def launcher_problem() -> str | None:
    """Why triton (or, on CPU, inductor's C++ backend) could not build its launcher: no C compiler,
    or no Python.h. None when both are there."""
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not cc or not shutil.which(cc.split()[0]):
        return "no C compiler (cc, gcc or clang; or $CC): torch.compile cannot build triton's launcher"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return f"no {header}: torch.compile cannot build triton's launcher (install the Python headers)"
    return None


def install_wheels(check: Check, site: Path) -> None:
    """The carried wheels as the device installs them; a wheel that does not land there fails the step."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        check.note(kind="setup", name="wheels", rc=1, note="no .whl/ here: run tools/device/wheels.sh and carry .whl")
        return
    cmd = [check.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *map(str, wheels)]
    rc, wall = check.execute(cmd, check.work / "logs" / "pip-install.log", min(WHEELS_S, check.left()))
    landed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    missing = [w.name for w in wheels if w.name.split("-")[0].lower() not in landed]
    note = f"{len(wheels) - len(missing)} of {len(wheels)} carried wheels installed" + (
        f"; not installed: {', '.join(missing)} (logs/pip-install.log)" if missing else "")
    check.note(kind="setup", name="wheels", command=shlex.join(cmd), rc=rc if not missing else (rc or 1),
               wall_s=round(wall, 1), note=note)
    check.say(note)


ENV_PROBE = r"""
import importlib, platform, sys
from importlib import metadata
print("python", platform.python_version(), sys.executable)
for dist in ("torch", "triton", "transformers", "numpy", "pandas", "typer", "rich", "pyyaml", "jinja2", "narwhals",
             "megatron-core", "torchao", "plotly", "pydantic", "pydantic-core", "typing-extensions", "pytest"):
    try:
        print(f"{dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        print(f"{dist} absent")
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
from echobench.hardware.device import git_commit
print("echobench commit", git_commit())
# What the runs and the report import: a failure here names the missing piece before the runs.
for mod in ("echobench.cli", "echobench.train.bench", "echobench.report", "echobench.sweep.matrix", "megatron.core", "torchao.float8"):
    try:
        importlib.import_module(mod)
        print(f"import {mod}: ok")
    except Exception as exc:  # noqa: BLE001
        print(f"import {mod}: FAILED {type(exc).__name__}: {exc}")
"""


def record_env(check: Check, command: str) -> None:
    env = check.work / "env.txt"
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.sm,"
                          "temperature.gpu,power.limit", "--format=csv"], capture_output=True, text=True) \
        if shutil.which("nvidia-smi") else None
    wheels = "".join(f"  {p.stat().st_size / 2**20:7.2f} MiB  {p.name}\n" for p in sorted((ROOT / ".whl").glob("*.whl")))
    head = (f"date: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\ncommand: {command}\n"
            f"host: {os.uname().nodename}\n"
            f"knobs: dry={int(check.dry)} scale {check.scale:g} deadline {check.deadline:.0f}s reserve "
            f"{check.reserve:.0f}s only='{' '.join(sorted(check.only))}'\n"
            + (smi.stdout if smi and smi.returncode == 0 else "nvidia-smi: none\n")
            + "carried wheels:\n" + wheels)
    env.write_text(head)
    script = check.work / "env_probe.py"
    script.write_text(ENV_PROBE)
    rc, wall = check.execute([check.python, str(script)], check.work / "logs" / "env-probe.log",
                             min(PROBE_S, check.left()))
    probe = (check.work / "logs" / "env-probe.log").read_text().split("\n", 1)[-1]
    env.write_text(head + probe)
    shutil.copy(env, check.out / "env.txt")
    failed = [ln for ln in probe.splitlines() if ln.startswith("import ") and ": FAILED" in ln]
    if rc and not failed:
        failed = [f"the probe failed (exit {rc}): {probe.strip().splitlines()[-1:] or ''}"]
    check.note(kind="setup", name="env", rc=rc if not failed else (rc or 1), wall_s=round(wall, 1),
               note="; ".join(failed)[:300] or "every import ok")
    print(env.read_text(), flush=True)


def make_shards(check: Check) -> None:
    """The padded-data run's shards: `echobench data synth` (lengths drawn as docs/explanation/data.md
    states), at most as long as the runs' audio frames (96 dry, 750 on the GPU: 25 frames/s)."""
    seconds = "3.84" if check.dry else "30"
    cmd = check.echobench("data", "synth", "--out", str(check.work / "shards"), "--shards", "2",
                          "--samples-per-shard", "48", "--max-seconds", seconds)
    rc, wall = check.execute(cmd, check.work / "logs" / "shards.log", min(SHARDS_S * check.scale, check.left()))
    check.note(kind="setup", name="shards", command=shlex.join(cmd), rc=rc, wall_s=round(wall, 1),
               note="96 samples of realistic lengths" if rc == 0 else "no shards: the padded-data run is skipped")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):  # `--help` is not a folder to fill for 10 minutes
        print("usage: python3 -m tools.device.check OUTDIR   (DEVICE_CHECK_DRY=1 for the CPU pass)", file=sys.stderr)
        return 0 if argv in (["-h"], ["--help"]) else 2
    dry = bool(os.environ.get("DEVICE_CHECK_DRY"))
    scale = float(os.environ.get("DEVICE_CHECK_SCALE") or (0.6 if dry else 1.0))
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in ("records.jsonl", "summary.md", "device-check.log", "logs.tar.gz"):
        (out / old).unlink(missing_ok=True)
    for old in out.glob("trace-*.json.gz"):
        old.unlink()
    work = Path(os.environ.get("DEVICE_CHECK_WORK") or tempfile.mkdtemp(prefix="echobench-device."))
    for sub in ("runs", "logs", "bare"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    check = Check(out=out, work=work, dry=dry, scale=scale,
                  deadline=float(os.environ.get("DEVICE_CHECK_DEADLINE_S") or DEADLINE_S * scale),
                  reserve=float(os.environ.get("DEVICE_CHECK_RESERVE_S") or RESERVE_S),
                  only=set((os.environ.get("DEVICE_CHECK_ONLY") or "").split()))
    os.environ.update(PYTHONUNBUFFERED="1", ECHOBENCH_CACHE=str(work / "cache"), ECHOBENCH_LIVE_FAILURES="1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))  # one cache for every run
    os.environ.setdefault("TRITON_CACHE_DIR", str(work / "inductor" / "triton"))
    if not dry:
        os.environ["ECHOBENCH_REQUIRE_GPU"] = "1"  # a gpu test that finds no CUDA fails instead of skipping
    command = f"{'DEVICE_CHECK_DRY=1 ' if dry else ''}tools/device/check.sh {argv[0]}"
    check.say(f"device check: {'dry run (CPU, tiny model)' if dry else 'GPU'}; deadline {check.deadline:.0f} s, "
              f"scratch {work}")

    site = work / "site"
    install_wheels(check, site)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(ROOT), os.environ.get("PYTHONPATH")]))
    sys.path[:0] = [str(site), str(ROOT)]
    record_env(check, command)
    problem = launcher_problem()
    check.launcher_reason = problem or ""
    check.note(kind="setup", name="launcher", rc=1 if problem else 0,
               note=problem or "a C compiler and Python.h: triton can build its launcher")
    make_shards(check)

    for step in steps(dry):
        if check.only and step.name not in check.only:
            continue
        check.run_step(step)
        if step.kind == "calibrate" and dry and check.outcome.get("calibrate") == "passed":
            # fp8 runs take bf16 as their peak dtype: a CPU has no datasheet entry, so calibrate it too.
            check.execute(check.echobench("calibrate", "--dtype", "bf16", "--size", "256", "--iters", "5", "--json"),
                          work / "logs" / "calibrate-bf16.log", min(60, check.left()))
    check.say("steps done")

    # The closing table, within the reserve.
    table = work / "report-table.md"
    rc, wall = check.execute(check.echobench("report", str(work / "runs"), "--table", "md"), work / "logs" / "report.log",
                             max(5, min(40, check.left())), stdout=table)
    errors = (work / "logs" / "report.log").read_text().strip().splitlines()[1:]
    if rc:
        table.write_text(f"(echobench report failed, exit {rc}: {errors[-1][:200] if errors else 'see logs/report.log'})\n")
    check.note(kind="report", name="report", command="echobench report RUNS --table md", rc=rc, wall_s=round(wall, 1),
               note=errors[-1][:200] if rc and errors else "")
    check.write_summary(final=True)
    pack_cache(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]), out / "inductor-cache.tar.gz", check)
    print((out / "summary.md").read_text(), flush=True)
    check.say(f"done; files in {out}: {' '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

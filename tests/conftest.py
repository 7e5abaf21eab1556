import contextlib
import fcntl
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
# A model card's tiny decoder, for the tests whose assertions hold for any workload of the one
# measured loop (launch, rendezvous, queue, failure paths): its ranks import no text encoder, some
# 2 CPU s less a rank than Echo's tiny preset (reports/suite-census-2026-12-07.md).
TINY_CARD = str(FIXTURES / "tiny-card.yaml")
# Read before any test compiles: inductor writes its default into os.environ on first use.
INDUCTOR_CACHE_SET = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def cli_env(tmp_path: Path | None = None, gpu: bool = False) -> dict:
    """The environment of the commands a test starts. Unless the test is a `gpu` one, they see no
    GPU: runs, calibrations, sweeps and SLURM jobs then pick the CPU, and the suite measures and
    asserts the same things (fp32, gloo, a CPU device name) on a GPU host as on a CPU one."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # A SLURM sweep polls every 5 s, backing off to 60 s: on the local cluster a test would wait that long
    # to hear of a job that has ended. Polling stays 2 s apart here (the local cluster answers at no cost).
    env.setdefault("ECHOBENCH_MAX_POLL_S", "2")
    if tmp_path is not None:
        env["ECHOBENCH_CACHE"] = str(tmp_path / "cache")  # calibrations stay inside the test
        share_counts(tmp_path / "cache")
    return env


# The element-wise byte counts predict makes for GPU runs (echobench.predict.elementwise): computed,
# not measured, keyed by what they depend on and their sources' hash, some 12 s of CPU each. Every
# test's cache shares this folder, kept across sessions as the inductor cache is (inductor_cache).
SHARED_COUNTS = Path(tempfile.gettempdir()) / f"echobench-tests-{os.getuid()}" / "elementwise"


def share_counts(cache: Path) -> None:
    """CACHE/elementwise: the suite's shared counts (SHARED_COUNTS)."""
    SHARED_COUNTS.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not (link := cache / "elementwise").exists():
        link.symlink_to(SHARED_COUNTS, target_is_directory=True)


# For runs whose losses a test holds against another layout's: one thread per process in both, so
# that the order of the floating-point sums does not follow the machine's core count.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def run_cli(*args, tmp_path: Path | None = None, timeout: float = 600, check: bool = False,
            gpu: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python -m echobench ARGS` as a user would, from this checkout (on the CPU unless gpu);
    `env` adds to its environment."""
    proc = subprocess.run([sys.executable, "-m", "echobench", *map(str, args)], capture_output=True, text=True,
                          env={**cli_env(tmp_path, gpu), **(env or {})}, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"echobench {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


# The signals tests send to the processes they start.
SIGNALS_TESTS_SEND = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def default_signals() -> None:
    """preexec_fn of a process a test will signal: those signals at their default action and none
    blocked, whatever the suite inherited. A POSIX shell starts a background job with SIGINT
    ignored; Python then leaves it ignored and every child inherits that, so a test that sends
    SIGINT to a child it did not set up would test how the suite was launched, not the code."""
    for sig in SIGNALS_TESTS_SEND:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def ignoring_sigint() -> None:
    """preexec_fn of a process started as a background job of a non-interactive shell is: SIGINT
    ignored (the other signals tests send at their default)."""
    default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def sigint_disposition(pid: int) -> str:
    """What process `pid` does with SIGINT, read from the kernel: ignored, caught (a handler: Python's
    KeyboardInterrupt) or default."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    bit = 1 << (signal.SIGINT - 1)
    if int(fields["SigIgn"], 16) & bit:
        return "ignored"
    return "caught" if int(fields["SigCgt"], 16) & bit else "default"


def wait_for(check, timeout_s: float = 300, every_s: float = 1.0):
    """check()'s first true value, asked every `every_s`. The limit only guards against a hang: a
    test waits on the state it needs, never on how long the machine should take to reach it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every_s)
    raise AssertionError(f"not within {timeout_s} s: {check.__doc__ or check}")


def record(out: Path) -> dict:
    """The record a run wrote to OUT (its result.json), as plain JSON."""
    return json.loads((Path(out) / "result.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_launchers(args: list, env: dict, timeout: float = 600) -> tuple[list[int], list[str]]:
    """`echobench run ARGS --nproc 1 --nnodes 2` as node ranks 0 and 1 on this machine, as srun
    starts them on two nodes: (their exit codes, their outputs). The master port is a free one;
    should another process take it before torchrun binds it, the pair runs again on another."""
    for _ in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "echobench", "run", *map(str, args), "--nproc", "1", "--nnodes", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port)]
        procs = [subprocess.Popen([*cmd, "--node-rank", str(rank)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        if not any("address already in use" in out.lower() for out in outputs):
            break
    return [p.returncode for p in procs], outputs


def one_gloo_rank() -> None:
    """In a spawned worker: a process group of this one process on gloo (megatron initialises
    process groups), one thread, its warnings silenced. Its store is in memory: no port to race for."""
    import torch

    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)


def counted_model_flops(counter) -> int:
    """FlopCounterMode's total without the text encoder's rotary angle table: transformers 5.17 (the
    H200 image's) builds it as a matmul (inv_freq x positions, a few hundred FLOPs per sample),
    later releases elementwise. It is not model work, and the FLOP model leaves it out."""
    counts = counter.get_flop_counts()
    tables = [name for name in counts if ".text_encoder." in name and "rotary" in name.rsplit(".", 1)[-1]]
    outermost = [t for t in tables if not any(t.startswith(o + ".") for o in tables)]
    return counter.get_total_flops() - sum(sum(counts[t].values()) for t in outermost)


def pytest_runtest_setup(item):
    """Tests marked `gpu` run only where torch sees a CUDA device: elsewhere they are skipped, or,
    with ECHOBENCH_REQUIRE_GPU=1 (a GPU check), they fail, so that none can pass unrun."""
    if "gpu" not in item.keywords:
        return
    import torch

    if torch.cuda.is_available():
        return
    if os.environ.get("ECHOBENCH_REQUIRE_GPU") == "1":
        pytest.fail("ECHOBENCH_REQUIRE_GPU=1 but torch sees no CUDA device", pytrace=False)
    pytest.skip("needs a CUDA GPU")


@pytest.fixture
def cli(tmp_path):
    def _run(*args, **kw):
        return run_cli(*args, tmp_path=tmp_path, **kw)

    return _run


def inductor_cache_dir(tmp_path_factory) -> str:
    """The folder inductor_cache sets, for a fixture that outlives a test (it cannot take that one)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return INDUCTOR_CACHE_SET or str(base.parent / "inductor")


@pytest.fixture
def inductor_cache(tmp_path_factory, monkeypatch) -> Path:
    """TORCHINDUCTOR_CACHE_DIR for compiled runs: the one set outside (tools/device/check.sh's) if any,
    else one per user kept across test sessions, so a rerun finds the graphs compiled (a cold
    compile of the block kinds takes a minute or more on a CPU)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: a worker's own (popen-gwN) inside the session's
        base = base.parent
    path = INDUCTOR_CACHE_SET or str(base.parent / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", path)
    return Path(path)


@pytest.fixture(scope="session")
def smoke_sweep(tmp_path_factory):
    """One real local sweep of matrices/smoke.yaml, shared by the sweep and report tests.

    Returns (sweep dir, the completed `echobench sweep` process, wall seconds).
    """
    import time

    root = tmp_path_factory.mktemp("smoke")
    sweep = root / "smoke"
    t0 = time.time()
    proc = run_cli("sweep", ROOT / "matrices" / "smoke.yaml", "--out", sweep, tmp_path=root, timeout=1200)
    return sweep, proc, time.time() - t0


@pytest.fixture(scope="session")
def failing_sweep(tmp_path_factory):
    """One real local sweep of tiny runs that fail in each way a local run can, beside one that
    ends well; shared by the tests that read one (tests/test_sweep_local.py, tests/test_exit_codes.py):
    seed 0 ok, seed 1 an error injected at step 2, seed 2 hung past its 25 s limit (timeout), and a
    combination skipped (torchtitan has no tp2). A test that changes the sweep works on a copy of it.
    What they read is the sweep's and the launcher's, whatever is trained: a model card's tiny decoder.

    Returns (the matrix, the sweep dir, the completed `echobench sweep` process).
    """
    root = tmp_path_factory.mktemp("failing")
    matrix, sweep = root / "m.yaml", root / "sweep"
    matrix.write_text(json.dumps({
        "name": "t", "executor": "local", "hardware": {"peak_tflops": 0.5}, "local": {"time": "00:05:00"},
        "slurm": {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False},  # `--executor slurm` plans it too
        "defaults": {"card": TINY_CARD, "steps": 3, "warmup_steps": 1, "micro_batch": 2},
        "include": [
            {"seed": 0},                                    # ok
            {"seed": 1, "fail_at_step": 2},                 # error, injected at step 2
            {"seed": 2, "fail_at_step": 1, "fail_kind": "hang", "time_limit": "0:25"},  # outlives its 25 s limit
            {"parallelism": "tp2"},                         # skipped: torchtitan has no TP
        ]}))
    proc = run_cli("sweep", matrix, "--out", sweep, tmp_path=root, timeout=600)
    return matrix, sweep, proc


def smoke_run(sweep: Path, **settings) -> Path:
    """The directory of the smoke sweep's one run whose record has these settings."""
    (run,) = (p.parent for p in sorted(sweep.glob("*/result.json"))
              if all(record(p.parent)[k] == v for k, v in settings.items()))
    return run


@pytest.fixture(scope="session")
def profiled_runs(smoke_sweep):
    """Traced runs of Echo, shared by the tests that read a profiled run (tests/test_breakdown.py,
    tests/test_device_check.py), which do not change them: the smoke sweep's single process and its
    DDP over 2 gloo processes (matrices/smoke.yaml traces every run, against this machine's calibration)."""
    sweep, proc, _ = smoke_sweep
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"single": smoke_run(sweep, framework="torchtitan", parallelism="single", ac="none"),
            "ddp": smoke_run(sweep, parallelism="ddp")}


@pytest.fixture(scope="session")
def card_ddp_run(tmp_path_factory):
    """One DDP run of a model card's decoder over 2 gloo processes with --trace and a peak given, at
    tests/test_card_runs.py's settings (3 steps, no warm-up, one thread per process), which holds its
    losses against one process at the same global batch; tests/test_breakdown.py reads its trace.
    Neither changes it."""
    from test_card_runs import write_card

    root = tmp_path_factory.mktemp("card-ddp")
    out = root / "run"
    proc = run_cli("run", "--card", write_card(root / "card.yaml"), "--trace", "--steps", "3", "--warmup-steps", "0",
                   "--micro-batch", "2", "--peak-tflops", "1", "--nproc", "2", "--parallelism", "ddp", "--out", out,
                   tmp_path=root, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


# ---- running the suite in parallel (pytest -n N --dist loadgroup: scripts/test.sh) ----

# Machine-wide, as the local SLURM cluster is: every pytest worker, and any other pytest here, opens it.
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "echobench-slurm-cluster.lock"


@contextlib.contextmanager
def cluster_lock(exclusive: bool = False):
    """The local SLURM cluster, shared by the `slurm` tests that run at once (they submit their own
    jobs, which the nodes' CPUs hold side by side), or the whole of it for one marked
    `cluster_exclusive` (it kills a node, and with it any other test's job there)."""
    with open(CLUSTER_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield  # closing the file releases it


def cpu_seconds() -> float:
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A `slurm` test holds the cluster (cluster_lock) through its setup, call and teardown, module
    fixtures set up or torn down with it included. With ECHOBENCH_TEST_TIMELINE=FILE, each test's
    worker, start, end and CPU seconds go to FILE (tools/suite_timeline.py reads it: which worker ended
    last, why). The CPU is the worker's and its waited-for subprocesses' (not a SLURM job's)."""
    start, cpu = time.time(), cpu_seconds()
    try:
        if "slurm" not in item.keywords:
            return (yield)
        with cluster_lock(exclusive="cluster_exclusive" in item.keywords):
            return (yield)
    finally:
        if timeline := os.environ.get("ECHOBENCH_TEST_TIMELINE"):
            line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "test": item.nodeid,
                    "start": start, "end": time.time(), "cpu_s": round(cpu_seconds() - cpu, 2)}
            with open(timeline, "a") as f:  # one short line per write: appends from workers do not interleave
                f.write(json.dumps(line) + "\n")


def shared_fixtures(item) -> set[str]:
    """The fixtures of this suite that ITEM uses and that outlive a test (module, class or session
    scope): a test that shares one with another runs in the same pytest-xdist worker, so that the
    fixture (a sweep, a compile, a launched run) is made once, not once per worker."""
    names = set()
    info = getattr(item, "_fixtureinfo", None)  # none on items other than test functions
    for defs in (info.name2fixturedefs.values() if info else ()):
        for fd in defs:
            try:
                source = Path(inspect.getsourcefile(fd.func)).resolve()
            except TypeError:  # a builtin
                continue
            if fd.scope != "function" and source.is_relative_to(ROOT / "tests"):
                names.add(f"{fd.scope}:{fd.baseid}:{fd.argname}" if fd.scope != "session" else f"session:{fd.argname}")
    return names


def explicit_groups(item) -> set[str]:
    return {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which turns the xdist_group marks into groups
def pytest_collection_modifyitems(config, items):
    """For pytest-xdist's --dist loadgroup: tests that share a fixture that outlives a test, or an
    xdist_group mark, make one group (one worker runs it, in collection order); the rest are spread
    one by one. Modules with `slurm` tests go first: most of their time is waiting for the cluster,
    which then overlaps the CPU-bound tests instead of trailing them."""
    parent = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    def union(a, b):
        a, b = find(a), find(b)
        if a != b:  # an explicit group's name names the whole
            parent[b if a.startswith("group:") else a] = a if a.startswith("group:") else b

    keys = {}
    for item in items:
        keys[item.nodeid] = own = sorted(shared_fixtures(item) | {f"group:{g}" for g in explicit_groups(item)})
        for key in own:
            union(own[0], key)
    for item in items:
        if not keys[item.nodeid]:
            continue
        name = find(keys[item.nodeid][0]).removeprefix("group:")
        if explicit := explicit_groups(item):  # pytest-xdist names the group after every mark
            if explicit != {name}:
                raise pytest.UsageError(f"{item.nodeid}: xdist_group {sorted(explicit)} but shares a fixture with group {name}")
        else:
            item.add_marker(pytest.mark.xdist_group(name))
    first = {item.module.__name__ for item in items if "slurm" in item.keywords and getattr(item, "module", None)}
    items.sort(key=lambda item: 0 if getattr(getattr(item, "module", None), "__name__", None) in first else 1)


def pytest_runtest_logreport(report):
    """ECHOBENCH_LIVE_FAILURES=1 (the device check's test step): each failure's traceback printed as it
    happens, so that a step stopped at its limit still shows why a test failed (pytest prints them at
    the end; on the lent GPU, 2026-12-04, the limit came first and a failure's cause was lost)."""
    if report.failed and os.environ.get("ECHOBENCH_LIVE_FAILURES"):
        print(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-4000:]}",
              flush=True)

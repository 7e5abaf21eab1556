"""The checks a job runs on its nodes before any training: `python -m echobench.train.nodecheck COMMAND`.

    first      every job, on its first node before the ranks start: the interpreter imports
               echobench's run path and the run's backends, sees the GPUs the job expects, has
               numactl for numa_binding and CPUs for its processes. Exit 1 on the first failure.
    node       the preflight job (echobench.sweep.preflight), once per node: the same and more (GPU
               architecture, a tiny compile, the network interfaces named), then an all-reduce
               across every node's processes (NCCL on GPUs with NCCL_DEBUG=INFO, from whose lines
               the network NCCL chose is read and held against the fabric; gloo on CPUs).
    collective a torchrun worker of `node`: forms the process group and times the all-reduce.

Each check prints one line, `echobench-check {json}` (name, ok / failed / skipped, what was seen
and the fix): the sweep reads them from the job's log, so they arrive even where the sweep
directory is not mounted. Only the standard library (and echobench's stdlib-only modules) is
imported before the import check has run: a node missing echobench's dependencies still says
which.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from echobench.train.fabric import launch_env, nccl_transport, transport_problem
from echobench.records.peaks import table_peak

MARK = "echobench-check"
# What `echobench run` imports on a node: its command line, the measured loop, the launcher and the
# torchtitan backend; an Echo run also its text encoder's T5Gemma2 (transformers >= 5), which a model
# card's decoder does not import (some 2.7 s of CPU a job on a CPU node).
RUN_PATH = ("yaml", "typer", "rich", "pydantic", "numpy", "torch",
            "echobench.cli", "echobench.train.bench", "echobench.train.launch", "echobench.train.torchrun", "echobench.backends.torchtitan")
ECHO_IMPORTS = ("transformers.models.t5gemma2.modeling_t5gemma2",)
INSTALL_FIX = ("install echobench's dependencies where $PYTHON runs (pip install -e ECHOBENCH_CHECKOUT into that "
               "venv, or an image with them: docs/guides/cluster.md), or point slurm.python / slurm.setup "
               "at an environment that has them")


def backend_imports(framework: str, te: str = "auto", precision: str = "auto", echo: bool = True) -> list[str]:
    """What a run of these settings imports on its nodes beyond RUN_PATH: Echo's text encoder (echo:
    not a card's decoder) and its backends."""
    extra = list(ECHO_IMPORTS) if echo else []
    if framework == "megatron":
        extra += ["megatron.core", "echobench.backends.megatron"]
    if framework == "megatron" and te == "on":
        extra.append("transformer_engine.pytorch")
    if precision == "fp8":
        extra.append("torchao.float8")
    return extra


def run_imports(cfg) -> list[str]:
    """backend_imports of a run's settings (a RunConfig): what its nodes import beyond RUN_PATH."""
    return backend_imports(cfg.framework, cfg.te, cfg.precision, echo=cfg.card is None)


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped (not meaningful here)
    detail: str
    fix: str = ""
    seen: str | None = None  # the value found, where others use it (the transport: into every record)

    def show(self, node: int | None = None, host: str | None = None) -> None:
        """One line in the log (stdout, flushed: srun -u forwards it at once)."""
        line = {**asdict(self), "node": node, "host": host or socket.gethostname()}
        sys.stdout.write(f"{MARK} {json.dumps(line)}\n")  # one write: srun passes a line through whole
        sys.stdout.flush()


# ---- the checks, each one small function ----

def check_imports(modules: list[str]) -> Check:
    """Every module of `modules`, imported in this interpreter; its version where it has one."""
    failed, seen = [], []
    for name in modules:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # megatron-core warns at import about TE / Apex
                module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a module may raise anything at import
            failed.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0][:200])
            continue
        if "." not in name and (version := getattr(module, "__version__", None)):
            seen.append(f"{name} {version}")
    where = f"{sys.executable} (Python {sys.version.split()[0]})"
    if failed:
        return Check("imports", False, f"{where} cannot import {'; '.join(failed)}", INSTALL_FIX)
    return Check("imports", True, f"{where}: {len(modules)} modules of the run path ({', '.join(seen)})")


def check_gpus(expect: bool, count: int, device: str | None) -> Check:
    """torch is a CUDA build that sees `count` GPUs, named like hardware.device, whose architecture the
    build has kernels for."""
    import torch  # lazy: after check_imports, which says a missing torch in a line

    build = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    if not expect:
        return Check("gpus", None, f"{build}: the runs use no GPU")
    if torch.version.cuda is None:
        return Check("gpus", False, f"{build} is a CPU build", "install a CUDA build of torch in that environment "
                     "(scripts/setup.sh on a GPU node, or ECHOBENCH_SETUP_GPU=1 on a login node)")
    seen = torch.cuda.device_count()
    if seen < count:
        why = os.environ.get("CUDA_VISIBLE_DEVICES")
        return Check("gpus", False, f"{build} sees {seen} GPU(s), the runs need {count} per node"
                     + (f" (CUDA_VISIBLE_DEVICES={why})" if why is not None else ""),
                     "ask for the GPUs (slurm.gpus_per_node, request_gpus) and check the driver (nvidia-smi)")
    names = sorted({torch.cuda.get_device_name(i) for i in range(seen)})
    if device and not same_device(names, device):
        return Check("gpus", False, f"{', '.join(names)}, not {device} (hardware.device)",
                     "run on the partition / constraint that has those GPUs, or fix hardware.device")
    archs = torch.cuda.get_arch_list()
    missing = sorted({f"sm_{a}{b}" for a, b in (torch.cuda.get_device_capability(i) for i in range(seen))
                      if f"sm_{a}{b}" not in archs and f"compute_{a}{b}" not in archs})
    if missing:
        return Check("gpus", False, f"{build} has no kernels for {', '.join(missing)} (built for {' '.join(archs)})",
                     "install a torch build for this GPU (PyTorch's cu128 or newer index)")
    return Check("gpus", True, f"{build}: {seen} x {', '.join(names)} ({' '.join(archs)})")


def check_cpus(cpus: str | None, nproc: int) -> Check:
    """The CPUs SLURM gave this node's task, against the processes it starts."""
    if not cpus:
        return Check("cpus", None, "not under SLURM: no CPU count to check")
    if int(cpus) < nproc:
        return Check("cpus", False, f"{cpus} CPU(s) for {nproc} processes per node: they would share them",
                     f"ask for at least {nproc} (slurm.cpus_per_task or cpus_per_gpu; by hand: sbatch "
                     f"--cpus-per-task={8 * nproc})")
    return Check("cpus", True, f"{cpus} CPU(s) for {nproc} processes per node")


def check_numactl(binding: str | None) -> Check:
    if not binding:
        return Check("numactl", None, "no numa_binding")
    if path := shutil.which("numactl"):
        return Check("numactl", True, f"numa_binding={binding}: {path}")
    return Check("numactl", False, f"numa_binding={binding} needs the numactl command, and this node has none "
                 f"(torchrun does not fall back)", "install numactl on the nodes (in the image), or drop "
                 "slurm.numa_binding")


def check_compile(wanted: bool, device: str) -> Check:
    """A tiny torch.compile on the runs' device: triton on a GPU (its launcher needs a C compiler and
    Python.h), inductor's C++ on a CPU."""
    if not wanted:
        return Check("compile", None, "no run compiles")
    import torch  # lazy: as in check_gpus

    dev = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    try:
        fn = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1)
        x = torch.randn(64, 64, device=dev)
        ok = torch.allclose(fn(x), torch.nn.functional.gelu(x) * 2 + 1)
    except Exception as exc:  # noqa: BLE001 - inductor and triton raise many kinds
        return Check("compile", False, f"torch.compile on {dev}: {type(exc).__name__}: {exc}".splitlines()[0][:300],
                     "a C compiler and Python's headers on the nodes (triton builds its launcher), or runs "
                     "without compile")
    return Check("compile", bool(ok), f"torch.compile of a tiny function on {dev} ({'triton' if dev == 'cuda' else 'C++'})")


def interfaces_missing(spec: str, names: set[str], prefixes: bool) -> list[str]:
    """The interfaces a NCCL_SOCKET_IFNAME (prefixes; '=' exact; '^' excludes) or GLOO_SOCKET_IFNAME
    (exact names) value asks for that this node lacks."""
    if spec.startswith("^"):
        return []  # an exclusion list asks for nothing
    exact = spec.startswith("=") or not prefixes
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    return [w for w in wanted if not any(n == w or (not exact and n.startswith(w)) for n in names)]


def check_interfaces(environ) -> Check:
    names = {name for _, name in socket.if_nameindex()}
    missing = [f"{key}={environ[key]}" for key, prefixes in (("NCCL_SOCKET_IFNAME", True), ("GLOO_SOCKET_IFNAME", False))
               if environ.get(key) and interfaces_missing(environ[key], names, prefixes)]
    if missing:
        return Check("interfaces", False, f"{'; '.join(missing)}: no such interface here (this node has "
                     f"{', '.join(sorted(names))})", "set the variable in slurm.env to one of this node's interfaces")
    return Check("interfaces", True, f"{', '.join(sorted(names))}")


def source_identity() -> dict:
    """This interpreter's echobench: its version, its commit (None where its copy is not a git checkout)
    and where it is imported from. The submitter's goes into the preflight's spec, each node's is held
    against it (check_source)."""
    import echobench
    from echobench.hardware.device import git_commit  # lazy: torch, once the import check has passed

    return {"version": echobench.__version__, "commit": git_commit(), "path": str(Path(echobench.__file__).parent)}


def _identity_text(ident: dict) -> str:
    commit = f"commit {ident['commit'][:12]}" if ident.get("commit") else "no commit known"
    return f"echobench {ident['version']} ({commit})" + (f" from {ident['path']}" if ident.get("path") else "")


def check_source(want: dict | None) -> Check:
    """The node's echobench against the submitter's (`want`, source_identity there): the same version,
    and the same commit where both copies know theirs (an installed copy may not)."""
    have = source_identity()
    if want is None:
        return Check("echobench", None, f"{_identity_text(have)}; the submitter's not given")
    commits = have["commit"] and want.get("commit")
    if have["version"] != want.get("version") or (commits and have["commit"] != want["commit"]):
        return Check("echobench", False, f"{_identity_text(have)}, but the submitter runs {_identity_text(want)}",
                     "install the submitter's echobench where $PYTHON runs (slurm.venv, the image), or name "
                     "its checkout in slurm.pythonpath", seen=have["version"])
    return Check("echobench", True, f"{_identity_text(have)}, as the submitter's")


def check_rendezvous(master_addr: str) -> Check:
    """Whether this node resolves the address the nodes meet at (slurm.rendezvous), before torchrun
    would wait for a rank that can never come."""
    try:
        found = sorted({info[4][0] for info in socket.getaddrinfo(master_addr, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError) as exc:
        return Check("rendezvous", False, f"MASTER_ADDR {master_addr} does not resolve on this node ({exc})",
                     "set slurm.rendezvous to a name every node resolves (a suffix such as the InfiniBand "
                     "name's, an interface whose address to meet at, or a command that prints the address), "
                     "or leave it out to meet at the first node's name")
    return Check("rendezvous", True, f"MASTER_ADDR {master_addr} resolves to {', '.join(found)}")


# ---- first: every job's check on its first node ----

def first(args) -> int:
    checks = [check_imports([*RUN_PATH, *filter(None, args.imports.split(","))]),
              check_cpus(args.cpus, args.nproc), check_numactl(os.environ.get("ECHOBENCH_NUMA_BINDING"))]
    if checks[0].ok:
        checks.insert(1, check_gpus(bool(args.expect_gpu), args.nproc, None))
    for check in checks:
        if check.ok is False:
            print(f"echobench: the first-node check failed: {check.name}: {check.detail}; fix: {check.fix}",
                  file=sys.stderr, flush=True)
            return 1
    print(f"echobench job: {'; '.join(f'{c.name}: {c.detail}' for c in checks)}", flush=True)
    return 0


# ---- node: the preflight job, on each node ----

def node(args) -> int:
    spec = json.loads(args.spec)
    checks = [check_imports(spec["imports"])]
    torch_ok = _importable("torch")
    if torch_ok:
        checks += [check_source(spec.get("echobench")),
                   check_gpus(spec["expect_gpus"], spec["nproc"], spec.get("device_name"))]
    checks += [check_cpus(os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE"),
                          spec["nproc"]),
               check_numactl(spec.get("numa_binding")), check_interfaces(os.environ)]
    if torch_ok:
        checks.append(check_compile(spec.get("compile", False), spec["device"]))
    for check in checks:
        check.show(args.node_rank)
    if not torch_ok:
        return 1  # no collective without torch; a non-zero exit ends the other nodes' wait (srun --kill-on-bad-exit)
    if args.nnodes > 1:
        (rendezvous := check_rendezvous(args.master_addr)).show(args.node_rank)
        if rendezvous.ok is False:
            return 1  # as above: no node waits for the rest at an address that does not resolve
    collective, transport = collective_checks(spec, args)
    for check in (collective, transport):
        check.show(args.node_rank)
    # Past the collective no node waits for another: a failed check here is in the lines, and exiting 0
    # keeps srun --kill-on-bad-exit from ending a slower node before it has said its own.
    return 1 if collective.ok is False else 0


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - whatever it raises, it does not import
        return False
    return True


def same_device(names: list[str], device: str) -> bool:
    """Whether every GPU name is the device hardware.device names (by its datasheet row)."""
    want = table_peak(device)
    return want is None or all((table_peak(n) or (None, None))[1] == want[1] for n in names)


def collective_checks(spec: dict, args) -> list[Check]:
    """torchrun with this node's processes (NCCL's INFO lines to files here), every rank all-reducing
    across the nodes; then what the ranks of this node saw, and the network NCCL chose."""
    import torch  # lazy: as in check_gpus

    device = "cuda" if spec["device"] != "cpu" and torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="echobench-preflight-") as tmp:
        env = {**os.environ, "ECHOBENCH_CHECK_OUT": tmp, "PYTHONPATH": _source_path()}
        if device == "cuda":  # as the runs' launchers set it (launch.child_env), and NCCL's lines to read
            env.update(launch_env(spec["fabric"], env, tuple(torch.cuda.nccl.version())))
            env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=f"{tmp}/nccl.%h.%p.log")
        rendezvous = ([f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", f"--master-addr={args.master_addr}",
                       f"--master-port={args.master_port}"] if args.nnodes > 1 else ["--standalone"])
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec['nproc']}", *rendezvous,
               "-m", "echobench.train.nodecheck", "collective", "--device", device, "--bytes", str(spec["bytes"])]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=spec["timeout_s"])
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess(cmd, 124, "", f"no answer within {spec['timeout_s']} s")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank-*.json"))]
        nccl_log = "\n".join(p.read_text(errors="replace") for p in sorted(Path(tmp).glob("nccl.*.log")))
    backend = ranks[0]["backend"] if ranks else "nccl" if device == "cuda" else "gloo"  # what the ranks ran
    return [collective_check(proc, ranks, args.nnodes), transport_check(nccl_log, spec["fabric"], backend, args.nnodes)]


def _source_path() -> str:
    root = str(Path(__file__).resolve().parents[2])
    return root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")


def collective_check(proc, ranks: list[dict], nnodes: int) -> Check:
    failed = [r for r in ranks if not r.get("ok")]
    if proc.returncode != 0 or failed or not ranks:
        why = (failed[0]["error"] if failed else
               " | ".join(line for line in (proc.stderr or proc.stdout).strip().splitlines()[-3:]))
        return Check("collective", False, f"all_reduce across {nnodes} node(s) failed: {why}"[:600],
                     "see the job's log; a rank that never came: the nodes cannot reach MASTER_ADDR:MASTER_PORT "
                     "(firewall, interface), or a node's check above failed")
    r = ranks[0]
    return Check("collective", True, f"all_reduce of {r['bytes'] / 2**20:.3g} MiB over {r['world']} ranks on "
                 f"{nnodes} node(s) ({r['backend']}): {r['seconds'] * 1e3:.3g} ms, bus bandwidth "
                 f"{r['busbw_gbps']:.3g} GB/s")


def transport_check(nccl_log: str, fabric: str | None, backend: str, nnodes: int) -> Check:
    """The network NCCL chose (from its INFO lines), held against the matrix's fabric across nodes;
    under another process-group backend (gloo on CPUs) that backend, and no NCCL transport."""
    if backend != "nccl":
        return Check("transport", None, f"{backend}: the ranks ran no NCCL, so no NCCL transport to read "
                     "(meaningful on GPU nodes)")
    found = nccl_transport(nccl_log)
    if found.network is None:
        return Check("transport", False if nnodes > 1 else None, "NCCL printed no network line with NCCL_DEBUG=INFO",
                     "see NCCL's warnings in the job's log")
    if nnodes > 1 and (problem := transport_problem(fabric, found)):
        return Check("transport", False, *problem)
    return Check("transport", True, f"{found.label} (fabric {fabric or 'not named'})", seen=found.label)


# ---- collective: a torchrun worker ----

def collective(args) -> int:
    import torch  # lazy: as in check_gpus
    import torch.distributed as dist  # lazy: as in check_gpus

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(os.environ["ECHOBENCH_CHECK_OUT"]) / f"rank-{rank}.json"
    gpu = args.device != "cpu" and torch.cuda.is_available()
    note = {"rank": rank, "world": world, "backend": "nccl" if gpu else "gloo", "ok": False}
    try:
        if gpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(note["backend"], timeout=datetime.timedelta(seconds=120))
        x = torch.ones(args.bytes // 4, device="cuda" if gpu else "cpu")
        dist.all_reduce(x)  # warm-up: NCCL connects here
        times = []
        for _ in range(5):
            x.fill_(1.0)
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if not bool((x == world).all()):
            raise RuntimeError(f"all_reduce gave {x[0].item()}, expected {world}")
        seconds = sorted(times)[len(times) // 2]
        note.update(ok=True, bytes=x.numel() * 4, seconds=seconds,
                    busbw_gbps=2 * (world - 1) / world * x.numel() * 4 / seconds / 1e9)
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - any failure becomes this rank's line
        note["error"] = f"rank {rank} ({socket.gethostname()}): {type(exc).__name__}: {exc}".splitlines()[0][:400]
    out.write_text(json.dumps(note))
    return 0 if note["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m echobench.train.nodecheck")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("first")
    p.add_argument("--expect-gpu", type=int, default=0)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--cpus", default=None)
    p.add_argument("--imports", default="", help="modules to import beyond the run path, comma-separated")
    p = sub.add_parser("node")
    p.add_argument("--spec", required=True)
    for name in ("--node-rank", "--nnodes", "--master-port"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p = sub.add_parser("collective")
    p.add_argument("--device", default="auto")
    p.add_argument("--bytes", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    return {"first": first, "node": node, "collective": collective}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

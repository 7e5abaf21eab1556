"""A stub job for the tests of the SLURM queue (submit limits, max_submitted, cancel, Ctrl-C, exit
codes): a real sbatch job on the local cluster, through the real job script, whose run writes a
canned record instead of training a model. What those tests assert is what the sweep does with the
scheduler; a trained model adds CPU (some 15 s a tiny run) and nothing they look at. (tests/test_slurm.py keeps
real SLURM sweeps that train.)

`stub_python(DIR)` writes an interpreter to give as the matrix's slurm.python: the job script's
`$PYTHON -m echobench run ...` runs this file instead, anything else (the first-node check, the
preflight's node check) the real interpreter. Run as a script, this file is that stand-in run: on
node 0 it writes a record with no figures, recorded_by STUB_BY, so that it can never be read as a
measurement; `--hang` keeps the job running until it is cancelled, as a long run does.
"""

import argparse
import socket
import sys
import time
from pathlib import Path

STUB_BY = "a stub job of echobench's test suite (tests/stubjob.py): nothing was trained or measured"


def stub_python(folder: Path, hang: bool = False) -> Path:
    """An interpreter for slurm.python whose `-m echobench run` is this file's stand-in run
    (`hang`: one that runs until cancelled)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("python-hang" if hang else "python-stub")
    run = f"{sys.executable} {Path(__file__).resolve()}{' --hang' if hang else ''}"
    path.write_text(f"""#!/bin/bash
if [ "${{1:-}}" = -m ] && [ "${{2:-}}" = echobench ] && [ "${{3:-}}" = run ]; then
  shift 3
  exec {run} "$@"
fi
exec {sys.executable} "$@"
""")
    path.chmod(0o755)
    return path


def main() -> None:
    import yaml

    from echobench.records.config import RunConfig
    from echobench.records.results import Env, Record, now_iso
    from echobench.records.states import RunState

    ap = argparse.ArgumentParser()
    ap.add_argument("--hang", action="store_true")
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    args, _ = ap.parse_known_args()  # the rendezvous: nothing meets here
    cfg = RunConfig.from_dict({**yaml.safe_load(args.config.read_text()), "gpus_per_node": args.nproc,
                               "nodes": args.nnodes})
    print(f"node {args.node_rank}: {STUB_BY}", flush=True)
    if args.hang:
        while True:  # until scancel's SIGTERM
            time.sleep(1)
    if args.node_rank == 0:
        env = Env(time=now_iso(), hostname=socket.gethostname(), recorded_by=STUB_BY)
        Record.without_run(cfg, RunState.OK, "", env=env).save(args.out)


if __name__ == "__main__":
    main()

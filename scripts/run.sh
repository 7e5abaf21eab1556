#!/bin/bash
#SBATCH --ntasks-per-node=1
#SBATCH --output=slurm-%j.out
#SBATCH --no-requeue
#SBATCH --signal=USR1@120
# One echobench run under SLURM, by hand (what `echobench sweep --executor slurm` renders per run):
#   sbatch --nodes=4 --gpus-per-node=4 --cpus-per-task=32 --time=00:30:00 scripts/run.sh RUN.yaml [OUT_DIR]
# RUN.yaml holds run settings (RunConfig keys, e.g. a sweep's RUN_DIR/run.yaml). One launcher per
# node starts NPROC processes with torchrun (default: the GPUs SLURM gave each node, else 1), and
# needs a CPU per process: without --cpus-per-task the job has one and is refused at once, naming it.
# Node 0 writes OUT_DIR/result.json (default runs/job-JOBID). PYTHON: the interpreter with echobench
# installed (default: python on PATH; sbatch passes your environment on). IMPORTS: modules beyond
# the run path for the first-node check (megatron.core for --framework megatron). USR1 two minutes
# before the time limit makes every rank dump its stacks into the log.
set -euo pipefail
RUN_CONFIG=${1:?usage: sbatch --nodes=N scripts/run.sh RUN.yaml [OUT_DIR]}
RUN_DIR=${2:-runs/job-$SLURM_JOB_ID}
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-1}}
MASTER_PORT=${MASTER_PORT:-$(( 29500 + SLURM_JOB_ID % 2000 ))}  # below the ephemeral ports
PYTHON=${PYTHON:-python}
EXPECT_GPU=${EXPECT_GPU:-$([ -n "${SLURM_GPUS_ON_NODE:-}" ] && echo 1 || echo 0)}
IMPORTS=${IMPORTS:-}
# No container by hand (`echobench plan --script` writes a run's job.sh with the matrix's container and srun_args).
SRUN_ARGS=() IN_CONTAINER=() ON_FIRST_NODE=()
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)${EB_RENDEZVOUS_SUFFIX:-}
if [ -n "${EB_RENDEZVOUS_COMMAND:-}" ]; then
  MASTER_ADDR=$(eval "$EB_RENDEZVOUS_COMMAND" | sed -n 1p)
  [ -n "$MASTER_ADDR" ] || { echo "echobench: slurm.rendezvous.command printed no address: $EB_RENDEZVOUS_COMMAND" >&2; exit 1; }
elif [ -n "${EB_RENDEZVOUS_INTERFACE:-}" ]; then
  MASTER_ADDR=$( (ip -4 -o addr show dev "$EB_RENDEZVOUS_INTERFACE" 2>/dev/null || true) | awk '{split($4, a, "/"); print a[1]}' | sed -n 1p)
  [ -n "$MASTER_ADDR" ] || { echo "echobench: slurm.rendezvous.interface $EB_RENDEZVOUS_INTERFACE has no IPv4 address on $(hostname) (ip -4 addr lists the node's interfaces)" >&2; exit 1; }
fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # logs as they happen; a crash dumps its stack
mkdir -p "$RUN_DIR"
echo "running $SLURM_JOB_ID $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
set +e
# First node, before the ranks start (echobench.train.nodecheck): $PYTHON imports echobench's run path and the run's
# backends (IMPORTS), sees a GPU when the job expects them (EXPECT_GPU=1), has a CPU per process and numactl
# for numa_binding; a wrong environment fails here, in seconds. In a container or uenv the check runs there
# (ON_FIRST_NODE: an srun with the job's environment options).
${ON_FIRST_NODE[@]+"${ON_FIRST_NODE[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} "$PYTHON" -m echobench.train.nodecheck first \
    --expect-gpu "${EXPECT_GPU:-0}" --nproc "$NPROC" --cpus "${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}" \
    --imports "${IMPORTS:-}"
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "echobench: the first-node check failed (exit $rc): the line above says what and the fix ($PYTHON, from slurm.python or slurm.setup, runs every rank)" >&2
else
  # One launcher per node, with every CPU of the job's task; each takes its node rank from SLURM_NODEID (not
  # from host names). Output labelled by node (-l) and unbuffered (-u). A launcher that fails has srun stop the
  # others at once (--kill-on-bad-exit: SIGTERM, SIGKILL after KillWait; node 0's then writes the record from
  # the files the ranks and nodes left); after one that ends well the others get 60 s (--wait), so a node
  # hanging in teardown does not hold the job. USR1 (SLURM's, before the time limit) is ignored but by the
  # ranks, which dump their stacks on it.
  srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}" --kill-on-bad-exit=1 \
    --wait=60 -l -u ${SRUN_ARGS[@]+"${SRUN_ARGS[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} bash -c \
    'trap "" USR1; exec "$0" -m echobench run --config "$1" --out "$2" --nproc "$3" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --master-addr "$4" --master-port "$5"' \
    "$PYTHON" "$RUN_CONFIG" "$RUN_DIR" "$NPROC" "$MASTER_ADDR" "$MASTER_PORT"
  rc=$?
fi
set -e
echo "exited $SLURM_JOB_ID $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
exit $rc

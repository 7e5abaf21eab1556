#!/bin/bash
#SBATCH --ntasks-per-node=1
#SBATCH --output=slurm-%j.out
#SBATCH --no-requeue
# One echobench run under SLURM, by hand (what `echobench sweep --executor slurm` renders per run):
#   sbatch --nodes=4 --gpus-per-node=4 --time=00:30:00 scripts/run.sh RUN.yaml [OUT_DIR]
# RUN.yaml holds run settings (RunConfig keys, e.g. a sweep's RUN_DIR/run.yaml). One launcher per
# node starts NPROC processes with torchrun (default: the GPUs SLURM gave each node, else 1);
# node 0 writes OUT_DIR/result.json (default runs/job-JOBID). PYTHON: the interpreter with
# echobench installed (default: python on PATH; sbatch passes your environment on).
set -euo pipefail
RUN_CONFIG=${1:?usage: sbatch --nodes=N scripts/run.sh RUN.yaml [OUT_DIR]}
RUN_DIR=${2:-runs/job-$SLURM_JOB_ID}
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-1}}
MASTER_PORT=${MASTER_PORT:-$(( 29500 + SLURM_JOB_ID % 10000 ))}
PYTHON=${PYTHON:-python}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
mkdir -p "$RUN_DIR"
echo "running $SLURM_JOB_ID $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
set +e
# One launcher per node; each takes its node rank from SLURM_NODEID (not from host names).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
  'exec "$0" -m echobench run --config "$1" --out "$2" --nproc "$3" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --master-addr "$4" --master-port "$5"' \
  "$PYTHON" "$RUN_CONFIG" "$RUN_DIR" "$NPROC" "$MASTER_ADDR" "$MASTER_PORT"
rc=$?
set -e
echo "exited $SLURM_JOB_ID $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
exit $rc

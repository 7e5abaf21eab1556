#!/usr/bin/env bash
# Creates .venv (if needed) and installs echobench with its extras into it, with the torch build
# that fits this machine (torch_args):
#   - NVIDIA GPU, x86_64: torch from PyPI, whose x86_64 wheels are CUDA builds.
#   - NVIDIA GPU, aarch64 (GH200, GB200): PyTorch's cu128 index; older PyPI releases have only CPU
#     builds for aarch64. cu128 has sm_90 (GH200) and sm_100 (GB200) and runs on R570+ drivers.
#   - no GPU: the CPU build, pinned first so nothing pulls a CUDA build: on this project's machines
#     `torch==2.13.0` is that CPU build; elsewhere set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
# TORCH_INDEX_URL, when set, replaces the index in every case (cu130 for R580+ drivers, ...).
# The GPU is what `nvidia-smi -L` finds here: on a login node without one, for GPU compute nodes,
# set ECHOBENCH_SETUP_GPU=1 (0: as if none). ECHOBENCH_SETUP_ARCH overrides `uname -m`.
# Afterwards, a GPU that torch cannot use fails setup, naming the fix; where no driver answers (a
# login node set up for GPU nodes), torch must be a CUDA build with kernels for ECHOBENCH_SETUP_SM
# (default sm_90: H100, H200, GH200).
#   scripts/setup.sh [--dry-run | --check]   # --dry-run: print the torch install, do nothing;
#                                            # --check: only check the venv's torch against the GPU
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ECHOBENCH_VENV:-.venv}
CUDA_INDEX=https://download.pytorch.org/whl/cu128  # CUDA builds of torch for x86_64 and aarch64

has_gpu() {
  case "${ECHOBENCH_SETUP_GPU:-}" in
    1) return 0 ;;
    0) return 1 ;;
  esac
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

is_aarch64() {
  case "${ECHOBENCH_SETUP_ARCH:-$(uname -m)}" in
    aarch64 | arm64) return 0 ;;
    *) return 1 ;;
  esac
}

# The pip arguments that install torch here, one a line.
torch_args() {
  local index=${TORCH_INDEX_URL:-}
  if has_gpu; then
    echo "torch>=2.6"
    if is_aarch64; then index=${index:-$CUDA_INDEX}; fi
  else
    echo "torch==2.13.0"
  fi
  if [ -n "$index" ]; then printf '%s\n' --index-url "$index"; fi
}

driver_here() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# Fails, in one line, where this machine has a GPU that the torch of python $1 cannot use; where it is
# set up for GPU nodes without a driver here, where torch is no CUDA build for them.
check_torch() {
  has_gpu || return 0
  local driver=0
  if driver_here; then driver=1; fi
  DRIVER=$driver SM=${ECHOBENCH_SETUP_SM:-sm_90} FIX="TORCH_INDEX_URL=$CUDA_INDEX scripts/setup.sh" "$1" -c '
import os, sys, torch
fix, sm = os.environ["FIX"], os.environ["SM"]
if os.environ["DRIVER"] == "0":  # no driver here: what the build is, not what it sees
    archs = (torch._C._cuda_getArchFlags() or "").split() if torch.version.cuda else []
    built = " ".join(archs) or "none"
    if torch.version.cuda is None:
        sys.exit(f"setup: for GPU nodes, but torch {torch.__version__} is a CPU build: install a CUDA build: {fix}")
    if sm not in archs:
        sys.exit(f"setup: for GPU nodes, but torch {torch.__version__} has no kernels for {sm} (built for {built}): "
                 f"install a build for them: {fix}")
    print(f"setup: no NVIDIA driver here: torch {torch.__version__} is a CUDA {torch.version.cuda} build for {built}, "
          f"as the GPU nodes need ({sm})")
elif not torch.cuda.is_available():
    why = ("is a CPU build" if torch.version.cuda is None else
           f"is built for CUDA {torch.version.cuda} and cannot use it (is the driver older? see nvidia-smi)")
    sys.exit(f"setup: this machine has an NVIDIA GPU but torch {torch.__version__} {why}: install a CUDA build: {fix}")'
}

mapfile -t TORCH_ARGS < <(torch_args)
case "${1:-}" in
  --dry-run) echo "python -m pip install -q ${TORCH_ARGS[*]}"; exit 0 ;;
  --check) check_torch "$VENV/bin/python"; exit 0 ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--dry-run | --check]" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# A CPU build left on a GPU machine is replaced; a CUDA build or a CPU one without a GPU stays.
installed=$(python -c 'import torch; print("cpu" if torch.version.cuda is None else "cuda")' 2>/dev/null || echo none)
if [ "$installed" = cpu ] && has_gpu; then
  python -m pip uninstall -q -y torch
  installed=none
fi
if [ "$installed" = none ]; then
  python -m pip install -q "${TORCH_ARGS[@]}"
fi
python -m pip install -q -e ".[dev,megatron,float8]"
check_torch python
python -c "import torch, echobench; print('echobench ready: torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"

#!/usr/bin/env bash
# Creates .venv (if needed) and installs echobench with its extras into it.
# Machines without a GPU get the CPU build of torch, pinned first so nothing pulls a CUDA build:
# on this project's machines `torch==2.13.0` is that CPU build; elsewhere set
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to get it from PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ECHOBENCH_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.6"
  else
    python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
fi
python -m pip install -q -e ".[dev,megatron,float8]"
python -c "import torch, echobench; print('echobench ready: torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"

#!/usr/bin/env bash
# One prepared measurement pass on a single GPU (the lent H200), in one device call of at most
# 10 minutes: tools/device/check.py does the work; its docstring lists the steps, the files it
# leaves in OUTDIR and the knobs. Where .git does not travel, pass the commit:
#
#   tools/device/wheels.sh                                   # here, with network: .whl/
#   ECHOBENCH_GIT_COMMIT=<sha> tools/device/check.sh OUTDIR  # there (carry .whl)
#   DEVICE_CHECK_DRY=1 tools/device/check.sh /tmp/dry        # CPU: the same steps, tiny model
#   tools/device/twin.sh                                     # CPU, on the device's versions
set -uo pipefail
cd "$(dirname "$0")/../.."
exec python3 -m tools.device.check "${1:?usage: tools/device/check.sh OUTDIR}"

#!/usr/bin/env bash
# The lent H200 machine's software, rehearsed on a CPU: builds a virtualenv with the device image's
# versions (tools/device/packages.txt: Python 3.12, torch 2.11.0, triton 3.6.0, transformers 5.17.0,
# numpy 2.5.2, ... and none of the carried packages), downloads the carried wheels
# (tools/device/wheels.sh), collects the tests there, and runs the device check in dry mode on it:
# the real step order, the carried wheels installed as the device installs them (pip --no-index
# --no-deps --target), a 200 s deadline so that the skip logic runs. Exits non-zero when a wheel does
# not install, when the tests do not collect, when no step was skipped for time, or when the report failed.
#
#   tools/device/twin.sh [OUTDIR]        # default /tmp/echobench-twin-out
#   tools/device/twin.sh --suite         # instead: the whole test suite on the twin's versions
#
# Knobs: DEVICE_TWIN_DIR (the venv; default ~/.cache/echobench/device-twin), DEVICE_TWIN_PYTHON (a
# Python 3.12; default pyenv's newest 3.12, else python3.12 on PATH), DEVICE_TWIN_TORCH_INDEX (an index
# to take torch==2.11.0 from, e.g. https://download.pytorch.org/whl/cpu, whose CPU build spares the
# ~3 GB of CUDA libraries; default PyPI's build, the image's), and the device check's (DEVICE_CHECK_*).
set -euo pipefail
cd "$(dirname "$0")/../.."
TWIN=${DEVICE_TWIN_DIR:-$HOME/.cache/echobench/device-twin}
PACKAGES=tools/device/packages.txt
pin() { awk -v n="$1" '$1 == "image" && split($2, a, "==") && a[1] == n {print a[2]}' "$PACKAGES"; }

find_python() {
  if [ -n "${DEVICE_TWIN_PYTHON:-}" ]; then echo "$DEVICE_TWIN_PYTHON"; return; fi
  local root; root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  local best; best=$(ls -d "$root"/versions/3.12.* 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$best" ]; then echo "$best/bin/python3.12"; return; fi
  command -v python3.12 || { echo "device-twin: no Python 3.12: install one (pyenv install 3.12) or set DEVICE_TWIN_PYTHON" >&2; exit 2; }
}

stamp=$TWIN/.built-from
want=$(sha256sum "$PACKAGES" | cut -c1-16)
if [ ! -x "$TWIN/bin/python3" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  py=$(find_python)
  echo "device-twin: building $TWIN from $py ($("$py" --version))"
  rm -rf "$TWIN"
  "$py" -m venv "$TWIN"
  "$TWIN/bin/python3" -m pip install -q --upgrade pip
  index=(); [ -n "${DEVICE_TWIN_TORCH_INDEX:-}" ] && index=(--extra-index-url "$DEVICE_TWIN_TORCH_INDEX")
  # Everything on the image, pinned where its version was read.
  mapfile -t image < <(awk '$1 == "image" {print $2}' "$PACKAGES" | grep -v -E '^python(==|$)')
  "$TWIN/bin/python3" -m pip install -q "${index[@]}" "${image[@]}"
  # What the image lacks, though a package above pulled it in (typer's newer releases need pydantic):
  # on the device those come from the carried wheels only.
  mapfile -t lacking < <(awk '$1 == "carried" {split($2, a, "=="); print a[1]}' "$PACKAGES" | while read -r n; do
    grep -q -E "^image $n(==|$)" "$PACKAGES" || echo "$n"; done)
  "$TWIN/bin/python3" -m pip uninstall -q -y "${lacking[@]}"
  echo "$want" > "$stamp"
fi
"$TWIN/bin/python3" - "$PACKAGES" <<'PY'
import sys
from importlib import metadata
lines = [line.split("#")[0].split() for line in open(sys.argv[1])]
image = {spec.partition("==")[0]: spec.partition("==")[2] for kind, spec in (x for x in lines if x) if kind == "image"}
for kind, spec in (x for x in lines if x):
    name = spec.partition("==")[0]
    if kind == "carried" and name not in image:
        try:
            sys.exit(f"device-twin: {name} {metadata.version(name)} is in the twin, but the image lacks it: rebuild the twin")
        except metadata.PackageNotFoundError:
            pass
for name, version in image.items():
    if version and name != "python" and not metadata.version(name).startswith(version):
        sys.exit(f"device-twin: {name} {metadata.version(name)} in the twin, the image has {version}")
PY
echo "device-twin: $("$TWIN/bin/python3" -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__)')"
bash tools/device/wheels.sh

export PATH=$TWIN/bin:$PATH  # `python3` is the twin's, as it is the image's on the device
if [ "${1:-}" = "--suite" ]; then
  shift
  site=$(mktemp -d /tmp/echobench-twin-site.XXXXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  PYTHONPATH=$site exec python3 -m pytest -q -p no:cacheprovider tests "$@"
fi
OUTDIR=${1:-/tmp/echobench-twin-out}
rm -rf "$OUTDIR"
# Every test module collects on the device's versions (what `pytest -m gpu` there imports), whether
# or not the check's test step gets its turn before the deadline.
site=$(mktemp -d /tmp/echobench-twin-site.XXXXXX)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
PYTHONPATH=$site python3 -m pytest --collect-only -q -p no:cacheprovider tests > "$site.collect.log" 2>&1 \
  || { tail -n 20 "$site.collect.log"; echo "device-twin: the tests do not collect on the device's versions" >&2; exit 1; }
echo "device-twin: $(tail -n 1 "$site.collect.log")"
# 200 s: the always-attempted steps fit (about 100-150 s of the tiny model on 2 cores), the later ones
# cannot all, so that some are skipped for time however fast the machine (limits and minimums x0.6).
DEVICE_CHECK_DRY=1 DEVICE_CHECK_DEADLINE_S=${DEVICE_CHECK_DEADLINE_S:-200} python3 -m tools.device.check "$OUTDIR"
python3 -m tools.device.summary verify "$OUTDIR/records.jsonl" --expect-skip

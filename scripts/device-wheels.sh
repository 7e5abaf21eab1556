#!/usr/bin/env bash
# Downloads into the git-ignored .whl/ the Python wheels that the lent single-H200 machine's image
# lacks and scripts/device-check.sh needs there (the machine has no network: the wheels travel
# with the working tree, 64 MiB at most with everything else). Run it here, with network, before
# the device call; it prints what it saved and the total size.
#
#   scripts/device-wheels.sh            # then carry .whl in the device call
#
# The image (Python 3.12, torch 2.11, triton, transformers 5.x, numpy, pandas, pyyaml, rich, typer,
# jinja2, narwhals, scipy, pytest) lacks:
#   megatron-core   the megatron backend; its cp312 build (it carries a compiled helper).
#                   0.16.1: the release the CPU tests run; it needs torch, numpy, packaging (there).
#   torchao         --precision fp8. 0.17.0 is the release built against torch 2.11 (torchao's
#                   compatibility table); float8 training uses its Python API only.
#   plotly          `echobench report` imports the dashboard module, which imports plotly
#                   (plotly needs narwhals and packaging: there).
#   pydantic        the result record (echobench.results: `run` and everything that reads records)
#                   and matrix files (`plan`, `sweep`); newer typer releases import it too.
#                   With pydantic-core, annotated-types, typing-inspection, and typing-extensions
#                   >= 4.16 (what pydantic-core requires; the image's may be older).
# One version of each (two of one package stop the install there); --no-deps, so each needed
# dependency is named here.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
WHEELS=(
  megatron-core==0.16.1
  torchao==0.17.0
  plotly==7.1.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: nothing left over from an earlier list
# pip matches manylinux tags exactly: list the ones these wheels use.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"/*.whl | awk '{printf "%10.1f MiB  %s\n", $5 / 1048576, $NF}'
total=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
printf '%10.1f MiB  total in %s (%d wheels; a device call carries 64 MiB at most, the tree included)\n' \
  "$(echo "$total / 1048576" | bc -l)" "$DEST" "$(ls "$DEST"/*.whl | wc -l)"
if [ "$total" -gt $((48 * 1048576)) ]; then
  echo "warning: over 48 MiB of wheels leaves little room for the working tree" >&2
fi

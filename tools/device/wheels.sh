#!/usr/bin/env bash
# Downloads into the git-ignored .whl/ the Python wheels that the lent single-H200 machine's image
# lacks and tools/device/check.sh needs there (the machine has no network: the wheels travel
# with the working tree, 64 MiB at most with everything else). Run it here, with network, before
# the device call; it prints what it saved and the total size.
#
#   tools/device/wheels.sh            # then carry .whl in the device call
#
# What it downloads: the `carried` lines of tools/device/packages.txt (the image lacks them; why each
# is needed is written there). One version of each (two of one package stop the install there);
# --no-deps, so each needed dependency is its own line there (tests/test_device_stack.py checks that
# the set is closed). DEVICE_WHEELS_DEST: another folder than .whl (the closure test's own copy).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEVICE_WHEELS_DEST:-.whl}
# pip matches manylinux tags exactly: list the ones these wheels use, for the device's architecture
# (DEVICE_WHEELS_ARCH: x86_64, the default, or aarch64 for a GH200 / GB200 node).
case "${DEVICE_WHEELS_ARCH:-x86_64}" in
  x86_64) PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
                     manylinux2014_x86_64 manylinux1_x86_64) ;;
  aarch64) PLATFORMS=(manylinux_2_28_aarch64 manylinux_2_27_aarch64 manylinux_2_24_aarch64 manylinux_2_17_aarch64
                      manylinux2014_aarch64) ;;  # manylinux1 has no aarch64
  *) echo "DEVICE_WHEELS_ARCH=${DEVICE_WHEELS_ARCH}: x86_64 or aarch64" >&2; exit 2 ;;
esac
mapfile -t WHEELS < <(awk '$1 == "carried" {print $2}' tools/device/packages.txt)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: nothing left over from an earlier list
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"/*.whl | awk '{printf "%10.1f MiB  %s\n", $5 / 1048576, $NF}'
total=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
printf '%10.1f MiB  total in %s (%d wheels; a device call carries 64 MiB at most, the tree included)\n' \
  "$(awk -v t="$total" 'BEGIN {print t / 1048576}')" "$DEST" "$(ls "$DEST"/*.whl | wc -l)"
if [ "$total" -gt $((48 * 1048576)) ]; then
  echo "warning: over 48 MiB of wheels leaves little room for the working tree" >&2
fi

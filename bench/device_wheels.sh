#!/usr/bin/env bash
# Fills .wheels/ with what bench/device_run.sh installs on a GPU machine without internet, kept small for
# the upload: nvidia-cutlass cut to its C++ headers (cutlass_library/source/include, ~3.8 MB of a 6.4 MB
# wheel), faker at the version pyproject.toml pins, and with --peer flash-linear-attention + fla-core
# (the benchmark peer), with --pdf pypdfium2 (the tests that parse the shipped sample PDF).
#
#   bench/device_wheels.sh WHEEL_DIR [--peer] [--pdf]
#
# WHEEL_DIR holds the downloaded wheels (nvidia_cutlass-*, faker-*, and those the options name); a
# missing faker is downloaded with pip (Python 3.12, pure Python). Ends by adding up what a device call
# would upload and fails where that passes the 64 MiB limit.
set -euo pipefail
SRC=${1:?usage: bench/device_wheels.sh WHEEL_DIR [--peer] [--pdf]}
shift
cd "$(dirname "$0")/.."
ROOT=$PWD
FAKER=$(sed -n 's/.*"faker==\([0-9.]*\)".*/\1/p' pyproject.toml)
rm -rf .wheels && mkdir -p .wheels

if ! ls "$SRC"/faker-"$FAKER"-*.whl > /dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$SRC" "faker==$FAKER"
fi
cp "$SRC"/faker-"$FAKER"-*.whl .wheels/

# The CUTLASS wheel without its examples, tools and Python packages: the build reads only the headers.
cutlass=$(ls "$SRC"/nvidia_cutlass-*.whl | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && python3 -m zipfile -e "$cutlass" . && rm -rf cutlass_library/source/examples \
  cutlass_library/source/tools cutlass_cppgen pycute)
(cd "$tmp" && python3 -c "
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1], 'w', zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for root, _, files in os.walk('.'):
        for f in files:
            z.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), '.'))
" "$ROOT/.wheels/$(basename "$cutlass")")

for opt in "$@"; do
  case "$opt" in
    --peer) cp "$SRC"/flash_linear_attention-*.whl "$SRC"/fla_core-*.whl .wheels/ ;;
    --pdf) cp "$SRC"/pypdfium2-*.whl .wheels/ ;;
    *) echo "unknown option $opt" >&2; exit 2 ;;
  esac
done
du -ch .wheels/* | tail -1

# The device copies the working tree (tracked and untracked, unignored files that exist) with the carried
# .wheels/, 64 MiB in all: say so when this would pass it.
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null || true) |
  awk '{s += $1} END {print s + 0}')  # a tracked file moved away is not sent: stat skips it
wheels=$(du -cb .wheels/* | tail -1 | cut -f1)
total=$((tree + wheels))
echo "upload: $((total / 1048576)) MiB ($tree bytes of working tree + $wheels of wheels; the limit is 64 MiB)"
if [ "$total" -gt $((64 * 1048576)) ]; then
  echo "over the device's 64 MiB upload: leave out a wheel, or move a file no device run reads out of the tree" \
    "for the call (python/ocria_rt/models/ocria-mini-mixed, 12.7 MB, is read by no GPU test)" >&2
  exit 1
fi

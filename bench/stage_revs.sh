#!/usr/bin/env bash
# Copies git revisions' source trees into .revs/NAME (ignored), stripped of what a device build and
# its op tests do not need (the shipped models, the fixtures, bench/results, scripts/), so that several
# revisions fit in one device call's carry (64 MiB with the working tree): carry ".revs" and ".wheels",
# then run bench/device_revs.sh there.
#
# With WHEEL_PYTHON set (a CPython of the GPU machine's minor version, e.g. a python3.12 with
# scikit-build-core, pybind11, nvidia-cutlass, cmake and ninja), each staged tree is also built here into
# .revs/NAME.dist/ (a CUDA wheel), which device_revs.sh installs instead of building there.
#
#   bench/stage_revs.sh NAME=REV [NAME=REV ...]      e.g. main=main glu=glu-epilogue
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bench/stage_revs.sh NAME=REV [NAME=REV ...]" >&2; exit 2; }
rm -rf .revs
for pair in "$@"; do
  name=${pair%%=*} rev=${pair#*=}
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ && "$name" != "$pair" ]] || { echo "bad NAME=REV: $pair" >&2; exit 2; }
  mkdir -p ".revs/$name"
  git archive "$rev" | tar -x -C ".revs/$name"
  rm -rf ".revs/$name/python/ocria_rt/models" ".revs/$name/tests/fixtures" ".revs/$name/bench/results" \
    ".revs/$name/scripts"
  echo "$name: $(git rev-parse --short "$rev") $(du -sh ".revs/$name" | cut -f1)"
  if [ -n "${WHEEL_PYTHON:-}" ]; then
    (cd ".revs/$name" && OCRIA_RT_CUDA=ON "$WHEEL_PYTHON" -m pip wheel -q --no-build-isolation --no-deps . \
      -w "../$name.dist" > "../$name.build.log" 2>&1) || { echo "$name: the wheel build failed (.revs/$name.build.log)" >&2; exit 1; }
    rm -rf ".revs/$name/build"
    echo "$name: $(ls ".revs/$name.dist")"
  fi
done

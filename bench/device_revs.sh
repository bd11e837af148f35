#!/usr/bin/env bash
# On a GPU machine: for each revision staged by bench/stage_revs.sh (in the order given), build it
# from .revs/NAME and run its own bench/device_run.sh with STEPS into OUT_DIR/NAME (the same
# environment variables: TEST_ARGS, TEST_K, DECODE_ARGS, KERNELS_ARGS, ...). Each build replaces the
# previous one's install, so every revision's steps run right after its own build. REV_TIMEOUT (s,
# default 300) bounds each revision, so that one slow revision cannot cost the others. The staged
# trees have no fixtures or shipped models: test them with TEST_ARGS=tests/gpu/test_cuda_ops.py.
# A wheel that stage_revs.sh built here (.revs/NAME.dist/*.whl) is installed instead of building,
# unless it does not install or its extension does not load there.
#
#   bench/device_revs.sh OUT_DIR "STEPS" NAME [NAME ...]    e.g. $OUT "decode" main glu
set -uo pipefail
OUT_DIR=${1:?usage: bench/device_revs.sh OUT_DIR STEPS NAME...}
STEPS=${2:?usage: bench/device_revs.sh OUT_DIR STEPS NAME...}
shift 2
cd "$(dirname "$0")/.."
root=$(pwd)
status=0
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl || exit 1
for name in "$@"; do
  [ -d ".revs/$name" ] || { echo "no .revs/$name (bench/stage_revs.sh)" >&2; status=1; continue; }
  ln -sfn "$root/.wheels" ".revs/$name/.wheels"
  echo "== $name"
  prebuilt=0
  for wheel in ".revs/$name.dist"/*.whl; do
    [ -f "$wheel" ] || continue
    mkdir -p "$OUT_DIR/$name"
    if python3 -m pip install -q --no-deps --force-reinstall "$wheel" > "$OUT_DIR/$name/install.log" 2>&1 &&
      (cd / && python3 -c "import ocria_rt._core") >> "$OUT_DIR/$name/install.log" 2>&1; then
      prebuilt=1
      echo "installed the prebuilt $(basename "$wheel")"
    else
      echo "the prebuilt $(basename "$wheel") did not install or load ($name/install.log): building"
    fi
  done
  OCRIA_RT_SKIP_BUILD=$prebuilt timeout "${REV_TIMEOUT:-300}" ".revs/$name/bench/device_run.sh" "$OUT_DIR/$name" $STEPS \
    2>&1 | tail -12 || status=1
done
exit $status

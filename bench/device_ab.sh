#!/usr/bin/env bash
# One call on a GPU machine for an A/B of the engine's environment switches, in one build:
#
#   bench/device_ab.sh OUT_DIR "VAR=V [VAR=V ...]" ["VAR=V ..." ...]
#
# Runs bench/device_run.sh OUT_DIR/base with the steps in BASE_STEPS (default "tests kernels decode";
# "none" for none: with OCRIA_RT_SKIP_BUILD=1 a later call on a warm machine runs only the A/B;
# TEST_ARGS, TEST_K, KERNELS_ARGS and DECODE_ARGS as there), then, for each quoted group of
# assignments, the decode benchmark again with those variables set (AB_DECODE_ARGS, default
# "--shapes ocria1-4b,qwen3.5-0.8b --prompts 1024 --no-peer --no-pdl-off --reps 2") into
# OUT_DIR/ab-N, and packs everything into OUT_DIR/results.tgz (the device returns few files).
set -uo pipefail
OUT_DIR=${1:?usage: bench/device_ab.sh OUT_DIR "VAR=V ..." ...}
shift
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
bench/device_run.sh "$OUT_DIR/base" ${BASE_STEPS:-tests kernels decode}
status=$?
i=0
for group in "$@"; do
  i=$((i + 1))
  echo "== ab-$i: $group" | tee -a "$OUT_DIR/ab.txt"
  env $group OCRIA_RT_SKIP_BUILD=1 DECODE_ARGS="${AB_DECODE_ARGS:---shapes ocria1-4b,qwen3.5-0.8b --prompts 1024 --no-peer --no-pdl-off --reps 2}" \
    bench/device_run.sh "$OUT_DIR/ab-$i" decode 2>&1 | tail -8 | tee -a "$OUT_DIR/ab.txt"
done
tar czf "$OUT_DIR/results.tgz" -C "$OUT_DIR" --exclude results.tgz . 2>/dev/null
find "$OUT_DIR" -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name ab.txt -exec rm -rf {} +
exit $status

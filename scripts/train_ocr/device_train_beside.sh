#!/usr/bin/env bash
# One device call that trains and, beside it on another GPU (or the same one), runs another GPU job
# (build, tests, benchmarks):
#
#   [GPUS=N] [WORKERS=W] [BENCH_CMD="..."] [BENCH_GPU=G] [BENCH_TIMEOUT=S] \
#     scripts/train_ocr/device_train_beside.sh MINUTES RESUME [train.py options...]
#
#   MINUTES     the training run's budget (device_train.sh); 8.3 fits a 600 s call with start-up
#   RESUME      "-" for a fresh run, a directory holding ckpt.tgz (the compressed checkpoint directory
#               `ckpt`, carried in, e.g. .ckpt): it is unpacked to /tmp/ck and resumed, or a checkpoint
#               directory on the machine (state.json inside), e.g. $KEEP/ckpt left by an earlier call
#   KEEP        where the run's final checkpoint is also copied (default /tmp/ocria-keep), so that the
#               next call on the same warm machine resumes from "$KEEP/ckpt" without carrying it
#   BENCH_CMD   run with CUDA_VISIBLE_DEVICES=BENCH_GPU (default 1; on a one-GPU machine 0, shared with
#               training: fine for tests, not for timings) (e.g. "bench/device_run.sh \$OUT/bench/r tests"),
#               its output packed into $OUT/bench.tgz (the device returns at most 8 files; training
#               writes 7); give training that GPU's share with CUDA_VISIBLE_DEVICES=0 GPUS=1
# Training writes $OUT/run (device_train.sh); its last 6 kB of console are printed.
set -uo pipefail
MINUTES=${1:?usage: device_train_beside.sh MINUTES RESUME [train.py options...]}
RESUME=${2:?usage: device_train_beside.sh MINUTES RESUME [train.py options...]}
shift 2
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the output directory}"
KEEP=${KEEP:-/tmp/ocria-keep}
if [ "$RESUME" != "-" ] && [ ! -f "$RESUME/state.json" ]; then
  [ -f "$RESUME/ckpt.tgz" ] || { echo "device_train_beside: no ckpt.tgz or state.json in $RESUME"; exit 2; }
  rm -rf /tmp/ck && mkdir -p /tmp/ck && tar xzf "$RESUME/ckpt.tgz" -C /tmp/ck || exit 2
  RESUME=/tmp/ck/ckpt
fi
if [ -n "${BENCH_CMD:-}" ]; then
  ( mkdir -p "$OUT/bench"
    CUDA_VISIBLE_DEVICES="${BENCH_GPU:-1}" timeout "${BENCH_TIMEOUT:-540}" bash -c "$BENCH_CMD" > "$OUT/bench/job.log" 2>&1
    tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench" ) &
fi
timeout 575 scripts/train_ocr/device_train.sh "$OUT/run" "$MINUTES" "$RESUME" --workers "${WORKERS:-14}" \
  --eval-every-minutes 100 --ckpt-every-minutes 100 --eval-max-new 300 --eval-pages 32 "$@" > /dev/null 2>&1
status=$?
if [ -f "$OUT/run/ckpt/state.json" ]; then
  rm -rf "$KEEP" && mkdir -p "$KEEP" && cp -r "$OUT/run/ckpt" "$KEEP/ckpt" && echo "checkpoint kept in $KEEP/ckpt"
fi
tail -c 6000 "$OUT/run/train.out"
wait
exit $status

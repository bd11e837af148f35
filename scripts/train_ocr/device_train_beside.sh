#!/usr/bin/env bash
# One device call that trains and, beside it on another GPU (or the same one), runs another GPU job
# (build, tests, benchmarks):
#
#   [GPUS=N] [WORKERS=W] [BENCH_CMD="..."] [BENCH_GPU=G] [BENCH_TIMEOUT=S] \
#     scripts/train_ocr/device_train_beside.sh MINUTES RESUME [train.py options...]
#
#   MINUTES     the training run's budget (device_train.sh); 8.3 fits a 600 s call with start-up
#   RESUME      "-" for a fresh run, or a directory holding ckpt.tgz (the compressed checkpoint directory
#               `ckpt`, carried in, e.g. .ckpt): it is unpacked to /tmp/ck and resumed
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
if [ "$RESUME" != "-" ]; then
  mkdir -p /tmp/ck && tar xzf "$RESUME/ckpt.tgz" -C /tmp/ck || exit 2
  RESUME=/tmp/ck/ckpt
fi
if [ -n "${BENCH_CMD:-}" ]; then
  ( mkdir -p "$OUT/bench"
    CUDA_VISIBLE_DEVICES="${BENCH_GPU:-1}" timeout "${BENCH_TIMEOUT:-540}" bash -c "$BENCH_CMD" > "$OUT/bench/job.log" 2>&1
    tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench" ) &
fi
timeout 575 scripts/train_ocr/device_train.sh "$OUT/run" "$MINUTES" "$RESUME" --workers "${WORKERS:-14}" \
  --eval-every-minutes 100 --ckpt-every-minutes 100 --eval-max-new 300 "$@" > /dev/null 2>&1
status=$?
tail -c 6000 "$OUT/run/train.out"
wait
exit $status

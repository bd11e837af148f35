#!/usr/bin/env bash
# The recipe in one go, made for a GPU machine: PRODUCERS data.py processes (each its own synthdoc
# seed, so other pages; pages drawn by the host's cores, the target's greedy answers and taps on
# DEVICE) and train.py (on DEVICE, picking up the caches as they grow, the cosine over MINUTES) side by
# side, then diagnose.py (on held-out pages and, to show memorizing, on the first training pages) and
# evaluate.py (ocria_rt on DEVICE, with and without the drafter) on held-out pages. The caches and
# checkpoint stay in WORK; RESULTS gets the drafter, the logs and the JSON.
#
#   scripts/train_drafter/pipeline.sh TARGET WORK RESULTS [MINUTES]
#
# Env (defaults): PYTHON (python3), DEVICE (cuda), LAYERS ("2 6 7": ocria-mini's, see README), BLOCK (16), NUM_LAYERS (2), BATCH (16), ANCHORS (16),
# LR (1e-3), MAX_REUSE (4: draws of a cached page at most; train.py waits for data.py's pages beyond it),
# PRODUCERS (4: data.py processes), WORKERS (cores - 2: page-drawing processes, shared among them),
# EVAL_PAGES (48), MIN_SHARDS (4: cached by the first data.py before the first step),
# INIT (none: a drafter whose weights the run starts from, train.py --init), SEED_BASE (0: producer p
# draws synthdoc seed SEED_BASE + p; a run that goes on from an earlier one takes seeds it has not seen).
set -euo pipefail
TARGET=${1:?usage: pipeline.sh TARGET WORK RESULTS [MINUTES]}
WORK=${2:?usage: pipeline.sh TARGET WORK RESULTS [MINUTES]}
RESULTS=${3:?usage: pipeline.sh TARGET WORK RESULTS [MINUTES]}
MINUTES=${4:-6}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
LAYERS=${LAYERS:-2 6 7}
BLOCK=${BLOCK:-16}
WORKERS=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
PRODUCERS=${PRODUCERS:-4}
EVAL_PAGES=${EVAL_PAGES:-48}
mkdir -p "$WORK" "$RESULTS"

# held-out pages first (evaluate.py draws the same ones), then the training cache in the background
"$PYTHON" "$HERE/data.py" --target "$TARGET" --out "$WORK/heldout" --split heldout --layers $LAYERS \
  --pages "$EVAL_PAGES" --device "$DEVICE" --workers "$WORKERS" > "$RESULTS/heldout.log" 2>&1
data_pids=()
caches=()
SEED_BASE=${SEED_BASE:-0}
for p in $(seq 0 $(( PRODUCERS - 1 ))); do
  "$PYTHON" "$HERE/data.py" --target "$TARGET" --out "$WORK/data-$p" --seed $(( SEED_BASE + p )) --layers $LAYERS --pages 1000000 \
    --device "$DEVICE" --workers $(( WORKERS / PRODUCERS > 0 ? WORKERS / PRODUCERS : 1 )) --minutes "$MINUTES" \
    > "$RESULTS/data-$p.log" 2>&1 &
  data_pids+=($!)
  caches+=("$WORK/data-$p")
done
trap 'kill ${data_pids[*]} 2> /dev/null || true' EXIT
first=$(printf "%s/data-0/shard-%05d.npz" "$WORK" $(( ${MIN_SHARDS:-4} - 1 )))
until [ -f "$first" ]; do
  kill -0 "${data_pids[0]}" 2> /dev/null || { tail -20 "$RESULTS/data-0.log"; exit 1; }
  sleep 2
done
"$PYTHON" "$HERE/train.py" --target "$TARGET" --data "${caches[@]}" --out "$WORK/run" --device "$DEVICE" \
  --block-size "$BLOCK" --num-layers "${NUM_LAYERS:-2}" --batch "${BATCH:-16}" --anchors "${ANCHORS:-16}" \
  --lr "${LR:-1e-3}" --max-reuse "${MAX_REUSE:-4}" --steps 0 --minutes "$MINUTES" --ckpt-every 500 --log-every 100 ${INIT:+--init "$INIT"} \
  > "$RESULTS/train.log" 2>&1
wait "${data_pids[@]}" || true
for p in $(seq 0 $(( PRODUCERS - 1 ))); do tail -1 "$RESULTS/data-$p.log"; done
tail -2 "$RESULTS/train.log"
cp -r "$WORK/run/drafter" "$WORK/run/log.jsonl" "$RESULTS/"

"$PYTHON" "$HERE/diagnose.py" --target "$TARGET" --drafter "$WORK/run/drafter" --data "$WORK/heldout" \
  --pages "$EVAL_PAGES" --json "$RESULTS/diagnose_heldout.json" 2>&1 | tail -3
"$PYTHON" "$HERE/diagnose.py" --target "$TARGET" --drafter "$WORK/run/drafter" --data "$WORK/data-0" \
  --pages "$EVAL_PAGES" --json "$RESULTS/diagnose_train.json" 2>&1 | tail -3
"$PYTHON" "$HERE/evaluate.py" --target "$TARGET" --drafter "$WORK/run/drafter" --pages "$EVAL_PAGES" \
  --block-sizes "$BLOCK" 8 --device "$DEVICE" --json "$RESULTS/eval_heldout.json" --plot "$RESULTS/acceptance.png" 2>&1 | tail -3

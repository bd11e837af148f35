#!/usr/bin/env bash
# One call on a GPU machine without internet: build and install from source, run the GPU tests and
# the benchmarks, and leave logs and JSON in OUT_DIR.
#
#   bench/device_run.sh OUT_DIR [tests|kernels|decode|vision|all|ncu|spec ...]
#
# spec (not part of all): speculative decoding, bench/spec.py (SPEC_ARGS for its arguments).
# drafter (not part of all): scripts/train_drafter/pipeline.sh trains a DFlash2 drafter for the shipped
# ocria-mini for DRAFTER_MINUTES (default 6) and measures it (its options from the environment, e.g.
# BLOCK=8 LAYERS="2 6 7"). Needs torch and transformers on the machine (fla for their DeltaNet kernels).
# ncu (not part of all): decode steps under Nsight Compute, bench/ncu_step.py (NCU_ARGS for its `run`,
# e.g. "--shape qwen3.5-0.8b"); needs a runtime with hardware counters. With NCU_KERNELS (a regex of
# kernel names, e.g. "gdn_decode|attention_decode"), also the first NCU_LAUNCHES (default 4) launches
# of those kernels with the full set and the source counters: ncu-source.md, their hottest instructions.
# Extra benchmark arguments: DECODE_ARGS, VISION_ARGS, KERNELS_ARGS, TEST_ARGS (pytest; default: the whole suite),
# TEST_K (a pytest -k expression, spaces allowed), TEST_WORKERS (pytest-xdist processes sharing the
# GPU, e.g. 8: the GPU suite's ~810 tests then take about 5 minutes), TEST_SECONDS (interrupt pytest
# then, with its summary and tracebacks);
# build parallelism: CMAKE_BUILD_PARALLEL_LEVEL; OCRIA_RT_SKIP_BUILD=1 uses what an earlier run installed.
#
# Dependencies the machine lacks come as wheels in .wheels/ (bench/device_wheels.sh fills it; nvidia-cutlass
# for the CUTLASS headers,
# flash-linear-attention + fla-core for the benchmark peer, pypdfium2 for the tests that parse the
# shipped sample PDF, faker at the version pyproject.toml pins for the generated pages of the tests and
# bench/vision.py); everything else (torch, transformers,
# numpy, pybind11, scikit-build-core, cmake, ninja, nvcc) must already be there.
set -uo pipefail
OUT_DIR=${1:?usage: bench/device_run.sh OUT_DIR [steps...]}
shift
STEPS=${*:-all}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

has_step() { [[ " $STEPS " == *" all "* || " $STEPS " == *" $1 "* ]]; }

export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT_DIR/gpu.txt" 2>&1
if [ "${OCRIA_RT_SKIP_BUILD:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl || exit 1
  start=$(date +%s)
  OCRIA_RT_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} python3 -m pip install -q --no-build-isolation --no-deps . \
    > "$OUT_DIR/build.log" 2>&1 || { tail -40 "$OUT_DIR/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
python3 -c "import ocria_rt, json; print(json.dumps(ocria_rt.build_info()))"

status=0
if has_step tests; then
  # One line per test as it ends (-v), so that a run stopped at a time limit still names what ended:
  # tests.log keeps everything but the passes, tests-failed.txt the failures and errors, tests-passed.txt
  # the passes.
  # TEST_SECONDS: pytest is interrupted (SIGINT) then, and still prints the tracebacks of the failures
  # so far, which a limit on the whole call would cut off.
  ${TEST_SECONDS:+timeout -s INT -k 30 "$TEST_SECONDS"} python3 -m pytest -v -rfEs -p no:benchmark \
    ${TEST_WORKERS:+-n "$TEST_WORKERS"} ${TEST_ARGS:-tests} \
    ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT_DIR/tests-all.log" | grep --line-buffered -v " PASSED" | tee "$OUT_DIR/tests.log" | tail -25
  status=${PIPESTATUS[0]}
  grep -E "(FAILED|ERROR)( |$)" "$OUT_DIR/tests.log" | sort -u > "$OUT_DIR/tests-failed.txt"
  grep -oE "PASSED [^ ]+" "$OUT_DIR/tests-all.log" | cut -d" " -f2 | sort -u > "$OUT_DIR/tests-passed.txt"
  rm -f "$OUT_DIR/tests-all.log"
fi
if has_step kernels && [ -f bench/kernels.py ]; then
  python3 bench/kernels.py "$OUT_DIR/kernels.json" ${KERNELS_ARGS:-} 2>&1 | tee "$OUT_DIR/kernels.log" | tail -40
fi
if has_step vision; then
  python3 bench/vision.py "$OUT_DIR/vision.json" --parse-pages 4 ${VISION_ARGS:-} 2>&1 | tee "$OUT_DIR/vision.log" | tail -20
  # the CLI on the same real-size random VLM and PDF (left by --parse-pages in the bench's workdir)
  python3 -m ocria_rt parse /tmp/ocria-bench/pages.pdf --model /tmp/ocria-bench/ocria1-4b-parse --device cuda \
    --max-new-tokens 200 -o "$OUT_DIR/parse.md" --json "$OUT_DIR/parse.json" --progress 2>&1 | tail -3
fi
if [[ " $STEPS " == *" ncu "* ]]; then
  ${NCU:-ncu} --clock-control none --profile-from-start off --graph-profiling node --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --csv --page raw --log-file "$OUT_DIR/ncu.csv" \
    python3 bench/ncu_step.py run ${NCU_ARGS:-} > "$OUT_DIR/ncu.log" 2>&1 || tail -20 "$OUT_DIR/ncu.log"
  python3 bench/ncu_step.py summarize "$OUT_DIR/ncu.csv" --out "$OUT_DIR/ncu.md" 2>&1 | head -40
  if [ -n "${NCU_KERNELS:-}" ]; then
    ${NCU:-ncu} --clock-control none --profile-from-start off --graph-profiling node --set full --import-source yes \
      --warp-sampling-interval 0 -k "regex:$NCU_KERNELS" --launch-count "${NCU_LAUNCHES:-4}" -f -o "$OUT_DIR/ncu-kernels" \
      python3 bench/ncu_step.py run ${NCU_ARGS:-} > "$OUT_DIR/ncu-kernels.log" 2>&1 || tail -20 "$OUT_DIR/ncu-kernels.log"
    ${NCU:-ncu} -i "$OUT_DIR/ncu-kernels.ncu-rep" --page details > "$OUT_DIR/ncu-kernels-details.txt" 2>&1
    ${NCU:-ncu} -i "$OUT_DIR/ncu-kernels.ncu-rep" --page source --csv --print-source sass > "$OUT_DIR/ncu-source.csv" 2>&1
    python3 bench/ncu_step.py source "$OUT_DIR/ncu-source.csv" --out "$OUT_DIR/ncu-source.md" 2>&1 | head -30
  fi
fi
if [[ " $STEPS " == *" spec "* ]]; then
  python3 bench/spec.py "$OUT_DIR/spec.json" ${SPEC_ARGS:-} 2>&1 | tee "$OUT_DIR/spec.log" | tail -20
fi
if [[ " $STEPS " == *" drafter "* ]]; then
  scripts/train_drafter/pipeline.sh python/ocria_rt/models/ocria-mini /tmp/drafter-run \
    "$OUT_DIR/drafter" "${DRAFTER_MINUTES:-6}" 2>&1 | tee "$OUT_DIR/drafter.log" | tail -12
fi
if has_step decode; then
  python3 bench/decode.py "$OUT_DIR/decode.json" ${DECODE_ARGS:-} 2>&1 | tee "$OUT_DIR/decode.log" | tail -20
fi
exit $status

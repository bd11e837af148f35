#!/usr/bin/env bash
# One training run on a GPU machine without internet, in one call:
#
#   [GPUS=N] scripts/train_ocr/device_train.sh OUT_DIR MINUTES [RESUME_CKPT_DIR] [train.py options...]
#
#   GPUS             data-parallel ranks, one per GPU (default: all visible GPUs); more than 1 launches
#                    train.py through torchrun (rank r takes global batches B + r, B + r + N, ...)
#   OUT_DIR          where the run writes: log.jsonl (all runs so far), train.out (console),
#                    ckpt/ (state.json, shard-NN.safetensors <= 15 MiB each, log.jsonl) -- 7 files
#   MINUTES          the run's wall-clock budget (train.py --minutes); it stops early enough to evaluate
#                    and checkpoint. With a 600 s command limit, 8.5 leaves room for the start-up.
#   RESUME_CKPT_DIR  a checkpoint directory carried in (e.g. .ckpt/ckpt); "" or "-" for a fresh start
#
# Wheels come from .wheels/ (flash-linear-attention + fla-core: the Gated DeltaNet kernels; faker: page
# text), installed with --no-index --no-deps --target /tmp/site; torch, transformers, tokenizers,
# safetensors, numpy and Pillow must already be on the machine. Without fla transformers runs its torch
# reference (slower); without faker (the version pyproject.toml pins) train.py stops before its first step.
#
# Example (a device call on an nvidia-h200-x2 machine, carrying the wheels and the previous checkpoint):
#   run(command="scripts/train_ocr/device_train.sh $OUT/run 8.5 .ckpt/ckpt", kind="nvidia-h200-x2",
#       carry=[".wheels/fla_core-0.6.0-py3-none-any.whl", ".wheels/flash_linear_attention-0.6.0-py3-none-any.whl",
#              ".wheels/faker-40.63.0-py3-none-any.whl", ".ckpt"])
# then copy $OUT/run/ckpt back into .ckpt/ckpt for the next run (and keep $OUT/run/log.jsonl).
set -uo pipefail
OUT_DIR=${1:?usage: device_train.sh OUT_DIR MINUTES [RESUME_CKPT_DIR] [train.py options...]}
MINUTES=${2:?usage: device_train.sh OUT_DIR MINUTES [RESUME_CKPT_DIR] [train.py options...]}
RESUME=${3:-}
shift $(( $# < 3 ? $# : 3 ))
cd "$(dirname "$0")/../.."
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the machines need NVLink SHARP / multicast off (NCCL, torch symmetric memory, NVSHMEM)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$(date +%s)

wheels=$(ls .wheels/fla_core-*.whl .wheels/flash_linear_attention-*.whl .wheels/faker-*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels \
    || echo "device_train: wheel install failed; going on without them"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "device_train: no wheels in .wheels/ (fla, faker): torch GDN reference; page text needs faker"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 - <<'EOF'
import importlib, importlib.metadata as md
for name, dist in (("torch", "torch"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
                   ("fla", "flash-linear-attention"), ("faker", "faker"), ("PIL", "pillow"), ("numpy", "numpy"),
                   ("safetensors", "safetensors")):
    try:
        importlib.import_module(name)
        print(f"{name} {md.version(dist)}")
    except Exception as e:  # noqa: BLE001
        print(f"{name} MISSING ({type(e).__name__}: {e})")
EOF
  echo "nproc $(nproc)"
} > "$OUT_DIR/train.out" 2>&1
GPUS=${GPUS:-$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))" 2>/dev/null || echo 1)}
echo "ranks (GPUS) $GPUS" >> "$OUT_DIR/train.out"
cat "$OUT_DIR/train.out"

args=(--out "$OUT_DIR" --minutes "$MINUTES")
if [ -n "$RESUME" ] && [ "$RESUME" != "-" ]; then
  if [ ! -f "$RESUME/state.json" ]; then echo "device_train: no checkpoint at $RESUME"; exit 2; fi
  args+=(--resume "$RESUME")
fi
launch=(python3)
if [ "$GPUS" -gt 1 ]; then
  launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$GPUS")
fi
"${launch[@]}" scripts/train_ocr/train.py "${args[@]}" "$@" 2>&1 | grep --line-buffered -v "falling back to its reference" \
  | tee -a "$OUT_DIR/train.out"
status=${PIPESTATUS[0]}
echo "device_train: exit $status after $(( $(date +%s) - start )) s"
ls -la "$OUT_DIR" "$OUT_DIR/ckpt" 2>/dev/null
exit $status

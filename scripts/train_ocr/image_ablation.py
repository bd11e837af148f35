#!/usr/bin/env python3
"""Does a trained checkpoint use the image? Answer-token loss on unseen pages of its training distribution
with the real images, with blank (constant) images, and with the images shuffled across the batch:

    python scripts/train_ocr/image_ablation.py --ckpt runs/a/ckpt --pages 16 [--json out.json]

Batches come from train.make_batch (batch numbers far beyond any run's, so the pages are unseen), go
through train.pixels_on_device and train.AnswerLoss with train.py's batched vision attention: the same
path as a training step, in fp32. real ~ blank means the model ignores the image.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import torch  # noqa: E402

import ckpt  # noqa: E402
import train  # noqa: E402


def load_model(ckpt_dir: Path):
    """Model, DataSpec and PromptBuilder of a training checkpoint, as train.py resumes them."""
    from transformers import Qwen3_5Config

    saved, tensors = ckpt.load(ckpt_dir)
    tok_dir = Path(tempfile.mkdtemp(prefix="ocr-tokenizer-"))
    for name, text in saved["tokenizer_files"].items():
        (tok_dir / name).write_text(text)
    config = Qwen3_5Config.from_dict(saved["model_config"])
    spec = train.DataSpec(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in saved["data"].items()})
    model = train.build_model(config, "sdpa")
    missing, unexpected = model.load_state_dict(ckpt.model_weights(tensors), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    return model, spec, common.PromptBuilder(tok_dir), saved


@torch.no_grad()
def ablation(model, spec, builder, pages: int, first_batch: int) -> dict:
    train.batch_equal_images_in_vision_attention()
    forward = train.AnswerLoss(model, autocast=False)
    spec.max_batch = min(spec.max_batch, pages)
    cpu = torch.device("cpu")
    sums = {"real": 0.0, "blank_white": 0.0, "blank_gray": 0.0, "shuffled": 0.0}
    n_tok, n_pages, b = 0, 0, first_batch
    while n_pages < pages:
        batch = train.make_batch(spec, b, builder)
        b += 1
        imgs = batch["images"]
        if imgs.shape[0] < 2:
            continue
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        variants = {"real": imgs, "blank_white": torch.full_like(imgs, 255), "blank_gray": torch.full_like(imgs, 128),
                    "shuffled": imgs.roll(1, dims=0)}
        k = int((labels[:, 1:] != -100).sum())
        for name, im in variants.items():
            pv, grid = train.pixels_on_device(im, cpu)
            sums[name] += float(forward(ids, labels, pos, pv, grid)) * k
        n_tok += k
        n_pages += imgs.shape[0]
        print(f"batch {b - 1}: {imgs.shape[0]} pages {tuple(imgs.shape[1:3])}, running means "
              + ", ".join(f"{n} {s / n_tok:.4f}" for n, s in sums.items()), flush=True)
    return {"pages": n_pages, "answer_tokens": n_tok, "loss": {n: round(s / n_tok, 4) for n, s in sums.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--first-batch", type=int, default=10**6, help="batch numbers used (unseen: far beyond training's)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    model, spec, builder, saved = load_model(args.ckpt)
    model.eval()
    res = {"step": saved["run"]["step"], "data": saved["data"], **ablation(model, spec, builder, args.pages, args.first_batch)}
    print(json.dumps(res["loss"]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Reading probe: can the training pipeline teach a tiny model to read? (CPU, minutes)

    python scripts/train_ocr/probe_reading.py --json /tmp/probe.json             # learns: ~95 % exact in 5 min
    python scripts/train_ocr/probe_reading.py --blank                            # control: constant images
    python scripts/train_ocr/probe_reading.py --image-aux 0 --image-center 0     # train.py's default recipe
    python scripts/train_ocr/probe_reading.py --layout free --chars 3 6 --size 64 192 --glyph-aux 1 --align-aux 1
        # characters at a random size and place: image-blind without the glyph / alignment terms

Each example is a small white image (--size H W, multiples of 32) showing a random string of --chars
digits / uppercase letters, drawn with Pillow's font either one character per 32 x 32 cell (one merged
image token each, --layout cells) or as one run at a random size and place (--layout free); the answer is
that string. Without the image the best a model can do is the prior (exact match ~ 1/36 for one character,
~0 for more). Everything after the rendering is train.py's: the page prompt and answer tokens
(PromptBuilder), the batch tensors and M-RoPE positions (train.pack_batch), the pixels
(train.pixels_on_device), the batched vision attention, AnswerLoss (with its optional image terms),
make_optimizer, Schedule; held-out exact match is train.greedy_markdown's (transformers' generate, which
computes its own M-RoPE positions). Each evaluation also reports the spread of the image features across
images (feat_spread = mean |f - mean f| / mean |f|): without --image-aux / --image-center it falls from
~0.4 to ~0.002 within 50 steps (every image gives the decoder the same vector) and the model never reads.
One thread; the curve is deterministic for --seed (--max-steps fixes its length; --minutes stops on time).
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

import train  # noqa: E402
from common import synthdoc  # noqa: E402

ALPHABET = string.digits + string.ascii_uppercase


def render(key: str, size: tuple[int, int], n_chars: tuple[int, int], layout: str,
           blank: bool) -> tuple[np.ndarray, str, list[tuple[int, str]]]:
    """Example `key`: (uint8 [H, W, 3] image, its string, the glyphs as (merged-token cell, character)). layout
    "cells": character i centred (+-3 px) in the i-th 32 x 32 cell of the top row (one character per merged
    image token); "free": the string in one run, at the largest font size of a random draw that fits, at a
    random place. A glyph's cell is the 32 x 32 cell (raster order, as the merger emits them) of its centre."""
    rng = random.Random(key)
    h, w = size
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*n_chars)))
    img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    ink = rng.randint(0, 80)
    if blank:
        return np.asarray(img, dtype=np.uint8), text, []
    glyphs = []
    if layout == "cells":
        font = ImageFont.load_default(size=26)
        for i, ch in enumerate(text):
            x0, y0, x1, y1 = font.getbbox(ch)
            x = 32 * i + (32 - (x1 - x0)) // 2 - x0 + rng.randint(-3, 3)
            y = (32 - (y1 - y0)) // 2 - y0 + rng.randint(-3, 3)
            draw.text((x, y), ch, font=font, fill=(ink, ink, ink))
            glyphs.append((i, ch))
    else:
        px = rng.randint(int(h * 0.45), int(h * 0.7))
        while True:
            font = ImageFont.load_default(size=px)
            x0, y0, x1, y1 = font.getbbox(text)
            if x1 - x0 <= w - 4 and y1 - y0 <= h - 4:
                break
            px -= 1
        x = rng.randint(0, w - (x1 - x0) - 1) - x0
        y = rng.randint(0, h - (y1 - y0) - 1) - y0
        draw.text((x, y), text, font=font, fill=(ink, ink, ink))
        # the glyph centres as synthdoc computes them, for the same text drawn from its baseline
        baseline = y + font.getmetrics()[0]
        glyphs = [(train.image_cell(cx, cy, h, w), ch)
                  for cx, cy, ch in synthdoc.layout.text_glyphs([("t", x, baseline, text, font, 0, None)])]
    return np.asarray(img, dtype=np.uint8), text, glyphs


def batch(args, builder, split: str, first: int, n: int) -> tuple[dict, list[str]]:
    ex = [render(f"{split}:{args.seed}:{first + j}", tuple(args.size), tuple(args.chars), args.layout, args.blank)
          for j in range(n)]
    b = train.pack_batch(builder, [im for im, _, _ in ex], [t for _, t, _ in ex], 4096)
    b["glyphs"] = train.glyph_targets(builder, [g for _, _, g in ex], tuple(args.size))
    b["reading"] = train.reading_targets([train.token_cells(builder, t, g) for _, t, g in ex], b["prompt_len"],
                                         b["labels"].shape[1])
    return b, [t for _, t, _ in ex]


def evaluate(model, builder, args, held: list) -> dict:
    """Held-out answer loss (teacher forced, train.py's forward), greedy exact match / CER (generate), and
    the spread of the image features across images (|f - mean f| / |f|: ~0 when they collapsed to one vector)."""
    cpu = torch.device("cpu")
    forward = train.AnswerLoss(model, autocast=False)
    model.eval()
    loss, exact, cers, feats = 0.0, 0, [], []
    with torch.no_grad():
        for b, texts in held:
            pv, grid = train.pixels_on_device(b["images"], cpu)
            loss += float(forward(b["input_ids"], b["labels"], b["position_ids"], pv, grid)) / len(held)
            feats += model.model.get_image_features(pv, grid).pooler_output
            images = [Image.fromarray(im) for im in b["images"].numpy()]
            preds = train.greedy_markdown(model, builder, images, cpu, max(args.chars) + 4, False)
            exact += sum(p == t for p, t in zip(preds, texts))
            cers += [synthdoc.metrics.cer(p, t) for p, t in zip(preds, texts)]
    model.train()
    f = torch.stack(feats)
    spread = float((f - f.mean(0)).norm(dim=-1).mean() / f.norm(dim=-1).mean())
    return {"loss": round(loss, 4), "exact": round(exact / len(cers), 4), "cer": round(float(np.mean(cers)), 4),
            "feat_spread": round(spread, 4), "feat_norm": round(float(f.norm(dim=-1).mean()), 3),
            "sample": preds[:4], "ref": texts[:4]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smoke", choices=sorted(common.PRESETS))
    ap.add_argument("--size", type=int, nargs=2, default=(32, 96), metavar=("H", "W"), help="multiples of 32")
    ap.add_argument("--layout", default="cells", choices=["cells", "free"])
    ap.add_argument("--chars", type=int, nargs=2, default=(1, 3), metavar=("LO", "HI"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--image-aux", type=float, default=1.0, help="train.py --image-aux (0: off, train.py's default)")
    ap.add_argument("--image-center", type=float, default=1.0, help="train.py --image-center (0: off, train.py's default)")
    ap.add_argument("--align-aux", type=float, default=0.0,
                    help="train.py --align-aux: attention head 0 reads the cells of the token it predicts (0: off)")
    ap.add_argument("--glyph-aux", type=float, default=0.0,
                    help="train.py --glyph-aux: each image token predicts the characters drawn in its cell (0: off)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--total-steps", type=int, default=2000, help="cosine length (the run may stop earlier)")
    ap.add_argument("--minutes", type=float, default=5.0, help="training budget (evaluations included)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out examples")
    ap.add_argument("--blank", action="store_true", help="control: the images show nothing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    assert all(s % 32 == 0 for s in args.size), args.size
    assert args.layout == "free" or args.size[1] >= 32 * args.chars[1], "cells: one 32-px cell per character"

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    builder = common.PromptBuilder(common.DEFAULT_TOKENIZER_DIR)
    config = common.model_config(args.preset, builder.tok.get_vocab_size(), builder.ids, max_positions=1024)
    model = train.build_model(config, "sdpa")
    model.train()
    train.batch_equal_images_in_vision_attention()
    sched = train.Schedule(lr=args.lr, warmup=args.warmup, total_steps=args.total_steps)
    opt = train.make_optimizer(model, sched, 0.1, torch.device("cpu"))
    forward = train.AnswerLoss(model, autocast=False, image_aux=args.image_aux, end_id=builder.ids["<|im_end|>"],
                               image_center=args.image_center, glyph_aux=args.glyph_aux, align_aux=args.align_aux)
    held = [batch(args, builder, "heldout", i, min(32, args.eval_n - i)) for i in range(0, args.eval_n, 32)]

    curve, t0, step, losses = [], time.perf_counter(), 0, []
    deadline = t0 + args.minutes * 60

    def record() -> None:
        # train_loss: the mean training objective since the last record (answer loss + image terms)
        r = {"step": step, "examples": step * args.batch, "seconds": round(time.perf_counter() - t0, 1),
             "train_loss": round(float(np.mean(losses)), 4) if losses else None, **evaluate(model, builder, args, held)}
        losses.clear()
        curve.append(r)
        print(json.dumps(r), flush=True)

    record()
    eval_cost = time.perf_counter() - t0
    while time.perf_counter() + eval_cost < deadline and not (args.max_steps and step >= args.max_steps):
        b, _ = batch(args, builder, "train", step * args.batch, args.batch)
        pv, grid = train.pixels_on_device(b["images"], torch.device("cpu"))
        for g in opt.param_groups:
            g["lr"] = sched.at(step)
        opt.zero_grad(set_to_none=True)
        loss = forward(b["input_ids"], b["labels"], b["position_ids"], pv, grid, b["glyphs"], b["reading"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if step % args.eval_every == 0:
            te = time.perf_counter()
            record()
            eval_cost = time.perf_counter() - te
    if curve[-1]["step"] != step:
        record()
    res = {"args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "json"},
           "params": sum(p.numel() for p in model.parameters()), "steps": step, "curve": curve,
           "final_exact": curve[-1]["exact"], "best_exact": max(r["exact"] for r in curve)}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A drafter on data.py's cached pages in torch alone: teacher-forced accuracy per block position and the
speculative loop simulated against the cached greedy answers.

Teacher forcing: every anchor of each answer, its block [anchor, mask x (B - 1)] over the context strictly
before it (as train.py trains); top-1 of the drafter's logits per block position k = 1 .. B-1. The loop:
from the end of the prompt, the block after the accepted tokens is proposed (model.propose, the greedy
selector walk), the longest prefix equal to the cached answer is accepted and one more token emitted,
as ocria_rt's greedy loop does; tau = tokens per step. A tau here far above evaluate.py's on the same
pages points at the engine; a low tau with a high teacher-forced accuracy at the loop.

    python scripts/train_drafter/diagnose.py --target python/ocria_rt/models/ocria-mini \
        --drafter runs/d/drafter --data runs/d/data --start 0 --pages 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train  # noqa: E402
from model import DFlash2Drafter, propose  # noqa: E402


@torch.no_grad()
def teacher_forced(model, page, embed, head) -> tuple[np.ndarray, np.ndarray]:
    """(hits, counts) per block position k = 1 .. B-1 over every anchor of the page's answer."""
    B = model.spec.block_size
    ids, n0 = page["ids"], page["prompt_len"]
    n = len(ids)
    anchors = torch.arange(n0, n - 1)
    block = torch.full((1, len(anchors), B), model.spec.mask_token_id)
    block[0, :, 0] = ids[anchors]
    hidden = model(page["taps"][None].float(), block, anchors[None], embed)[0, :, 1:]
    pred = (hidden @ head.T).argmax(-1)  # [A, B-1]
    gold_pos = anchors[:, None] + torch.arange(1, B)
    valid = gold_pos < n
    hit = (pred == ids[gold_pos.clamp(max=n - 1)]) & valid
    return hit.sum(0).numpy(), valid.sum(0).numpy()


def simulated_loop(model, page, embed, head) -> list[int]:
    """Tokens per verify step of greedy speculative decoding against the cached answer."""
    ids, n0 = page["ids"].tolist(), page["prompt_len"]
    taps = page["taps"]
    pos, steps = n0, []  # ids[pos] is the anchor: emitted, not yet run through the target
    while pos < len(ids) - 1:
        drafts = propose(model, taps[:pos], ids[pos], embed, head)
        gold = ids[pos + 1: pos + len(drafts) + 1]
        accepted = 0
        while accepted < len(gold) and drafts[accepted] == gold[accepted]:
            accepted += 1
        emitted = min(accepted + 1, len(ids) - 1 - pos)
        steps.append(emitted)
        pos += emitted
    return steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True, help="data.py's cache directory")
    ap.add_argument("--start", type=int, default=0, help="index of the first cached page (in shard order)")
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = DFlash2Drafter.load(args.drafter).eval()
    embed, head, _, _ = train.target_tables(args.target)
    embed = embed * float(model.spec.extra.get("input_embedding_scale", 1.0))
    # pages by their index in the cache, as evaluate.py --data --start picks them
    pages = [p for p in train.load_cache(args.data) if args.start <= p["index"] < args.start + args.pages]
    if not pages:
        raise SystemExit(f"no usable cached pages in {args.data} from index {args.start} (run data.py first)")
    B = model.spec.block_size
    hits, counts, steps = np.zeros(B - 1), np.zeros(B - 1), []
    for page in pages:
        h, c = teacher_forced(model, page, embed, head)
        hits += h
        counts += c
        steps += simulated_loop(model, page, embed, head)
    report = {"drafter": str(args.drafter), "data": str(args.data), "start": args.start, "pages": len(pages),
              "block_size": B, "tf_top1_per_k": [round(float(x), 4) for x in hits / np.maximum(counts, 1)],
              "tf_top1": float(hits.sum() / counts.sum()), "sim_tau": float(np.mean(steps)), "sim_steps": len(steps)}
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

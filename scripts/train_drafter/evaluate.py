#!/usr/bin/env python3
"""A drafter through ocria_rt's engine on held-out pages: acceptance length, speed, CER, exactness.

Each page goes through Engine.generate twice on the same engine (greedy): with the drafter and with
speculative=False, in alternating order; the outputs must be the same tokens. Reports tau (tokens per
verify step, bonus included), the decode tokens/s of both (the engine's decode timer) and end-to-end
pages/s, the process CPU seconds per page of both (the fair figure on a shared machine with
--threads 1), and CER against the page's Markdown. --block-sizes evaluates the same weights at other block
sizes (a copy of the drafter with dflash_config.block_size changed).

    python scripts/train_drafter/evaluate.py --target python/ocria_rt/models/ocria-mini --drafter runs/d/drafter \
        --pages 100 --block-sizes 16 8 --json runs/d/eval.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ocria_rt import synthdoc
from ocria_rt.pipeline import DEFAULT_PROMPT


def with_block_size(drafter: Path, block: int, tmp: Path) -> Path:
    cfg = json.loads((drafter / "config.json").read_text())
    if cfg["dflash_config"]["block_size"] == block:
        return drafter
    out = tmp / f"block{block}"
    out.mkdir()
    shutil.copy(drafter / "model.safetensors", out / "model.safetensors")
    cfg["dflash_config"]["block_size"] = block
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def evaluate(target: Path, drafter: Path, pages: list, max_new: int, threads: int) -> dict:
    import ocria_rt
    from ocria_rt.chat import build_multimodal_prompt

    eng = ocria_rt.Engine(target, drafter=drafter, num_threads=threads)
    prompts = []
    for image, ref, meta in pages:
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": DEFAULT_PROMPT}]}]
        prompts.append((build_multimodal_prompt(eng, messages), ref))
    (ids, pv, grid), _ = prompts[0]
    eng.generate(ids, max_new, pixel_values=pv, image_grid_thw=grid)  # warm-up
    wall = {True: 0.0, False: 0.0}
    cpu = {True: 0.0, False: 0.0}  # process CPU time: fair on a shared machine with one engine thread
    decode_s = {True: 0.0, False: 0.0}
    decode_tokens = 0
    accept: list[int] = []
    mismatched, cer = 0, []
    for i, ((ids, pv, grid), ref) in enumerate(prompts):
        results = {}
        for spec in ((True, False) if i % 2 == 0 else (False, True)):
            t0, c0 = time.perf_counter(), time.process_time()
            results[spec] = eng.generate(ids, max_new, pixel_values=pv, image_grid_thw=grid, speculative=spec)
            wall[spec] += time.perf_counter() - t0
            cpu[spec] += time.process_time() - c0
            decode_s[spec] += results[spec].decode_seconds
        decode_tokens += len(results[False].token_ids) - 1
        mismatched += results[True].token_ids != results[False].token_ids
        accept += results[True].acceptance_lengths
        cer.append(synthdoc.score_page(results[False].text.strip(), ref)["cer"])
    n = len(prompts)
    return {
        "block_size": json.loads((drafter / "config.json").read_text())["dflash_config"]["block_size"],
        "pages": n, "tau": float(np.mean(accept)), "verify_steps": len(accept),
        "acceptance_histogram": np.bincount(accept).tolist(),
        "decode_tokens": decode_tokens,
        "decode_tok_s_plain": decode_tokens / decode_s[False], "decode_tok_s_speculative": decode_tokens / decode_s[True],
        "pages_s_plain": n / wall[False], "pages_s_speculative": n / wall[True],
        "speedup_decode": decode_s[False] / decode_s[True], "speedup_end_to_end": wall[False] / wall[True],
        "cpu_s_per_page_plain": cpu[False] / n, "cpu_s_per_page_speculative": cpu[True] / n,
        "speedup_cpu_time": cpu[False] / cpu[True],
        "mismatched_pages": mismatched, "cer": float(np.mean(cer)), "threads": threads,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--pages", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="heldout", help="synthdoc split (train: the pages data.py used)")
    ap.add_argument("--block-sizes", type=int, nargs="*", default=[])
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    cfg = synthdoc.training_page_config(args.target)
    pages = list(synthdoc.iter_dataset(args.split, args.pages, args.seed, cfg))
    own = json.loads((args.drafter / "config.json").read_text())["dflash_config"]["block_size"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for block in args.block_sizes or [own]:
            r = evaluate(args.target, with_block_size(args.drafter, block, Path(tmp)), pages, args.max_new_tokens, args.threads)
            print(json.dumps({k: v for k, v in r.items() if k != "acceptance_histogram"}), flush=True)
            out.append(r)
    if args.json:
        args.json.write_text(json.dumps({"target": str(args.target), "drafter": str(args.drafter), "split": args.split, "seed": args.seed,
                                         "results": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()

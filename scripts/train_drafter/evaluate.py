#!/usr/bin/env python3
"""A drafter through ocria_rt's engine on held-out pages: acceptance length, speed, CER, exactness.

Each page goes through Engine.generate twice on the same engine (greedy): with the drafter and with
speculative=False, in alternating order; the outputs must be the same tokens. Reports tau (tokens per
verify step, bonus included), the decode tokens/s of both (the engine's decode timer) and end-to-end
pages/s, the process CPU seconds per page of both (the fair figure on a shared machine with
--threads 1), and CER against the page's Markdown. --block-sizes evaluates the same weights at other block
sizes (a copy of the drafter with dflash_config.block_size changed). --data runs pages of data.py's cache
(pages --start .. --start + --pages - 1 of its split and seed; e.g. the drafter's own training pages) and
counts the pages whose plain greedy answer is the cached one (it is not when synthdoc draws the same
seeds from another text source than the cache's). --plot writes the acceptance-length histograms as a PNG.

    python scripts/train_drafter/evaluate.py --target python/ocria_rt/models/ocria-mini --drafter runs/d/drafter \
        --pages 100 --block-sizes 16 8 --json runs/d/eval.json --plot runs/d/acceptance.png
    python scripts/train_drafter/evaluate.py --target ... --drafter runs/d/drafter --data runs/d/data --pages 16
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ocria_rt import synthdoc
from ocria_rt.pipeline import DEFAULT_PROMPT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import read_cache  # noqa: E402


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


def cached_answers(data: Path, start: int, n: int) -> list[list[int]]:
    """The target's greedy answers of cached pages start .. start + n - 1 (data.py's shards, in order)."""
    answers = [p["ids"][p["prompt_len"]:].tolist() for p in read_cache(data, taps=False)]
    if len(answers) < start + n:
        raise SystemExit(f"{data} caches {len(answers)} pages; --start {start} --pages {n} needs {start + n}")
    return answers[start: start + n]


def evaluate(target: Path, drafter: Path, pages: list, max_new: int, threads: int,
             cached: list[list[int]] | None = None, device: str = "cpu") -> dict:
    import ocria_rt
    from ocria_rt.chat import build_multimodal_prompt

    eng = ocria_rt.Engine(target, drafter=drafter, device=device, num_threads=threads)
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
    mismatches: list[dict] = []
    cer, cache_equal = [], 0
    for i, ((ids, pv, grid), ref) in enumerate(prompts):
        results = {}
        for spec in ((True, False) if i % 2 == 0 else (False, True)):
            t0, c0 = time.perf_counter(), time.process_time()
            results[spec] = eng.generate(ids, max_new, pixel_values=pv, image_grid_thw=grid, speculative=spec)
            wall[spec] += time.perf_counter() - t0
            cpu[spec] += time.process_time() - c0
            decode_s[spec] += results[spec].decode_seconds
        decode_tokens += len(results[False].token_ids) - 1
        spec_ids, plain_ids = list(results[True].token_ids), list(results[False].token_ids)
        if spec_ids != plain_ids:  # where they part, and how close the plain path's top two logits were there
            d = next((k for k, (a, b) in enumerate(zip(spec_ids, plain_ids)) if a != b),
                     min(len(spec_ids), len(plain_ids)))
            top2 = np.sort(eng.score(list(ids) + plain_ids[:d], pixel_values=pv, image_grid_thw=grid)[-1])[-2:]
            mismatches.append({"page": i, "token": d, "plain_top2_margin": float(top2[1] - top2[0])})
        cache_equal += cached is not None and list(results[False].token_ids) == cached[i]
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
        "mismatched_pages": len(mismatches), "mismatches": mismatches, "cer": float(np.mean(cer)),
        "threads": threads, "device": device,
        **({"cached_answers_equal": cache_equal} if cached is not None else {}),
    }


def write_histogram_plot(path: Path, results: list[dict]) -> None:
    """One bar chart per block size: the share of verify steps that emitted 1 .. B tokens, with tau."""
    from PIL import Image, ImageDraw

    W, H, pad = 640, 260, 40
    img = Image.new("RGB", (W, H * len(results)), "white")
    d = ImageDraw.Draw(img)
    for i, r in enumerate(results):
        top, B = i * H, r["block_size"]
        counts = (r["acceptance_histogram"] + [0] * (B + 1))[1:B + 1]  # tokens emitted per step: 1 .. B
        share = np.array(counts, float) / max(sum(counts), 1)
        d.text((pad, top + 8), f"block {B}: tau {r['tau']:.2f} over {r['verify_steps']} verify steps, "
                               f"{r['pages']} pages (share of steps by tokens emitted)", fill="black")
        x0, y0, plot_h = pad, top + H - pad, H - 2.5 * pad
        bar = (W - 2 * pad) / B
        d.line([(x0, y0), (W - pad, y0)], fill="black")
        for k, f in enumerate(share):
            h = plot_h * f / max(share.max(), 1e-9)
            d.rectangle([x0 + k * bar + 2, y0 - h, x0 + (k + 1) * bar - 2, y0], fill=(70, 110, 180))
            d.text((x0 + k * bar + bar / 2 - 4, y0 + 4), str(k + 1), fill="black")
            d.text((x0 + k * bar + 2, y0 - h - 12), f"{100 * f:.0f}%", fill="black")
    img.save(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--pages", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="heldout", help="synthdoc split (train: the pages data.py used)")
    ap.add_argument("--start", type=int, default=0, help="index of the first page in the split")
    ap.add_argument("--data", type=Path, help="data.py's cache: its split and seed, checked against its answers")
    ap.add_argument("--block-sizes", type=int, nargs="*", default=[])
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="a PNG of the acceptance-length histograms")
    args = ap.parse_args(argv)

    cfg = synthdoc.training_page_config(args.target)
    cached = None
    if args.data:
        meta = json.loads((args.data / "meta.json").read_text())
        if meta.get("images"):
            raise SystemExit(f"{args.data} caches pages of {meta['images']}, not synthdoc's")
        if meta.get("pages_from") not in (None, synthdoc.page_sources(cfg)):
            raise SystemExit(f"{args.data} drew its pages from {meta['pages_from']}; synthdoc here draws from "
                             f"{synthdoc.page_sources(cfg)}: the same seeds are other pages")
        args.split, args.seed = meta["split"], meta["seed"]
        cached = cached_answers(args.data, args.start, args.pages)
    pages = list(synthdoc.iter_dataset(args.split, args.pages, args.seed, cfg, start=args.start))
    own = json.loads((args.drafter / "config.json").read_text())["dflash_config"]["block_size"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for block in args.block_sizes or [own]:
            r = evaluate(args.target, with_block_size(args.drafter, block, Path(tmp)), pages, args.max_new_tokens,
                         args.threads, cached, args.device)
            print(json.dumps({k: v for k, v in r.items() if k != "acceptance_histogram"}), flush=True)
            out.append(r)
    if args.json:
        args.json.write_text(json.dumps({"target": str(args.target), "drafter": str(args.drafter), "split": args.split, "seed": args.seed,
                                         "start": args.start, "pages_from": synthdoc.page_sources(cfg),
                                         "results": out}, indent=1) + "\n")
    if args.plot:
        write_histogram_plot(args.plot, out)


if __name__ == "__main__":
    main()

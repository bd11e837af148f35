#!/usr/bin/env python3
"""The drafter's training data: the target's own greedy outputs on pages, with its hidden-state taps.

Each page's prompt is built by ocria_rt.chat (image expanded, chat template), its output is the target's
greedy answer through ocria_rt's engine (plain decoding), and the taps of prompt + output are the
target's hidden states at the drafter's target_layer_ids from the same engine over the whole sequence
(Engine.hidden_states: the output of decoder layer `id`, transformers' `hidden_states[id + 1]`), so that
the drafter learns from the taps it reads when it drafts (on a GPU: BF16's). No torch needed. Shards of
pages are cached as `shard-NNNNN.npz` in the cache directory: ids (int32 [N]), prompt_len, taps (float16
[N, n_taps * H]); existing shards are kept, so an interrupted run resumes. meta.json records the options and what synthdoc
drew the pages from (under another text source, e.g. without faker, the same seeds are other pages), so
that a resume or evaluate.py --data does not mix pages.

    python scripts/train_drafter/data.py --target python/ocria_rt/models/ocria-mini --out runs/d/data \
        --layers 1 3 5 --pages 400
    python scripts/train_drafter/data.py --target DIR --out DIR --layers ... --images my_pages/   # user pages

On a GPU (`--device cuda`) the engine runs there, and `--workers` processes draw the synthdoc pages
meanwhile (page drawing is then the slow part on the host).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from ocria_rt import synthdoc
from ocria_rt.pipeline import DEFAULT_PROMPT

SHARD_PAGES = 16


def _draw_page(split: str, seed: int, config, index: int):
    image, _, meta = synthdoc.generate_page(synthdoc.page_seed(split, index, seed), config)
    return f"{split}/{meta['seed']}", image


def page_sources(args, start: int = 0):
    """(key, PIL image) of the pages to use from index `start` on: synthdoc's training split (the target's
    own distribution when its directory has training.json; drawn by --workers processes when > 0) or
    every image under --images."""
    if args.images:
        from PIL import Image

        files = sorted(p for p in Path(args.images).rglob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        if not files:
            raise SystemExit(f"no PNG / JPEG images under {args.images}")
        for f in files[start: args.pages]:
            yield str(f), Image.open(f).convert("RGB")
        return
    draw = partial(_draw_page, args.split, args.seed, synthdoc.training_page_config(args.target))
    if args.workers <= 0:
        yield from map(draw, range(start, args.pages))
        return
    with get_context("spawn").Pool(args.workers) as pool:  # spawn: no fork of a process holding a GPU
        yield from pool.imap(draw, range(start, args.pages), chunksize=4)


def pages_from(args) -> dict | None:
    """What synthdoc's pages of a seed are drawn from here (its text source and fonts: with another faker
    version, or without faker, the same seeds are other pages); None for --images."""
    if args.images:
        return None
    return synthdoc.page_sources(synthdoc.training_page_config(args.target))


def shard_files(data: Path) -> list[Path]:
    """The complete shards of a cache, in page order (not the .tmp.npz of one being written)."""
    return sorted(data.glob("shard-[0-9][0-9][0-9][0-9][0-9].npz"))


def read_cache(data: Path, taps: bool = True, shards: slice = slice(None)):
    """The cached pages in data.py's order (their index in page_sources), each a dict of ids (int32),
    prompt_len and, with taps, the taps (float16); the shards (those of the slice) are read lazily,
    page by page."""
    for shard in shard_files(data)[shards]:
        with np.load(shard) as z:
            for j in range(len({k.split("/")[0] for k in z.files})):
                page = {"ids": z[f"{j}/ids"], "prompt_len": int(z[f"{j}/prompt_len"])}
                if taps:
                    page["taps"] = z[f"{j}/taps"]
                yield page


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the target's HF directory (a Qwen3.5 VLM)")
    ap.add_argument("--out", type=Path, required=True, help="cache directory")
    ap.add_argument("--layers", type=int, nargs="+", required=True, help="target layers to tap (from 0)")
    ap.add_argument("--pages", type=int, default=400)
    ap.add_argument("--split", default="train", help="synthdoc split (train pages; evaluate on heldout)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--images", type=Path, help="a folder of page images to use instead of synthdoc pages")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda: where the engine runs")
    ap.add_argument("--workers", type=int, default=0, help="processes drawing synthdoc pages (0: in this one)")
    ap.add_argument("--minutes", type=float, default=25.0, help="stop after the shard that passes this budget")
    args = ap.parse_args(argv)

    import ocria_rt
    from ocria_rt.chat import build_multimodal_prompt

    args.out.mkdir(parents=True, exist_ok=True)
    meta_path = args.out / "meta.json"
    meta = {"target": str(args.target), "layers": args.layers, "split": args.split, "seed": args.seed,
            "images": str(args.images) if args.images else None, "prompt": DEFAULT_PROMPT,
            "position_ids": "sequence index", "pages_from": pages_from(args), "taps": "Engine.hidden_states"}
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        raise SystemExit(f"{meta_path} was written for other options: {meta_path.read_text()}")
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")

    # plain decoding: the target's own greedy answers, with no drafter of its own on this device either
    eng = ocria_rt.Engine(args.target, device=args.device, num_threads=args.threads, drafter=False)
    t0 = time.perf_counter()
    shard: list[dict] = []
    done = 0
    start = 0  # shards are written in page order: resume after the last complete one
    while (args.out / f"shard-{start // SHARD_PAGES:05d}.npz").exists():
        start += SHARD_PAGES

    def flush(path: Path) -> bool:
        nonlocal shard, done
        tmp = Path(str(path) + ".tmp.npz")
        np.savez(tmp, **{f"{j}/{k}": v for j, p in enumerate(shard) for k, v in p.items()})
        tmp.replace(path)
        done += len(shard)
        shard = []
        dt = time.perf_counter() - t0
        print(f"{path.name}: {done} pages in {dt:.0f} s", flush=True)
        return dt > 60 * args.minutes

    path = None
    for i, (key, image) in enumerate(page_sources(args, start), start):
        path = args.out / f"shard-{i // SHARD_PAGES:05d}.npz"
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": DEFAULT_PROMPT}]}]
        ids, pv, grid = build_multimodal_prompt(eng, messages)
        r = eng.generate(ids, args.max_new_tokens, pixel_values=pv, image_grid_thw=grid, speculative=False)
        seq = list(ids) + list(r.token_ids)
        taps = eng.hidden_states(seq, args.layers, pixel_values=pv, image_grid_thw=grid)
        shard.append({"ids": np.asarray(seq, np.int32), "prompt_len": np.int32(len(ids)),
                      "taps": taps.astype(np.float16)})
        if len(shard) == SHARD_PAGES and flush(path):
            return
    if shard:
        flush(path)

if __name__ == "__main__":
    main()

"""Page parsing on one GPU: the OCRia-1 vision encoder on a 1288-px page, the prefill of that page's
tokens, and end-to-end pages/s at a fixed 1,000 output tokens per page, batch 1; ocria_rt against
transformers (+ flash-linear-attention) on the same random BF16 weights, in the same process.

    python bench/vision.py OUT.json [--new-tokens 1000] [--peer-tokens 32] [--no-peer] [--reps 3]

The peer's pages/s is extrapolated from its prefill time and its decode rate over --peer-tokens
cached steps (generating 1,000 tokens with it would take minutes); ours is measured whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OCRIA1_VISION, VISION_TOKENS, make_random_checkpoint, markdown_table  # noqa: E402

PAGE_SIZE = (911, 1288)  # an A4 page whose long side is 1288 px, as ocria_rt.parse renders PDFs


def synthetic_page(seed: int = 0):
    """A page-like image: white paper, dark text-line bars, a ruled table (not blank: never time on zeros)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    img = Image.new("RGB", PAGE_SIZE, "white")
    d = ImageDraw.Draw(img)
    y = 80
    while y < PAGE_SIZE[1] - 80:
        x = 70
        while x < PAGE_SIZE[0] - 90:
            w = int(rng.integers(20, 90))
            d.rectangle([x, y, x + w, y + 14], fill=(20, 20, 20))
            x += w + 12
        y += int(rng.integers(24, 40))
    for r in range(6):
        d.line([70, 900 + 40 * r, PAGE_SIZE[0] - 70, 900 + 40 * r], fill="black", width=2)
    return img


def prompt_ids(image_tokens: int) -> list[int]:
    text = [int(t) for t in np.random.default_rng(1).integers(1000, 100000, 24)]
    return ([VISION_TOKENS["vision_start_token_id"]] + [VISION_TOKENS["image_token_id"]] * image_tokens
            + [VISION_TOKENS["vision_end_token_id"]] + text)


def bench_ours(model_dir: Path, ids: list[int], pv, grid, new_tokens: int, reps: int) -> dict:
    import ocria_rt

    eng = ocria_rt.Engine(model_dir, device="cuda", max_context=len(ids) + new_tokens + 8)
    eng.encode_images(pv, grid)  # warm-up
    eng.generate(ids, max_new_tokens=4, stop_token_ids=[], pixel_values=pv, image_grid_thw=grid)
    vision = []
    for _ in range(reps):
        t0 = time.perf_counter()
        eng.encode_images(pv, grid)
        vision.append(time.perf_counter() - t0)
    prefill, e2e, decode = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = eng.generate(ids, max_new_tokens=new_tokens, stop_token_ids=[], pixel_values=pv, image_grid_thw=grid)
        e2e.append(time.perf_counter() - t0)
        prefill.append(r.prefill_seconds)
        decode.append(r.decode_tokens_per_second)
    return {"vision_ms": 1e3 * statistics.median(vision), "prefill_ms": 1e3 * statistics.median(prefill),
            "decode_tokens_per_s": statistics.median(decode), "page_s": statistics.median(e2e)}


def bench_peer(model_dir: Path, ids: list[int], pv, grid, new_tokens: int, peer_tokens: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    input_ids = torch.tensor([ids], device="cuda")
    pixel_values = torch.tensor(pv, device="cuda", dtype=torch.bfloat16)
    grid_thw = torch.tensor(grid, device="cuda")
    mm = (input_ids == VISION_TOKENS["image_token_id"]).int()

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    with torch.no_grad():
        model.model.visual(pixel_values, grid_thw=grid_thw)  # warm-up
        _, vision = timed(lambda: model.model.visual(pixel_values, grid_thw=grid_thw))
        out, prefill = timed(lambda: model(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid_thw,
                                           mm_token_type_ids=mm, use_cache=True))
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)

        def steps():
            nonlocal cache, tok
            for _ in range(peer_tokens):
                o = model(input_ids=tok, past_key_values=cache, use_cache=True)
                cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)

        _, decode = timed(steps)
    del model, cache, out
    torch.cuda.empty_cache()
    rate = peer_tokens / decode
    return {"vision_ms": 1e3 * vision, "prefill_ms": 1e3 * prefill, "decode_tokens_per_s": rate,
            "page_s": prefill + (new_tokens - 1) / rate, "extrapolated_from_tokens": peer_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON output path")
    ap.add_argument("--new-tokens", type=int, default=1000)
    ap.add_argument("--peer-tokens", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    args = ap.parse_args()

    import torch

    from ocria_rt.preprocess import preprocess_images

    model_dir = make_random_checkpoint("ocria1-4b", args.workdir / "ocria1-4b-vlm", vision=OCRIA1_VISION)
    pv, grid = preprocess_images([synthetic_page()], model_dir)
    n_image = int(np.prod(grid, axis=1).sum()) // OCRIA1_VISION["spatial_merge_size"] ** 2
    ids = prompt_ids(n_image)
    result = {"device": torch.cuda.get_device_name(), "page_px": PAGE_SIZE, "patches": int(pv.shape[0]),
              "image_tokens": n_image, "prompt_tokens": len(ids), "new_tokens": args.new_tokens}
    result["ours"] = bench_ours(model_dir, ids, pv, grid, args.new_tokens, args.reps)
    if not args.no_peer:
        result["peer"] = bench_peer(model_dir, ids, pv, grid, args.new_tokens, args.peer_tokens)
    args.out.write_text(json.dumps(result, indent=1))

    rows = []
    for who in ("ours", "peer"):
        if who in result:
            r = result[who]
            rows.append({"engine": "ocria_rt" if who == "ours" else "transformers + fla (extrapolated)",
                         "vision ms/page": f"{r['vision_ms']:.1f}", "prefill ms (vision + tokens)": f"{r['prefill_ms']:.1f}",
                         "decode tok/s": f"{r['decode_tokens_per_s']:.1f}", "pages/s": f"{1 / r['page_s']:.3f}"})
    if "peer" in result:
        rows.append({"engine": "speed-up", "pages/s": f"{result['peer']['page_s'] / result['ours']['page_s']:.1f}x"})
    print(f"\n{result['device']}; page {PAGE_SIZE[0]}x{PAGE_SIZE[1]} px -> {result['patches']} patches, "
          f"{n_image} image tokens, {len(ids)} prompt tokens; {args.new_tokens} new tokens per page; OCRia-1 shapes, "
          "random BF16 weights")
    print(markdown_table(rows, ["engine", "vision ms/page", "prefill ms (vision + tokens)", "decode tok/s", "pages/s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

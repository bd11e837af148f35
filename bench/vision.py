"""Page parsing on one GPU: the OCRia-1 vision encoder on a 1288-px page, the prefill of that page's
tokens, and end-to-end pages/s at a fixed 1,000 output tokens per page, batch 1; ocria_rt against
transformers (+ flash-linear-attention) on the same random BF16 weights, in the same process.

    python bench/vision.py OUT.json [--new-tokens 1000] [--peer-tokens 32] [--no-peer] [--reps 3]
                                    [--parse-pages 4]

Ours also gets a breakdown of one encode_images call (`ours.vision_breakdown`), from a torch.profiler
(CUPTI) trace: the GPU's kernel and copy time inside the call, the host time before the GPU starts
and after it finishes, and the kernels that take longest. encode_images takes host fp32 pixels (the
public API has no device input), so the host's share is measured rather than removed; the peer is
timed with its pixels already on the GPU.

The peer's pages/s is extrapolated from its prefill time and its decode rate over --peer-tokens
cached steps (generating 1,000 tokens with it would take minutes); ours is measured whole.
--parse-pages N also runs the whole pipeline, `ocria_rt.parse`, on an N-page generated PDF with the
same weights (PDF rendering at 1288 px, preprocessing in its worker, up to --new-tokens per page) and
leaves a model directory usable by `ocria-rt parse --model` in WORKDIR/ocria1-4b-parse.
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
from common import (OCRIA1_VISION, VISION_TOKENS, make_random_checkpoint, markdown_table,  # noqa: E402
                    profiled_trace_events)

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
    out = {"vision_ms": 1e3 * statistics.median(vision), "prefill_ms": 1e3 * statistics.median(prefill),
           "decode_tokens_per_s": statistics.median(decode), "page_s": statistics.median(e2e)}
    try:
        out["vision_breakdown"] = vision_breakdown(eng, pv, grid, reps)
    except Exception as e:  # the breakdown is diagnostic: a profiler failure must not lose the timings
        out["vision_breakdown"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def vision_breakdown(eng, pv, grid, reps: int) -> dict:
    """Medians over `reps` profiled encode_images calls (CUPTI records the engine's kernels and copies
    like torch's own): wall_ms of the call (with profiler overhead), gpu_busy_ms (union of the GPU's
    kernel and copy intervals), host_ms = wall - busy (index work, staging the pixels, launches,
    reading the output into numpy), host_before_gpu_ms / host_after_gpu_ms (before the first and
    after the last GPU activity), kernel_ms, h2d_ms, d2h_ms, kernels (count), and top_kernels (the
    longest kernels by name, ms per call)."""
    from torch.profiler import record_function

    def calls() -> None:
        for _ in range(reps):
            with record_function("ocria_encode_images"):
                eng.encode_images(pv, grid)

    return breakdown_from_trace(profiled_trace_events(calls), "ocria_encode_images")


def breakdown_from_trace(trace_events: list[dict], annotation: str) -> dict:
    """vision_breakdown's figures from a Chrome trace's events (times in microseconds)."""
    events = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    calls = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("cat") == "user_annotation" and e.get("name") == annotation)
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("cat"), e.get("name", ""))
                 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    per_call, kernel_ms = [], {}
    for t0, t1 in calls:
        mine = [g for g in gpu if t0 <= g[0] <= t1]
        if not mine:
            continue
        busy, end = 0.0, t0
        for a, b, _, _ in mine:  # union of the intervals, in start order
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        kernel = [b - a for a, b, cat, _ in mine if cat == "kernel"]
        h2d = [b - a for a, b, cat, name in mine if cat == "gpu_memcpy" and "HtoD" in name]
        d2h = [b - a for a, b, cat, name in mine if cat == "gpu_memcpy" and "DtoH" in name]
        per_call.append({
            "wall_ms": (t1 - t0) / 1e3, "gpu_busy_ms": busy / 1e3, "host_ms": (t1 - t0 - busy) / 1e3,
            "host_before_gpu_ms": (mine[0][0] - t0) / 1e3, "host_after_gpu_ms": (t1 - end) / 1e3,
            "kernel_ms": sum(kernel) / 1e3, "h2d_ms": sum(h2d) / 1e3, "d2h_ms": sum(d2h) / 1e3, "kernels": len(kernel),
        })
        for a, b, cat, name in mine:
            if cat == "kernel":
                kernel_ms[name] = kernel_ms.get(name, 0.0) + (b - a) / 1e3
    if not per_call:
        return {"error": f"no GPU activity recorded inside the {len(calls)} profiled calls"}
    out = {k: statistics.median(c[k] for c in per_call) for k in per_call[0]}
    top = sorted(kernel_ms.items(), key=lambda kv: -kv[1])[:8]
    out["top_kernels"] = [{"name": name[:120], "ms": ms / len(per_call)} for name, ms in top]
    return out


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


def make_parse_model_dir(random_dir: Path, directory: Path) -> Path:
    """The random OCRia-1-shaped checkpoint as a complete model directory for `ocria_rt.parse`: the
    tokenizer and chat template of the package's small VLM, the model's special token ids set to that
    tokenizer's. The weights stay random (the Markdown is noise); shapes and work per page are real."""
    import shutil

    import ocria_rt

    small = Path(ocria_rt.__file__).resolve().parent / "models" / "tiny-vlm"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(small / name, directory / name)
    shutil.copyfile(random_dir / "preprocessor_config.json", directory / "preprocessor_config.json")
    weights = directory / "model.safetensors"
    if not weights.exists():
        weights.symlink_to((random_dir / "model.safetensors").resolve())
    cfg = json.loads((random_dir / "config.json").read_text())
    small_cfg = json.loads((small / "config.json").read_text())
    for key in VISION_TOKENS:
        cfg[key] = small_cfg[key]
    cfg["text_config"]["eos_token_id"] = small_cfg["text_config"]["eos_token_id"]
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


def synthetic_pdf(path: Path, pages: int) -> Path:
    """An A4 PDF of generated pages (ocria_rt.synthdoc), one image per page."""
    from ocria_rt.synthdoc import iter_dataset

    images = [image.convert("RGB") for image, _, _ in iter_dataset("heldout", pages, seed=7)]
    images[0].save(path, save_all=True, append_images=images[1:], resolution=150.0)
    return path


def bench_parse(model_dir: Path, pdf: Path, new_tokens: int) -> dict:
    import ocria_rt

    eng = ocria_rt.Engine(model_dir, device="cuda")
    ocria_rt.parse(pdf, engine=eng, pages="1", max_new_tokens=8, progress=False)  # warm-up
    doc = ocria_rt.parse(pdf, engine=eng, max_new_tokens=new_tokens, progress=False)
    if not doc.ok:
        raise RuntimeError("parse failed: " + "; ".join(p.error or "" for p in doc.failed_pages))
    n = len(doc.pages)
    return {"pages": n, "new_tokens": doc.new_tokens, "prompt_tokens": doc.prompt_tokens,
            "pages_per_s": doc.timings["pages_per_s"], "tokens_per_s": doc.timings["tokens_per_s"],
            "preprocess_ms_per_page": doc.timings["preprocess_ms"] / n,
            "prefill_ms_per_page": doc.timings["prefill_ms"] / n, "decode_ms_per_page": doc.timings["decode_ms"] / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="JSON output path")
    ap.add_argument("--new-tokens", type=int, default=1000)
    ap.add_argument("--peer-tokens", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ocria-bench"))
    ap.add_argument("--parse-pages", type=int, default=0, help="also time ocria_rt.parse on a PDF of this many pages")
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
    if args.parse_pages > 0:
        parse_dir = make_parse_model_dir(model_dir, args.workdir / "ocria1-4b-parse")
        pdf = synthetic_pdf(args.workdir / "pages.pdf", args.parse_pages)
        result["parse"] = bench_parse(parse_dir, pdf, args.new_tokens)
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
    b = result["ours"].get("vision_breakdown", {})
    if "error" in b:
        print(f"\nocria_rt vision breakdown unavailable: {b['error']}")
    elif b:
        print(f"\nocria_rt encode_images, profiled: {b['wall_ms']:.1f} ms = host {b['host_ms']:.1f} "
              f"({b['host_before_gpu_ms']:.1f} before the GPU starts, {b['host_after_gpu_ms']:.1f} after it ends) + GPU busy "
              f"{b['gpu_busy_ms']:.1f} (kernels {b['kernel_ms']:.1f} in {b['kernels']:.0f}, H2D {b['h2d_ms']:.1f}, "
              f"D2H {b['d2h_ms']:.1f})")
        print("top kernels (ms per call): " + "; ".join(f"{k['name'][:48]} {k['ms']:.2f}" for k in b["top_kernels"][:5]))
    if "parse" in result:
        r = result["parse"]
        print(f"\nocria_rt.parse, {r['pages']}-page PDF, up to {args.new_tokens} tokens per page:")
        print(markdown_table([{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items()}], list(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Character error rate and table-structure exactness of a page-to-Markdown model on held-out pages.

    python scripts/train_ocr/evaluate.py MODEL_DIR [--pages 200] [--seed 0] [--backend ocria|transformers|both]
                                        [--device cpu|cuda] [--json out.json]

Pages: ``synthdoc.iter_dataset("heldout", N, seed)`` (odd page seeds: never used in training), default
PageConfig. Each page goes through the model with ocria_rt.pipeline.DEFAULT_PROMPT (what
``ocria_rt.parse`` sends), greedy, up to --max-new-tokens:

- ``ocria``: ``ocria_rt.Engine(MODEL_DIR, device).chat`` (synthdoc.evaluate);
- ``transformers``: ``Qwen3_5ForConditionalGeneration.generate`` on inputs built as transformers'
  processor builds them (ocria_rt.chat / ocria_rt.preprocess, checked equal to it in the tests), pages
  batched with left padding; fp32 on the CPU, BF16 on CUDA.

Scores (synthdoc.metrics): CER = edit distance / reference characters per page, averaged over pages
("cer") and pooled ("cer_micro"); a reference table is structure-exact when the prediction's table at
the same index has the same rows, cells per row and th/td kinds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import numpy as np  # noqa: E402

from common import DEFAULT_PROMPT, synthdoc  # noqa: E402


class _TokenizerOnly:
    """What ocria_rt.chat.build_multimodal_prompt needs from an Engine, without the compiled engine."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer = common.load_tokenizer(model_dir)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def evaluate_ocria(model_dir: Path, n: int, seed: int, device: str, max_new: int, threads: int, progress: bool) -> dict:
    if not common.HAS_ENGINE:
        raise SystemExit("ocria_rt's compiled engine is not importable here (pip install .)")
    import ocria_rt

    eng = ocria_rt.Engine(model_dir, device=device, num_threads=threads)
    return synthdoc.evaluate(eng, n_pages=n, seed=seed, max_new_tokens=max_new, progress=progress)


def evaluate_transformers(model_dir: Path, n: int, seed: int, device: str, max_new: int, batch: int,
                          progress: bool) -> dict:
    import torch
    from ocria_rt.chat import build_multimodal_prompt
    from transformers import GenerationConfig, Qwen3_5ForConditionalGeneration

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).to(dev).eval()
    shim = _TokenizerOnly(model_dir)
    gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    pad = gen.get("pad_token_id", eos[-1])
    img_id = model.config.image_token_id
    t0 = time.perf_counter()
    pages = list(synthdoc.iter_dataset("heldout", n, seed))
    scores, samples = [], []
    for i in range(0, n, batch):
        chunk = pages[i:i + batch]
        built = [build_multimodal_prompt(shim, [{"role": "user", "content": [
            {"type": "image", "image": im}, {"type": "text", "text": DEFAULT_PROMPT}]}]) for im, _, _ in chunk]
        L = max(len(b[0]) for b in built)
        ids = torch.full((len(built), L), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _, _) in enumerate(built):
            ids[j, L - len(p):] = torch.tensor(p)
            mask[j, L - len(p):] = 1
        pv = torch.from_numpy(np.concatenate([b[1] for b in built])).to(dev, dtype)
        grid = torch.from_numpy(np.concatenate([b[2] for b in built])).to(dev)
        ids, mask = ids.to(dev), mask.to(dev)
        gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new, eos_token_id=eos,
                              pad_token_id=pad, bos_token_id=None, use_cache=True)
        with torch.no_grad():
            model.model.rope_deltas = None
            out = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid,
                                 mm_token_type_ids=(ids == img_id).int(), generation_config=gc)
        for (im, ref, meta), row in zip(chunk, out[:, L:].tolist()):
            pred = shim.tokenizer.decode(row, skip_special_tokens=True).strip()
            s = synthdoc.score_page(pred, ref)
            s.update(seed=meta["seed"], layout=meta["layout"])
            scores.append(s)
            if len(samples) < 3:
                samples.append({"seed": meta["seed"], "prediction": pred, "reference": ref})
        if progress:
            print(f"  {len(scores)}/{n} pages, mean cer so far {np.mean([s['cer'] for s in scores]):.4f}", flush=True)
    res = synthdoc.summarize(scores)
    dt = time.perf_counter() - t0
    res.update(seconds=dt, pages_per_s=n / dt, seed=seed, per_page=scores, samples=samples)
    return res


def by_layout(per_page: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for layout in sorted({p["layout"] for p in per_page}):
        ps = [p for p in per_page if p["layout"] == layout]
        out[layout] = {k: v for k, v in synthdoc.summarize(ps).items() if k in ("pages", "cer", "table_exact_rate")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--pages", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="ocria", choices=["ocria", "transformers", "both"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="pages per generate() call (transformers)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of the ocria_rt engine (0: all)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    results = {}
    if args.backend in ("ocria", "both"):
        results["ocria"] = evaluate_ocria(args.model_dir, args.pages, args.seed, args.device, args.max_new_tokens,
                                          args.threads, args.progress)
    if args.backend in ("transformers", "both"):
        results["transformers"] = evaluate_transformers(args.model_dir, args.pages, args.seed, args.device,
                                                        args.max_new_tokens, args.batch, args.progress)
    for name, r in results.items():
        r["by_layout"] = by_layout(r["per_page"])
        rate = r["table_exact_rate"]
        print(f"{name}: {r['pages']} pages, CER {r['cer']:.4f} (pooled {r['cer_micro']:.4f}, median "
              f"{r['cer_median']:.4f}), tables exact {r['tables_exact']}/{r['tables']}"
              f"{'' if rate is None else f' ({rate:.1%})'}, {r['seconds']:.1f} s")
        for layout, s in r["by_layout"].items():
            print(f"    {layout:11s} {s['pages']:4d} pages  CER {s['cer']:.4f}  tables {s['table_exact_rate']}")
    if "ocria" in results and "transformers" in results:
        a = {p["seed"]: p["cer"] for p in results["ocria"]["per_page"]}
        b = {p["seed"]: p["cer"] for p in results["transformers"]["per_page"]}
        same = sum(1 for k in a if abs(a[k] - b.get(k, -1)) < 1e-12)
        print(f"pages with the same CER on both backends: {same}/{len(a)}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model_dir), "pages": args.pages, "seed": args.seed,
                                         "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()

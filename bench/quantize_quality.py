"""How far quantized checkpoints' next-token distributions are from their source model's, on the pages
`ocria-rt eval` scores: a measure of quantization quality with far less sampling noise than the CER of
greedy outputs (a few pages whose generation derails decide a CER difference of tenths of a point).

    python bench/quantize_quality.py OUT.json --reference MODEL_DIR --models DIR [DIR ...]
                                     [--pages 200] [--seed 0] [--threads 0]

Each of the held-out pages (synthdoc's "heldout" split, seed --seed: those of `ocria-rt eval --pages N
--seed S`) is scored teacher-forced on its true Markdown by the reference and by each model, on the CPU.
Per model: the mean over the Markdown's tokens of KL(reference || model) in nats, and the share of those
tokens where both models' most likely token agree. The JSON goes to OUT.json; the Markdown table comes last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table  # noqa: E402


def continuation_log_probs(eng, sample) -> np.ndarray:
    """log p of the rows that predict the sample's continuation tokens, float64 [tokens, vocab]."""
    logits = eng.score(sample.ids, pixel_values=sample.pixel_values, image_grid_thw=sample.image_grid_thw)
    rows = np.asarray(logits[sample.answer_start - 1:len(sample.ids) - 1], np.float64)
    rows -= rows.max(axis=1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))


def compare(reference: list[np.ndarray], model: list[np.ndarray]) -> dict:
    """Mean KL(reference || model) per token and top-1 agreement over all pages' tokens."""
    kl = np.concatenate([(np.exp(r) * (r - m)).sum(axis=1) for r, m in zip(reference, model)])
    agree = np.concatenate([r.argmax(axis=1) == m.argmax(axis=1) for r, m in zip(reference, model)])
    return {"kl": float(kl.mean()), "kl_p90": float(np.percentile(kl, 90)), "top1_agreement": float(agree.mean()),
            "tokens": int(kl.size)}


def main(argv: list[str] | None = None) -> int:
    import ocria_rt
    from ocria_rt.quantization import calibration

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the JSON result")
    ap.add_argument("--reference", type=Path, required=True, help="the source model directory")
    ap.add_argument("--models", type=Path, nargs="+", required=True, help="checkpoints made from it")
    ap.add_argument("--pages", type=int, default=200, help="held-out pages (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="held-out set (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: all cores)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    ref = ocria_rt.Engine(args.reference, num_threads=args.threads)
    samples = calibration.synthetic_samples(ref, args.pages, args.seed, split="heldout")
    ref_lp = [continuation_log_probs(ref, s) for s in samples]
    rows = []
    for d in args.models:
        eng = ocria_rt.Engine(d, num_threads=args.threads)
        r = compare(ref_lp, [continuation_log_probs(eng, s) for s in samples])
        rows.append({"model": str(d), **r})
        print(f"{d}: KL {r['kl']:.3e} nats / token, top-1 agreement {100 * r['top1_agreement']:.2f}%", flush=True)
    result = {"reference": str(args.reference), "pages": args.pages, "seed": args.seed,
              "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    table = [{"model": Path(r["model"]).name, "KL (nats / token)": f"{r['kl']:.3e}", "KL p90": f"{r['kl_p90']:.3e}",
              "top-1 agreement": f"{100 * r['top1_agreement']:.2f}%", "tokens": r["tokens"]} for r in rows]
    print(markdown_table(table, ["model", "KL (nats / token)", "KL p90", "top-1 agreement", "tokens"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

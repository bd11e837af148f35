"""Whether two `ocria-rt eval --json` runs over the same pages differ by more than page sampling: the
mean of the per-page CER differences (A - B) with a paired bootstrap 95% interval.

    python bench/compare_evals.py A.json B.json [--resamples 4000] [--seed 0]

Pages are resampled with replacement, each keeping its pair of CERs (ocria_rt.synthdoc.metrics.
mean_interval of the per-page differences). An interval that holds 0 says the two runs' CERs are not
told apart by these pages.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ocria_rt.synthdoc.metrics import mean_interval


def per_page_cer(path: Path) -> tuple[np.ndarray, list[int]]:
    d = json.loads(Path(path).read_text())
    return np.array([p["cer"] for p in d["per_page"]]), [p["seed"] for p in d["per_page"]]


def paired_bootstrap(a: np.ndarray, b: np.ndarray, resamples: int = 4000, seed: int = 0) -> dict:
    d = a - b
    return {"mean_difference": float(d.mean()), "ci95": list(mean_interval(d, resamples, seed)),
            "pages": int(len(d)), "pages_differing": int(np.count_nonzero(d))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--resamples", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    (a, seeds_a), (b, seeds_b) = per_page_cer(args.a), per_page_cer(args.b)
    if seeds_a != seeds_b:
        print(f"error: '{args.a}' and '{args.b}' scored different pages (their page seeds differ)", file=sys.stderr)
        return 2
    r = paired_bootstrap(a, b, args.resamples, args.seed)
    lo, hi = r["ci95"]
    print(f"CER A - B over {r['pages']} pages ({r['pages_differing']} differ): {100 * r['mean_difference']:+.2f} points, "
          f"95% interval [{100 * lo:+.2f}, {100 * hi:+.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write generated pages to a folder: ``python -m ocria_rt.synthdoc OUT_DIR [-n 12] [--split heldout]``.

Each page becomes NNNN.png (the image), NNNN.md (its Markdown) and NNNN.json (its meta)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import LAYOUTS, PageConfig, iter_dataset


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ocria_rt.synthdoc", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("-n", type=int, default=12)
    ap.add_argument("--split", default="heldout", choices=["train", "heldout"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--layout", choices=LAYOUTS, default=None)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--fonts", choices=["auto", "pillow"], default="auto")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = PageConfig(layout=args.layout, noise=args.noise, fonts=args.fonts)
    t0 = time.perf_counter()
    for i, (img, md, meta) in enumerate(iter_dataset(args.split, args.n, args.seed, cfg, args.start)):
        stem = args.out / f"{args.start + i:04d}"
        img.save(stem.with_suffix(".png"))
        stem.with_suffix(".md").write_text(md + "\n", encoding="utf-8")
        stem.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    dt = time.perf_counter() - t0
    print(f"{args.n} pages in {dt:.1f} s ({1e3 * dt / max(1, args.n):.0f} ms a page) -> {args.out}")


if __name__ == "__main__":
    main()

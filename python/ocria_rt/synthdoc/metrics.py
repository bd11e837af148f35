"""Scores for page-to-Markdown output: character error rate and HTML-table structure.

- :func:`levenshtein`: edit distance (insertions, deletions, substitutions of characters), with the
  bit-parallel algorithm of Myers (1999) in Hyyrö's formulation, on Python integers as bit vectors:
  O(len(a) * len(b) / 64) word operations, so whole pages take milliseconds.
- :func:`cer`: edit distance / reference length, on texts whose line ends and outer whitespace are
  normalised (trailing spaces per line, leading/trailing blank lines).
- :func:`table_structures`: the structure of every ``<table>`` in a Markdown text (html.parser): per
  row, the cells' tags and spans. A table is *structure-exact* when its structure equals the
  reference's: same number of rows, same number of cells in each row, same header/data cells.
- :func:`evaluate`: both over N held-out generated pages through an ocria_rt Engine (or any function
  from a page image to Markdown).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from html.parser import HTMLParser
from typing import Any


def levenshtein(a: str, b: str) -> int:
    """Character edit distance between a and b."""
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    m = len(b)
    if m == 0:
        return len(a)
    peq: dict[str, int] = {}
    for i, ch in enumerate(b):
        peq[ch] = peq.get(ch, 0) | (1 << i)
    mask = (1 << m) - 1
    high = 1 << (m - 1)
    pv, mv, score = mask, 0, m
    for ch in a:
        eq = peq.get(ch, 0)
        xv = eq | mv
        xh = ((((eq & pv) + pv) & mask) ^ pv) | eq
        ph = (mv | ~(xh | pv)) & mask
        mh = pv & xh
        if ph & high:
            score += 1
        elif mh & high:
            score -= 1
        ph = ((ph << 1) | 1) & mask
        mh = (mh << 1) & mask
        pv = (mh | ~(xv | ph)) & mask
        mv = ph & xv
    return score


def normalize(text: str) -> str:
    """Trailing spaces of each line and blank lines at both ends removed; \\r\\n -> \\n."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


def cer(prediction: str, reference: str) -> float:
    """Character error rate: edits / reference characters (1.0 for an empty reference with output)."""
    p, r = normalize(prediction), normalize(reference)
    if not r:
        return 0.0 if not p else 1.0
    return levenshtein(p, r) / len(r)


class _TableParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[dict[str, Any]] = []
        self._stack: list[dict[str, Any]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._stack.append({"rows": [], "cells": []})
        elif not self._stack:
            return
        elif tag == "tr":
            self._stack[-1]["rows"].append([])
        elif tag in ("td", "th"):
            t = self._stack[-1]
            if not t["rows"]:
                t["rows"].append([])
            a = dict(attrs)
            span = (tag, _int(a.get("colspan")), _int(a.get("rowspan")))
            t["rows"][-1].append(span)
            self._cell = []
            t["cells"].append(self._cell)

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._cell = None
        elif tag == "table" and self._stack:
            t = self._stack.pop()
            self.tables.append({"rows": t["rows"], "text": ["".join(c).strip() for c in t["cells"]]})

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _int(v: str | None) -> int:
    try:
        return max(1, int(v)) if v is not None else 1
    except ValueError:
        return 1


def parse_tables(text: str) -> list[dict[str, Any]]:
    """Every <table> of a text, in order: {"rows": [[(tag, colspan, rowspan), ...], ...], "text": [cell text]}.
    Unclosed tables at the end are included."""
    p = _TableParser()
    p.feed(text)
    p.close()
    while p._stack:  # unclosed (e.g. generation stopped at the token limit)
        t = p._stack.pop(0)
        p.tables.append({"rows": t["rows"], "text": ["".join(c).strip() for c in t["cells"]]})
    return p.tables


def table_structures(text: str) -> list[tuple[tuple[tuple[str, int, int], ...], ...]]:
    return [tuple(tuple(r) for r in t["rows"]) for t in parse_tables(text)]


def table_shape(structure: tuple) -> tuple[int, int]:
    """(rows, columns) of a structure (columns: the widest row, counting colspans)."""
    return len(structure), max((sum(c[1] for c in r) for r in structure), default=0)


def score_page(prediction: str, reference: str) -> dict[str, Any]:
    """CER and table-structure matches of one page (the i-th table of each text are compared)."""
    ref_t = table_structures(reference)
    pred_t = table_structures(prediction)
    exact = [i < len(pred_t) and pred_t[i] == s for i, s in enumerate(ref_t)]
    p, r = normalize(prediction), normalize(reference)
    dist = levenshtein(p, r)
    return {"cer": dist / max(1, len(r)), "edits": dist, "ref_chars": len(r), "pred_chars": len(p),
            "tables": len(ref_t), "tables_exact": sum(exact), "pred_tables": len(pred_t),
            "table_exact": exact}


def mean_interval(values: Any, resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the mean of `values` (one per page): the 2.5th and 97.5th percentiles of
    the means of `resamples` resamplings with replacement (Efron & Tibshirani, An Introduction to the
    Bootstrap, ch. 13). Of per-page differences between two runs over the same pages, it says whether
    the runs are told apart by these pages (an interval holding 0: not)."""
    import numpy as np

    v = np.asarray(values, np.float64)
    if v.size == 0:
        return 0.0, 0.0
    means = v[np.random.default_rng(seed).integers(0, v.size, (resamples, v.size))].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def summarize(pages: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(pages)
    tables = sum(p["tables"] for p in pages)
    exact = sum(p["tables_exact"] for p in pages)
    edits = sum(p["edits"] for p in pages)
    chars = sum(p["ref_chars"] for p in pages)
    return {
        "pages": n,
        "cer": sum(p["cer"] for p in pages) / n if n else 0.0,  # mean over pages
        "cer_ci95": list(mean_interval([p["cer"] for p in pages])),  # what resampling the pages moves it by
        "cer_micro": edits / chars if chars else 0.0,  # all edits / all reference characters
        "cer_median": sorted(p["cer"] for p in pages)[n // 2] if n else 0.0,
        "tables": tables,
        "tables_exact": exact,
        "table_exact_rate": exact / tables if tables else None,
    }


def evaluate(engine_or_fn: Any, n_pages: int = 200, seed: int = 0, config: Any = None, *,
             max_new_tokens: int = 2048, prompt: str | None = None, progress: bool = False,
             keep_outputs: int = 3, compare_plain: bool = False) -> dict[str, Any]:
    """CER and table-structure exactness over `n_pages` held-out pages (``iter_dataset("heldout", n, seed)``).

    engine_or_fn: an ocria_rt.Engine holding a VLM (each page goes through ``Engine.chat`` with the
    image and the prompt, greedy), or a function ``(PIL.Image, prompt) -> markdown``.
    prompt: default ocria_rt.pipeline.DEFAULT_PROMPT (what ``ocria_rt.parse`` sends).
    Returns summarize()'s figures, plus seconds, pages_per_s, by_layout (summarize() of each layout's
    pages), per_page (cer, tables, ...) and the first `keep_outputs` (prediction, reference) pairs
    under "samples".
    With an Engine also "decode": the generated tokens, decode seconds and decode tokens/s over all pages
    (a page's first token comes from its prefill and is not counted) and, when the engine has a drafter,
    the acceptance lengths' mean (tau), histogram (tokens per verify step -> steps) and verify steps.
    compare_plain (an Engine with a drafter only): each page is generated a second time without
    speculation, adding the plain decode figures, the speed-up and how many pages came out
    token-identical (greedy speculative decoding is lossless, so all).
    """
    from ocria_rt.errors import InvalidArgumentError

    from . import iter_dataset

    if prompt is None:
        from ocria_rt.pipeline import DEFAULT_PROMPT

        prompt = DEFAULT_PROMPT
    decode: dict[str, Any] | None = None
    if callable(engine_or_fn) and not hasattr(engine_or_fn, "chat"):
        if compare_plain:
            raise InvalidArgumentError("compare_plain needs an Engine with a drafter, not a function")
        fn: Callable[[Any, str], str] = engine_or_fn
    else:
        eng = engine_or_fn
        if compare_plain and getattr(eng, "drafter_dir", None) is None:
            raise InvalidArgumentError("compare_plain needs an Engine with a drafter (Engine(model, drafter=DIR))")
        decode = {"tokens": 0, "seconds": 0.0, "acceptance_lengths": [], "plain_seconds": 0.0, "identical_pages": 0}

        def fn(image: Any, text: str) -> str:
            msgs = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]
            r = eng.chat(msgs, max_new_tokens=max_new_tokens, temperature=0.0)
            decode["tokens"] += max(len(r.token_ids) - 1, 0)
            decode["seconds"] += r.decode_seconds
            decode["acceptance_lengths"] += r.acceptance_lengths
            if compare_plain:
                plain = eng.chat(msgs, max_new_tokens=max_new_tokens, temperature=0.0, speculative=False)
                decode["plain_seconds"] += plain.decode_seconds
                decode["identical_pages"] += plain.token_ids == r.token_ids
            return (r.text or "").strip()

    t0 = time.perf_counter()
    pages, samples = [], []
    for i, (image, ref, meta) in enumerate(iter_dataset("heldout", n_pages, seed, config)):
        pred = fn(image, prompt)
        s = score_page(pred, ref)
        s.update(seed=meta["seed"], layout=meta["layout"], size=[meta["width"], meta["height"]])
        pages.append(s)
        if i < keep_outputs:
            samples.append({"seed": meta["seed"], "prediction": pred, "reference": ref})
        if progress:
            print(f"  page {i + 1}/{n_pages}: cer {s['cer']:.4f} tables {s['tables_exact']}/{s['tables']}", flush=True)
    out = summarize(pages)
    dt = time.perf_counter() - t0
    by_layout = {name: summarize([p for p in pages if p["layout"] == name])
                 for name in sorted({p["layout"] for p in pages})}
    out.update(seconds=dt, pages_per_s=len(pages) / dt if dt > 0 else 0.0, seed=seed, by_layout=by_layout,
               per_page=pages, samples=samples)
    if decode is not None:
        out["decode"] = _decode_figures(decode, compare_plain)
    return out


def _decode_figures(d: dict[str, Any], compare_plain: bool) -> dict[str, Any]:
    """evaluate()'s "decode" entry from its sums over the pages."""
    def rate(seconds: float) -> float:
        return d["tokens"] / seconds if seconds > 0 else 0.0

    out: dict[str, Any] = {"tokens": d["tokens"], "seconds": d["seconds"], "tokens_per_s": rate(d["seconds"])}
    acc = d["acceptance_lengths"]
    if acc:
        out.update(verify_steps=len(acc), mean_acceptance_length=sum(acc) / len(acc),
                   acceptance_histogram=dict(sorted(Counter(acc).items())))
    if compare_plain:
        out.update(plain_seconds=d["plain_seconds"], plain_tokens_per_s=rate(d["plain_seconds"]),
                   speedup=d["plain_seconds"] / d["seconds"] if d["seconds"] > 0 else 0.0,
                   identical_pages=d["identical_pages"])
    return out

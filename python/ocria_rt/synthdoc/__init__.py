"""Synthetic document pages with their exact Markdown, for training and evaluating page-to-Markdown models.

>>> from ocria_rt.synthdoc import generate_page, iter_dataset, PageConfig
>>> image, markdown, meta = generate_page(1234)                  # deterministic for a seed
>>> for image, markdown, meta in iter_dataset("heldout", 200, seed=0):
...     ...

Pages hold headings, paragraphs, bulleted / numbered / checkbox lists, tables (HTML ``<table>`` in the
Markdown), key-value forms, invoices and letters, running headers, footers and page numbers, in one or
two columns, several fonts and sizes, with light scan noise. Text comes from `faker` in several
locales (the version ocria-rt pins; ``PageConfig(use_faker=False)``: built-in word lists). Fonts are
Pillow's bundled font plus families found on the machine (see :mod:`.fonts`); nothing is downloaded.
A seed's page is the same wherever the text source and the font families (their files) are:
:func:`page_sources` names both, training records them (training.json) and ``ocria-rt eval`` checks
them. Dependencies: Pillow, numpy and faker. This subpackage imports nothing from the rest of
ocria_rt except in :func:`evaluate` (its default prompt), so training scripts can use it without the
compiled engine.

Splits: ``page_seed(split, index, seed)`` maps a page of a split to the seed given to
``generate_page``; training seeds are even and held-out seeds odd, so the two never overlap whatever
`seed` and `index` are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .layout import Laid, Typo
from .metrics import cer, evaluate, levenshtein, normalize, parse_tables, score_page, summarize, table_shape, table_structures
from .pages import LAYOUTS, LAYOUT_WEIGHTS, PageConfig, compose, generate_page, with_overrides
from .fonts import available_families, family_records
from .text import TextSourceMissing, faker_available, text_source

SPLITS = {"train": 0, "heldout": 1}
MAX_INDEX = 2**32
MAX_SPLIT_SEED = 2**30


def page_seed(split: str, index: int, seed: int = 0) -> int:
    """The generate_page seed of page `index` of `split` ("train" or "heldout") under base `seed`.

    seed and index select disjoint ranges; the lowest bit is the split, so train and held-out seeds
    never coincide."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if not 0 <= index < MAX_INDEX:
        raise ValueError(f"index must be in [0, 2**32), got {index}")
    if not 0 <= seed < MAX_SPLIT_SEED:
        raise ValueError(f"seed must be in [0, 2**30), got {seed}")
    return (((seed << 32) | index) << 1) | SPLITS[split]


def split_of(page_seed_value: int) -> str:
    """The split a page seed belongs to."""
    return "heldout" if page_seed_value & 1 else "train"


def iter_dataset(split: str, n: int, seed: int = 0, config: PageConfig | None = None,
                 start: int = 0) -> Iterator[tuple[Any, str, dict[str, Any]]]:
    """(image, markdown, meta) of pages start .. start + n - 1 of a split (meta["seed"] is the page seed)."""
    for i in range(start, start + n):
        yield generate_page(page_seed(split, i, seed), config)


def training_data_page_config(data: dict[str, Any]) -> PageConfig:
    """The pages of a training run's data distribution (scripts/train_ocr's DataSpec, as saved in its
    checkpoints and in an export's training.json): long side, aspect, landscape share, body size,
    noise, locales, and ``max_chars`` = the upper end of its character budget, as in training's own
    held-out metric. Other keys are ignored; a missing or malformed one raises KeyError / ValueError /
    TypeError / IndexError."""
    pair = lambda key, kind: tuple(kind(x) for x in data[key])  # noqa: E731
    kw: dict[str, Any] = {"long_side": pair("long_side", int), "body_px": pair("body_px", int),
                          "max_chars": int(data["chars"][1])}
    if "aspect" in data:
        kw["aspect"] = pair("aspect", float)
    for key in ("landscape", "noise"):
        if key in data:
            kw[key] = float(data[key])
    if data.get("locales"):
        kw["locales"] = tuple(str(x) for x in data["locales"])
    if len(kw["long_side"]) != 2 or len(kw["body_px"]) != 2:
        raise ValueError("long_side and body_px must be [low, high]")
    return with_overrides(None, **kw)


def page_sources(config: PageConfig | None = None) -> dict[str, Any]:
    """What the pages of `config` are drawn from here besides the seed: {"text_source": text_source(),
    "fonts": [{"family", "sha256"}, ...] (the families found, in the order pages draw from)}.
    Raises TextSourceMissing where the text should come from faker and faker is not installed."""
    cfg = config or PageConfig()
    return {"text_source": text_source(cfg.use_faker), "fonts": family_records(cfg.fonts)}


def training_page_config(model_dir: str | Path) -> PageConfig | None:
    """The pages a model was trained on, from the ``training.json`` that scripts/train_ocr/export.py writes
    next to its weights (training_data_page_config of its "data"); None when the model has no such file.
    A malformed file raises ValueError naming it and the field."""
    path = Path(model_dir) / "training.json"
    if not path.is_file():
        return None
    try:
        return training_data_page_config(json.loads(path.read_text())["data"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"{path}: no usable page distribution under \"data\" ({type(e).__name__}: {e})") from None


def training_page_sources(model_dir: str | Path) -> dict[str, Any] | None:
    """The text source and font families a model's training pages were drawn from (page_sources() of
    the training machine, as scripts/train_ocr/export.py writes them into training.json): a dict with
    "text_source" and / or "fonts", None when the model has no training.json or it records neither.
    A malformed record raises ValueError naming the file and the field."""
    path = Path(model_dir) / "training.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    out: dict[str, Any] = {}
    text = data.get("text_source")
    if text is not None:
        if not (isinstance(text, dict) and isinstance(text.get("generator"), str)
                and all(isinstance(v, str) for v in text.values())):
            raise ValueError(f'{path}: "text_source" must be an object of strings with a "generator", got {text!r}')
        out["text_source"] = text
    fonts = data.get("fonts")
    if fonts is not None:
        if not (isinstance(fonts, list) and fonts and all(
                isinstance(f, dict) and isinstance(f.get("family"), str) and isinstance(f.get("sha256"), (str, type(None)))
                for f in fonts)):
            raise ValueError(f'{path}: "fonts" must be a non-empty list of {{"family": name, "sha256": digest or null}}, '
                             f"got {fonts!r}")
        out["fonts"] = fonts
    return out or None


def heldout_page_config(model_dir: str | Path) -> tuple[PageConfig, dict[str, Any]]:
    """The held-out pages `ocria-rt eval` scores a model on, and how this machine compares with the one
    the model was trained on: (config, report).

    config: training_page_config (else synthdoc's defaults), drawing its text from the recorded source
    and its fonts from the recorded families in their order, a family missing here drawn with a found
    one of its kind (fonts.substitute): a seed's page is then the training machine's wherever its family
    is here with the same files (all found families when none is recorded).
    report: text_trained / text_here (text_source() dicts; text_here None where the needed generator is
    missing here), text_matches (None when nothing is recorded), fonts_trained (recorded names or None),
    fonts_found (family_records() here), fonts_used (the family drawing each slot), fonts_missing
    ({recorded family not found here: its substitute}), fonts_other_files (found here with other files
    than recorded). Raises ValueError naming training.json and the field when it is malformed."""
    cfg = training_page_config(model_dir) or PageConfig()
    record = training_page_sources(model_dir) or {}
    path = Path(model_dir) / "training.json"
    report: dict[str, Any] = {}
    text_trained = record.get("text_source")
    if text_trained is not None:
        if text_trained["generator"] not in ("faker", "synthdoc word lists"):
            raise ValueError(f'{path}: "text_source" names an unknown generator {text_trained["generator"]!r}')
        cfg = with_overrides(cfg, use_faker=text_trained["generator"] == "faker")
    try:
        text_here: dict[str, str] | None = text_source(cfg.use_faker)
    except TextSourceMissing:
        text_here = None
    report.update(text_trained=text_trained, text_here=text_here,
                  text_matches=None if text_trained is None else text_here == text_trained)
    found = family_records("auto")
    found_digest = {f["family"]: f["sha256"] for f in found}
    trained = record.get("fonts")
    if trained is not None:
        cfg = with_overrides(cfg, fonts=tuple(f["family"] for f in trained))
    try:
        drawn = available_families(cfg.fonts)
    except ValueError as e:
        raise ValueError(f'{path}: "fonts": {e}') from None
    report.update(
        fonts_trained=None if trained is None else [f["family"] for f in trained],
        fonts_found=found,
        fonts_used=[f.name for f in drawn],
        fonts_missing={f["family"]: d.name for f, d in zip(trained or [], drawn) if f["family"] not in found_digest},
        fonts_other_files=[f["family"] for f in trained or []
                           if f["family"] in found_digest and f["sha256"] != found_digest[f["family"]]],
    )
    return cfg, report


__all__ = [
    "LAYOUTS",
    "LAYOUT_WEIGHTS",
    "Laid",
    "PageConfig",
    "SPLITS",
    "TextSourceMissing",
    "Typo",
    "available_families",
    "cer",
    "compose",
    "evaluate",
    "faker_available",
    "family_records",
    "generate_page",
    "heldout_page_config",
    "iter_dataset",
    "levenshtein",
    "normalize",
    "page_seed",
    "page_sources",
    "parse_tables",
    "score_page",
    "split_of",
    "summarize",
    "table_shape",
    "table_structures",
    "text_source",
    "training_data_page_config",
    "training_page_config",
    "training_page_sources",
    "with_overrides",
]

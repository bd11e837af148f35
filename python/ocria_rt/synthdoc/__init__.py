"""Synthetic document pages with their exact Markdown, for training and evaluating page-to-Markdown models.

>>> from ocria_rt.synthdoc import generate_page, iter_dataset, PageConfig
>>> image, markdown, meta = generate_page(1234)                  # deterministic for a seed
>>> for image, markdown, meta in iter_dataset("heldout", 200, seed=0):
...     ...

Pages hold headings, paragraphs, bulleted / numbered / checkbox lists, tables (HTML ``<table>`` in the
Markdown), key-value forms, invoices and letters, running headers, footers and page numbers, in one or
two columns, several fonts and sizes, with light scan noise. Text comes from `faker` in several
locales when it is installed (``pip install faker``; the ``[data]`` extra), else from built-in word
lists. Fonts are Pillow's bundled font plus families found on the machine (see :mod:`.fonts`); nothing
is downloaded. Dependencies: Pillow and numpy (faker optional). This subpackage imports nothing from
the rest of ocria_rt except in :func:`evaluate` (its default prompt), so training scripts can use it
without the compiled engine.

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
from .text import faker_available

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


__all__ = [
    "LAYOUTS",
    "LAYOUT_WEIGHTS",
    "Laid",
    "PageConfig",
    "SPLITS",
    "Typo",
    "cer",
    "compose",
    "evaluate",
    "faker_available",
    "generate_page",
    "iter_dataset",
    "levenshtein",
    "normalize",
    "page_seed",
    "parse_tables",
    "score_page",
    "split_of",
    "summarize",
    "table_shape",
    "table_structures",
    "training_data_page_config",
    "training_page_config",
    "with_overrides",
]

"""Calibration data for quantization: token sequences that run through the real engine, each a prompt
followed by a teacher-forced continuation.

- Page images (a VLM): the chat prompt parse() sends with the page (the same rendering and
  preprocessing), followed by the page's true Markdown for synthetic pages (ocria_rt.synthdoc, the
  training split) or the model's own greedy output for PDF / image files, then the end token.
- Text (a model without vision, or a .txt / .md file): its tokens; a model without a tokenizer is
  calibrated on seeded random token ids.

Statistics of the projections' inputs are collected by the engine over every token of the calibration
samples (Engine.observe_linear_inputs); the quality of a trial quantization is the KL divergence of the
next-token distributions from the unquantized model's over the continuation tokens of held-out samples,
whose logits the engine keeps on its device and compares there (Engine.keep_reference, reference_kl).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FileError, InvalidArgumentError

TEXT_SUFFIXES = (".txt", ".md")
RANDOM_SEQUENCE_TOKENS = 64


@dataclass
class Sample:
    ids: list[int]
    answer_start: int  # index of the first continuation token (>= 1)
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    source: str = ""

    @property
    def answer_tokens(self) -> int:
        return len(self.ids) - self.answer_start


def check_files(paths: Sequence[str | Path], has_vision: bool) -> None:
    """Raises an OcriaError naming the first calibration file that cannot be used."""
    from ..pipeline import _inspect

    if not paths:
        raise InvalidArgumentError("no calibration files given")
    for p in map(Path, paths):
        if p.suffix.lower() in TEXT_SUFFIXES:
            _read_text(p)
        elif not has_vision:
            raise InvalidArgumentError(f"calibration file '{p}': a model without a vision encoder is calibrated "
                                       f"on text (.txt, .md), not on PDFs or images")
        else:
            _inspect(p, None)


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FileError(f"cannot read calibration text file '{path}': {e}") from e
    if not text.strip():
        raise FileError(f"calibration text file '{path}' is empty")
    return text


def _end_token(eng: Any) -> list[int]:
    return [int(eng.eos_token_ids[0])] if eng.eos_token_ids else []


def _page_prompt(eng: Any, image_item: dict[str, Any]) -> tuple[list[int], np.ndarray, np.ndarray]:
    from ..chat import build_multimodal_prompt
    from ..pipeline import DEFAULT_PROMPT

    messages = [{"role": "user", "content": [image_item, {"type": "text", "text": DEFAULT_PROMPT}]}]
    ids, pv, grid = build_multimodal_prompt(eng, messages)
    return ids, pv, grid


def synthetic_samples(eng: Any, n: int, seed: int = 0, page_config: Any = None,
                      tick: Callable[[], None] | None = None, split: str = "train") -> list[Sample]:
    """n samples from a synthdoc split ("train"; "heldout": the pages `ocria-rt eval` scores) in the model's
    training distribution when its directory has a training.json, else synthdoc's defaults (`page_config`
    replaces it)."""
    from ..synthdoc import PageConfig, iter_dataset, training_page_config

    has_vision = bool(eng.config.get("has_vision"))
    if eng.tokenizer is None:  # nothing to read text with: seeded random token ids
        rng = np.random.default_rng(seed)
        out = []
        for i in range(n):
            out.append(Sample([int(t) for t in rng.integers(0, eng.vocab_size, RANDOM_SEQUENCE_TOKENS)], 1,
                              source=f"random tokens {i}"))
            if tick:
                tick()
        return out
    cfg = page_config or training_page_config(eng.model_dir) or PageConfig()
    if not has_vision:
        from dataclasses import replace

        cfg = replace(cfg, render=False)
    out = []
    for image, markdown, meta in iter_dataset(split, n, seed, cfg):
        answer = eng.encode(markdown) + _end_token(eng)
        source = f"synthdoc page {meta['seed']}"
        if has_vision:
            ids, pv, grid = _page_prompt(eng, {"type": "image", "image": image})
            out.append(Sample(ids + answer, len(ids), pv, grid, source))
        else:
            out.append(Sample(answer, 1, source=source))
        if tick:
            tick()
    return out


def file_samples(eng: Any, paths: Sequence[str | Path], max_new_tokens: int = 512,
                 tick: Callable[[], None] | None = None) -> list[Sample]:
    """One sample per page of each PDF / image (continued by the model's greedy output) and one per text
    file; check_files() first."""
    from ..pipeline import _inspect, _Options, _pages_of
    from ..preprocess import DEFAULT_MAX_IMAGE_PIXELS, ImageProcessorConfig, preprocess_image

    out: list[Sample] = []
    for p in map(Path, paths):
        if p.suffix.lower() in TEXT_SUFFIXES:
            ids = eng.encode(_read_text(p)) if eng.tokenizer is not None else None
            if not ids or len(ids) < 2:
                raise InvalidArgumentError(f"calibration text file '{p}' gives fewer than 2 tokens"
                                           if ids is not None else f"model '{eng.model_dir}' has no tokenizer to read "
                                           f"calibration text file '{p}'")
            out.append(Sample(ids[: eng.max_context], 1, source=str(p)))
            if tick:
                tick()
            continue
        cfg = ImageProcessorConfig.from_model_dir(eng.model_dir)
        opt = _Options(cfg=cfg, dpi=None, target_long_side=1288, max_image_pixels=DEFAULT_MAX_IMAGE_PIXELS,
                       backend=None)
        for i, image, _, error in _pages_of(_inspect(p, None), opt):
            if error is not None:
                raise FileError(f"calibration file '{p}', page {i + 1}: {error}")
            pv, grid = preprocess_image(image, cfg, max_image_pixels=DEFAULT_MAX_IMAGE_PIXELS)
            ids, pv, grid = _page_prompt(eng, {"type": "image", "pixel_values": pv, "image_grid_thw": grid})
            room = min(max_new_tokens, eng.max_context - len(ids))
            if room < 1:
                raise InvalidArgumentError(f"calibration file '{p}', page {i + 1}: its prompt of {len(ids)} tokens "
                                           f"leaves no room in the model's context of {eng.max_context}")
            answer = eng.generate(ids, room, pixel_values=pv, image_grid_thw=grid).token_ids
            out.append(Sample(ids + list(answer), len(ids), pv, grid, f"{p} page {i + 1}"))
            if tick:
                tick()
    return out


def collect_stats(eng: Any, samples: Sequence[Sample], tick: Callable[[], None] | None = None) -> list[dict]:
    """Per projection of eng.linear_groups(): the statistics of its input over every token of the samples,
    with the second moment X^T X / n. Each sample runs as a reference of all its rows, dropped at once: the
    LM head sees every row, as in score(), without the logits coming back to the host."""
    eng.observe_linear_inputs(True, second_moment=True)
    try:
        for s in samples:
            eng.keep_reference(s.ids, 0, len(s.ids), s.pixel_values, s.image_grid_thw)
            eng.clear_references()
            if tick:
                tick()
    finally:
        eng.observe_linear_inputs(False)
    return eng.linear_input_stats()


def keep_reference(eng: Any, s: Sample, logits: np.ndarray | None = None) -> int:
    """Keeps the sample's continuation distributions on the engine's device (Engine.keep_reference): the
    logits of rows answer_start - 1 .. n - 2, which predict the continuation tokens; `logits` (another
    engine's, Engine.reference_logits) instead of the engine's own. Returns the reference's index."""
    return eng.keep_reference(s.ids, s.answer_start - 1, len(s.ids) - 1, s.pixel_values, s.image_grid_thw, logits)


def kl_divergence(eng: Any, references: Sequence[int]) -> float:
    """Mean over the kept references' continuation tokens of KL(reference || eng) in nats."""
    per_row = [eng.reference_kl(i) for i in references]
    return float(sum(float(np.sum(k)) for k in per_row)) / max(sum(len(k) for k in per_row), 1)

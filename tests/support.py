"""Helpers shared by the tests: fixture paths, reference loading, relative error."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import ocria_rt

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PACKAGE_MODELS = Path(ocria_rt.__file__).resolve().parent / "models"  # the models of the package under test
TINY_RANDOM = PACKAGE_MODELS / "tiny-random"  # random weights: the engine tests' small text model
TINY_VLM = PACKAGE_MODELS / "tiny-vlm"  # random weights: the tests' small VLM
MODEL_FIXTURES = ["text_tied", "text_untied_dkdv", "vlm_untied"]


def relerr(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||; NaN or inf anywhere gives inf."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def load_reference(name: str) -> dict[str, np.ndarray]:
    path = FIXTURES / "tiny_random_ref.npz" if name == "tiny-random" else FIXTURES / name / "reference.npz"
    return dict(np.load(path))


def check_post_mailbox(runner) -> None:
    """Backend.post_i32 / wait_post_i32 on an OpRunner: steps queued without a wait (replays of one
    captured graph where the backend has graphs) each post (value, tag), then advance both on the
    device. Waiting returns each tag's own value. The mailbox has 8 slots, so once 12 posts are done
    the first 4 tags are gone; waiting for one of them, or for a tag never posted, is an InternalError."""
    assert runner.post_steps(100, 5, 6, [5, 6, 7, 8, 9, 10]) == [100, 103, 106, 109, 112, 115]
    assert runner.post_steps(7, 0, 12, [11, 4, 8], drain=True) == [7 + 3 * 11, 7 + 3 * 4, 7 + 3 * 8]
    for steps, tag in [(12, 3), (3, 3), (3, -1)]:
        with pytest.raises(ocria_rt.errors.InternalError, match=f"no post tagged {tag} "):
            runner.post_steps(0, 0, steps, [tag], drain=True)


def check_vector_posts(runner) -> None:
    """Backend.post_i32 of vectors (a speculative step's count and tokens) on an OpRunner: steps queued
    without a wait (replays of one captured graph where the backend has graphs) each post the vector
    under a tag, then add 1 to every value and the tag on the device. Waiting returns each tag's own
    vector, whole; the 8-slot mailbox forgets the oldest; one value and kMaxPostValues (64) values are
    posts, 65 and none are errors (checked outside a capture)."""
    block = [7] + list(range(100, 116))  # a count, then B = 16 tokens
    got = runner.post_vector_steps(block, 0, 6, [0, 1, 2, 3, 4, 5])
    assert got == [[v + k for v in block] for k in range(6)]
    got = runner.post_vector_steps(block, 3, 12, [14, 7, 10], drain=True)
    assert got == [[v + k for v in block] for k in (11, 4, 7)]
    with pytest.raises(ocria_rt.errors.InternalError, match="no post tagged 3 "):
        runner.post_vector_steps(block, 3, 12, [3], drain=True)
    assert runner.post_vector_steps([9], 2, 1, [2]) == [[9]]
    widest = list(range(-32, 32))
    assert runner.post_vector_steps(widest, 0, 2, [1]) == [[v + 1 for v in widest]]
    assert runner.post_vector(widest, 5) == widest
    for values in (list(range(65)), []):
        with pytest.raises(ocria_rt.errors.InternalError, match="post_i32: expected 1..64 contiguous I32 values"):
            runner.post_vector(values, 0)


def chi2_pvalue(counts, probs) -> float:
    """Goodness of fit of counts to probs (cells of expected count < 5 pooled), Wilson-Hilferty."""
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    n = counts.sum()
    small = probs * n < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        probs = np.append(probs[~small], probs[small].sum())
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a draw outside the distribution's support"
    counts, probs = counts[keep], probs[keep]
    stat = float(((counts - n * probs) ** 2 / (n * probs)).sum())
    k = len(counts) - 1
    if k < 1:
        return 1.0
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))

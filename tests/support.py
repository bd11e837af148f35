"""Helpers shared by the tests: fixture paths, reference loading, relative error."""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PACKAGE_MODELS = Path(__file__).resolve().parent.parent / "python" / "ocria_rt" / "models"
TINY_RANDOM = PACKAGE_MODELS / "tiny-random"  # random weights: the engine tests' small text model
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

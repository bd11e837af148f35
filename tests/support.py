"""Helpers shared by the tests: fixture paths, reference loading, relative error."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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

"""Deterministic synthetic test images for the vision tests, shared by the fixture generator
(tests/fixtures/make_vision_fixtures.py) and the tests.

Pixels come from integer arithmetic only (no RNG, no floating point), so every platform and numpy
version draws the same images. Small cases are also saved as PNG under tests/fixtures/images/ by the
generator; large ones are drawn on the fly from the same recipe.
"""

from __future__ import annotations

import numpy as np

IMAGES_DIR_NAME = "images"


def synth_rgb(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A HxWx3 uint8 image with gradients, stripes, blocks and hash-like texture (sharp edges and
    fine detail, so that resampling differences show), from integer arithmetic only."""
    y = np.arange(height, dtype=np.int64)[:, None]
    x = np.arange(width, dtype=np.int64)[None, :]
    s = int(seed)
    r = (x * 255 // max(width - 1, 1) + s * 37) % 256 + 0 * y
    g = (y * 255 // max(height - 1, 1) + s * 91) % 256 + 0 * x
    b = ((x * 7 + y * 13) ^ (x * y + s * 11)) % 256
    img = np.stack([r, g, b], axis=-1)
    # dark "text-like" blocks on a grid, and thin lines
    block = ((x // 5 + y // 7 + s) % 3 == 0) & ((x * 3 + y * 5 + s) % 17 < 6)
    img = np.where(block[..., None], img // 4, img)
    lines = ((y + s) % 11 == 0) | ((x + 2 * s) % 23 == 0)
    img = np.where(lines[..., None], 255 - img, img)
    return img.astype(np.uint8)


def synth_alpha(height: int, width: int, seed: int = 0) -> np.ndarray:
    y = np.arange(height, dtype=np.int64)[:, None]
    x = np.arange(width, dtype=np.int64)[None, :]
    return ((x * 31 + y * 17 + seed * 5) % 256).astype(np.uint8)


def make_pil(case: dict):
    """The PIL.Image of a case (mode RGB, L, RGBA or P)."""
    from PIL import Image

    h, w, seed, mode = case["height"], case["width"], case["seed"], case["mode"]
    rgb = synth_rgb(h, w, seed)
    if mode == "RGB":
        return Image.fromarray(rgb)
    if mode == "L":
        gray = ((rgb[..., 0].astype(np.int64) * 3 + rgb[..., 1] * 5 + rgb[..., 2] * 2) // 10).astype(np.uint8)
        return Image.fromarray(gray)
    if mode == "RGBA":
        return Image.fromarray(np.concatenate([rgb, synth_alpha(h, w, seed)[..., None]], axis=-1))
    if mode == "P":
        # a fixed 64-colour palette; index from integer arithmetic (no quantizer involved)
        pal = np.array([[(i * 37) % 256, (i * 91) % 256, (i * 53) % 256] for i in range(64)], dtype=np.uint8)
        idx = ((rgb[..., 0].astype(np.int64) // 64) * 16 + (rgb[..., 1] // 64) * 4 + rgb[..., 2] // 64).astype(np.uint8)
        im = Image.frombytes("P", (w, h), np.ascontiguousarray(idx).tobytes())
        im.putpalette(pal.reshape(-1).tolist())
        return im
    raise ValueError(mode)


# name -> height, width, seed, mode, stored (PNG under tests/fixtures/images/)
PREPROCESS_CASES: dict[str, dict] = {
    "tiny_rgb": dict(height=15, width=20, seed=1, mode="RGB", stored=True),
    "wide": dict(height=60, width=1200, seed=2, mode="RGB", stored=False),
    "tall": dict(height=1000, width=50, seed=3, mode="RGB", stored=False),
    "huge": dict(height=2200, width=3000, seed=4, mode="RGB", stored=False),
    "mixed": dict(height=1000, width=700, seed=5, mode="RGB", stored=False),
    "exact": dict(height=64, width=96, seed=6, mode="RGB", stored=False),
    "gray": dict(height=53, width=37, seed=7, mode="L", stored=True),
    "rgba": dict(height=33, width=45, seed=8, mode="RGBA", stored=True),
    "palette": dict(height=40, width=64, seed=9, mode="P", stored=True),
}

# The two images of tests/fixtures/vision_reference.npz (different aspect ratios).
VISION_CASES: dict[str, dict] = {
    "vis_a": dict(height=60, width=100, seed=11, mode="RGB", stored=True),
    "vis_b": dict(height=130, width=40, seed=12, mode="RGB", stored=True),
}

# Image-processor configs the preprocess references are made with.
PREPROCESS_CONFIGS: dict[str, dict] = {
    # the tiny VLM fixture's preprocessor_config.json (a handful of patches per image)
    "tiny": {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
    # the pixel range and normalisation Qwen3-VL / Qwen3.5 checkpoints ship
    "qwen35": {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
    # transformers' Qwen2VLImageProcessor class defaults (patch 14, CLIP mean/std)
    "defaults": {},
}

# Full pixel_values are stored only for these (config, case) pairs (keeps the .npz small);
# every other output is stored as a summary.
FULL_STORE = {("tiny", "tiny_rgb"), ("tiny", "palette")}
SAMPLE_COUNT = 128
CHUNKS = 64


def summary_sample_indices(n_elements: int, seed: int) -> np.ndarray:
    """SAMPLE_COUNT flat indices in [0, n_elements), from integer arithmetic."""
    k = np.arange(SAMPLE_COUNT, dtype=np.int64)
    return ((k * 2654435761 + seed * 97 + (k * k) * 40503) % n_elements).astype(np.int64)


def summarize(pixel_values: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """shape, mean, std, the sums over CHUNKS contiguous groups of patches (rows), and
    SAMPLE_COUNT elements at fixed pseudo-random flat indices."""
    pv = np.asarray(pixel_values, dtype=np.float32)
    idx = summary_sample_indices(pv.size, seed)
    rows = pv.astype(np.float64).sum(axis=1)
    bounds = np.linspace(0, len(rows), CHUNKS + 1).astype(np.int64)
    return {
        "shape": np.array(pv.shape, dtype=np.int64),
        "mean": np.array(pv.astype(np.float64).mean()),
        "std": np.array(pv.astype(np.float64).std()),
        "chunk_sums": np.array([rows[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])]),
        "sample_idx": idx.astype(np.int32),
        "sample_val": pv.reshape(-1)[idx],
    }

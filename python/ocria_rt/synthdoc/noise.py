"""Light scan noise: paper tint, contrast, a slight rotation, blur, sensor noise, resolution loss and
JPEG artefacts, each applied with some probability (scaled by `strength`). The page keeps its size."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageFilter


def scan_noise(img: Image.Image, rng: np.random.Generator, strength: float = 1.0) -> tuple[Image.Image, dict]:
    """(noisy image, what was applied). strength 0 returns the image untouched."""
    info: dict = {}
    if strength <= 0:
        return img, info

    def maybe(p: float) -> bool:
        return bool(rng.random() < min(1.0, p * strength))

    w, h = img.size
    arr = None  # float32 HxWx3 when a pixel-wise effect is pending
    if maybe(0.35):  # paper tint
        tint = np.array([rng.uniform(238, 255), rng.uniform(235, 252), rng.uniform(225, 248)], np.float32) / 255.0
        arr = np.asarray(img, dtype=np.float32) * tint
        info["tint"] = [round(float(t), 3) for t in tint]
    if maybe(0.3):  # contrast / brightness
        c, b = float(rng.uniform(0.75, 1.1)), float(rng.uniform(-12, 18))
        if arr is None:
            arr = np.asarray(img, dtype=np.float32)
        arr = (arr - 128.0) * c + 128.0 + b
        info["contrast"] = [round(c, 3), round(b, 1)]
    if arr is not None:
        img = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8))
    if maybe(0.4):  # slight rotation
        angle = float(rng.uniform(-1.2, 1.2))
        bg = img.getpixel((1, 1))
        img = img.rotate(angle, resample=Image.Resampling.BILINEAR, fillcolor=bg)
        info["rotate"] = round(angle, 3)
    if maybe(0.15):  # resolution loss
        f = float(rng.uniform(0.65, 0.9))
        small = img.resize((max(1, round(w * f)), max(1, round(h * f))), Image.Resampling.BILINEAR)
        img = small.resize((w, h), Image.Resampling.BILINEAR)
        info["downscale"] = round(f, 3)
    if maybe(0.35):  # blur
        r = float(rng.uniform(0.3, 0.8))
        img = img.filter(ImageFilter.GaussianBlur(r))
        info["blur"] = round(r, 3)
    if maybe(0.3):  # sensor noise (grey)
        sigma = float(rng.uniform(2.0, 8.0))
        noise = rng.standard_normal((h, w, 1), dtype=np.float32) * sigma
        img = Image.fromarray(np.clip(np.asarray(img, dtype=np.float32) + noise + 0.5, 0, 255).astype(np.uint8))
        info["noise"] = round(sigma, 2)
    if maybe(0.45):  # JPEG round trip
        q = int(rng.integers(35, 91))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=q)
        buf.seek(0)
        img = Image.open(buf)
        img.load()
        img = img.convert("RGB")
        info["jpeg"] = q
    return img, info

"""NVFP4 and FP8 (E4M3) weight codes with numpy, as NVIDIA ModelOpt writes them (see shared QUANT.md):

- FP8: ``W = e4m3(weight) * weight_scale``, one fp32 scale per tensor, ``amax / 448``; codes are the
  fp32 quotient ``w / scale`` rounded to the nearest E4M3 value (ties to the even code).
- NVFP4: ``W[n, k] = e2m1(q[n, k]) * e4m3(weight_scale[n, k // 16]) * weight_scale_2``; the global scale
  is ``amax / (6 * 448)``, a block scale ``block_amax / (6 * weight_scale_2)`` clamped to [2^-9, 448] and
  rounded to E4M3 (an all-zero block gets 1.0), a code the fp32 quotient ``w / (block_scale *
  weight_scale_2)`` rounded to the nearest E2M1 value (ties to the even code), its sign bit set for
  negative w (a negative w that rounds to 0 is -0, 0x8). Two codes per byte along K, element 2j in the
  low nibble.

Everything here works on float32 arrays and returns what a checkpoint stores (uint8 codes).
"""

from __future__ import annotations

import numpy as np

NVFP4_BLOCK = 16
FP8_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Midpoints between neighbouring E2M1 magnitudes; at a tie the even code wins.
_E2M1_MIDPOINTS = (E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2


def _e4m3_values() -> np.ndarray:
    """float8_e4m3fn code -> float32 for the 256 codes (0x7F / 0xFF are NaN; no infinity)."""
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()
_E4M3_POSITIVE = E4M3_VALUES[:0x7F]  # codes 0 .. 126: ascending, finite


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes (uint8): nearest value, ties to the even code, |x| above 448 saturates (as the
    block scales' clamp)."""
    x = np.asarray(x, np.float32)
    mag = np.minimum(np.abs(x), np.float32(FP8_MAX))
    hi = np.clip(np.searchsorted(_E4M3_POSITIVE, mag, side="left"), 1, 0x7E)  # first value >= mag
    lo = hi - 1
    d_lo, d_hi = mag - _E4M3_POSITIVE[lo], _E4M3_POSITIVE[hi] - mag
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(mag <= 0, 0, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)  # -0 keeps its sign, as torch's cast


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(codes, np.uint8)]


def e2m1_encode(q: np.ndarray) -> np.ndarray:
    """float32 (already divided by its scales) -> 4-bit E2M1 codes in uint8: bit 3 the sign (of -0 too),
    bits 0-2 the index of the nearest magnitude (ties to the even index; above 6 saturates)."""
    q = np.asarray(q, np.float32)
    mag = np.abs(q)
    index = np.zeros(q.shape, np.uint8)
    for i, m in enumerate(_E2M1_MIDPOINTS):
        index += (mag >= m) if i % 2 else (mag > m)  # a tie goes up only from an odd index
    return index | np.where(np.signbit(q), 8, 0).astype(np.uint8)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, np.uint8)
    return np.where(codes & 8, -1.0, 1.0).astype(np.float32) * E2M1_VALUES[codes & 7]


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes -> [N, K/2] bytes, element 2j in the low nibble of byte j."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    out = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
    out[:, 0::2], out[:, 1::2] = packed & 0xF, packed >> 4
    return out


# ---- FP8 ----
def fp8_scale(amax: float) -> np.float32:
    """The per-tensor weight scale amax / 448 (1 for an all-zero weight)."""
    return np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1.0)


def fp8_quantize(w: np.ndarray, scale: np.float32) -> np.ndarray:
    return e4m3_encode(np.asarray(w, np.float32) / np.float32(scale))


def fp8_dequantize(codes: np.ndarray, scale: np.float32) -> np.ndarray:
    return e4m3_decode(codes) * np.float32(scale)


# ---- NVFP4 ----
def nvfp4_global_scale(amax: float) -> np.float32:
    """weight_scale_2 = amax / (6 * 448) (1 for an all-zero weight)."""
    return np.float32(np.float32(amax) / np.float32(E2M1_MAX * FP8_MAX)) if amax > 0 else np.float32(1.0)


def block_amax(w: np.ndarray) -> np.ndarray:
    n, k = w.shape
    return np.abs(w).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK).max(axis=2)


def nvfp4_block_scales(amax: np.ndarray, global_scale: np.float32, clip: float | np.ndarray = 1.0) -> np.ndarray:
    """E4M3 codes of the block scales for blocks of largest magnitude `amax` [N, K/16], each scaled by
    `clip` (1: ModelOpt's scales; below 1 clips the block's largest values)."""
    ideal = (amax.astype(np.float32) * np.asarray(clip, np.float32)) / (
        np.float32(E2M1_MAX) * np.float32(global_scale))
    codes = e4m3_encode(np.clip(ideal, np.float32(2.0**-9), np.float32(FP8_MAX)))
    return np.where(amax > 0, codes, e4m3_encode(np.float32(1.0))).astype(np.uint8)


def nvfp4_codes(w: np.ndarray, block_scale: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """Unpacked E2M1 codes [N, K] of w [N, K] under the given block scale codes and global scale."""
    scale = np.repeat(e4m3_decode(block_scale), NVFP4_BLOCK, axis=1) * np.float32(global_scale)
    return e2m1_encode(np.asarray(w, np.float32) / scale)


def nvfp4_dequantize_codes(codes: np.ndarray, block_scale: np.ndarray, global_scale: np.float32) -> np.ndarray:
    return (e2m1_decode(codes) * np.repeat(e4m3_decode(block_scale), NVFP4_BLOCK, axis=1)) * np.float32(global_scale)


def nvfp4_dequantize(packed: np.ndarray, block_scale: np.ndarray, global_scale: np.float32) -> np.ndarray:
    return nvfp4_dequantize_codes(unpack_e2m1(packed), block_scale, global_scale)

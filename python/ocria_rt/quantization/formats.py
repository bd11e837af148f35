"""NVFP4 and FP8 (E4M3) weight codes as NVIDIA ModelOpt writes them (see shared QUANT.md):

- FP8: ``W = e4m3(weight) * weight_scale``, one fp32 scale per tensor, ``amax / 448``; codes are the
  fp32 quotient ``w / scale`` rounded to the nearest E4M3 value (ties to the even code).
- NVFP4: ``W[n, k] = e2m1(q[n, k]) * e4m3(weight_scale[n, k // 16]) * weight_scale_2``; the global scale
  is ``amax / (6 * 448)``, a block scale ``block_amax / (6 * weight_scale_2)`` clamped to [2^-9, 448] and
  rounded to E4M3 (an all-zero block gets 1.0), a code the fp32 quotient ``w / (block_scale *
  weight_scale_2)`` rounded to the nearest E2M1 value (ties to the even code), its sign bit set for
  negative w (a negative w that rounds to 0 is -0, 0x8). Two codes per byte along K, element 2j in the
  low nibble.

Whole weights are encoded and decoded by the engine's library (csrc/engine/weight_codes.cpp, on
`threads` host threads, 0: all cores), float32 in, the checkpoint's uint8 codes out; tests/quant_numpy.py
holds a numpy reference of the same rules that they match bit for bit.
"""

from __future__ import annotations

import numpy as np

from .. import _core

NVFP4_BLOCK = 16
FP8_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2


def _e4m3_values() -> np.ndarray:
    """float8_e4m3fn code -> float32 for the 256 codes (0x7F / 0xFF are NaN; no infinity)."""
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(codes, np.uint8)]


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest E2M1 code (bit 3 the sign), magnitudes beyond 6 saturating to 6."""
    x = np.asarray(x, np.float32)
    mag = np.searchsorted(E2M1_MIDPOINTS, np.abs(x)).astype(np.uint8)
    return mag | np.where(np.signbit(x), 8, 0).astype(np.uint8)


def e2m1_decode(codes: np.ndarray) -> np.ndarray:
    """Unpacked 4-bit E2M1 codes (bit 3 the sign) -> float32."""
    codes = np.asarray(codes, np.uint8)
    return np.where(codes & 8, -1.0, 1.0).astype(np.float32) * E2M1_VALUES[codes & 7]


# ---- FP8 ----
def fp8_scale(amax: float) -> np.float32:
    """The per-tensor weight scale amax / 448 (1 for an all-zero weight)."""
    return np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1.0)


def _rows(w: np.ndarray) -> np.ndarray:
    """w as float32 rows (a matrix as it is; a vector or a scalar as one row)."""
    a = np.asarray(w, np.float32)
    return a if a.ndim == 2 else a.reshape(1, -1) if a.ndim < 2 else a.reshape(-1, a.shape[-1])


def fp8_quantize(w: np.ndarray, scale: np.float32, col_scale: np.ndarray | None = None, threads: int = 0) -> np.ndarray:
    """E4M3 codes (uint8, w's shape) of (w * col_scale) / scale, col_scale [K] multiplying w's columns."""
    a = np.asarray(w, np.float32)
    return _core.fp8_quantize(_rows(a), float(scale), col_scale, threads).reshape(a.shape)


def fp8_dequantize(codes: np.ndarray, scale: np.float32, col_divisor: np.ndarray | None = None,
                   minuend: np.ndarray | None = None, threads: int = 0) -> np.ndarray:
    """codes [N, K] -> float32 e4m3 value * scale; then divided by col_divisor [K] and subtracted from
    minuend [N, K] where given (minuend - value / col_divisor: a quantization's error in its weights' domain)."""
    return _core.fp8_dequantize(np.asarray(codes, np.uint8), float(scale), col_divisor, minuend, threads)


# ---- NVFP4 ----
def nvfp4_global_scale(amax: float) -> np.float32:
    """weight_scale_2 = amax / (6 * 448) (1 for an all-zero weight)."""
    return np.float32(np.float32(amax) / np.float32(E2M1_MAX * FP8_MAX)) if amax > 0 else np.float32(1.0)


def nvfp4_quantize(w: np.ndarray, global_scale: np.float32, clip_factors: np.ndarray | None = None,
                   block_moments: np.ndarray | None = None, col_scale: np.ndarray | None = None,
                   threads: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """NVFP4 of w [N, K] times col_scale [K] (K a multiple of 16): (block scale codes [N, K/16], packed codes
    [N, K/2], the number of blocks whose scale the search changed). With clip_factors and block_moments
    (the second moment's 16 x 16 diagonal blocks, [K/16, 16, 16], of the scaled weights' input) each
    block's scale is the block maximum times the factor, in the order given, that minimises d^T C_b d of
    its dequantization error d (the first of equal ones); without them, ModelOpt's (factor 1)."""
    factors = None if clip_factors is None else np.asarray(clip_factors, np.float32)
    moments = None if block_moments is None else np.asarray(block_moments, np.float32)
    scales, packed, changed = _core.nvfp4_quantize(np.asarray(w, np.float32), float(global_scale), factors, moments,
                                                   col_scale, threads)
    return scales, packed, int(changed)


def nvfp4_dequantize(packed: np.ndarray, block_scale: np.ndarray, global_scale: np.float32,
                     col_divisor: np.ndarray | None = None, minuend: np.ndarray | None = None,
                     threads: int = 0) -> np.ndarray:
    """float32 [N, K] = e2m1 value * e4m3 block scale value * global scale; then as fp8_dequantize."""
    return _core.nvfp4_dequantize(np.asarray(packed, np.uint8), np.asarray(block_scale, np.uint8),
                                  float(global_scale), col_divisor, minuend, threads)

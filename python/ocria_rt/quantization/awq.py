"""Quantizing one projection group (the modules fused into one projection: q|k|v, gate|up, in_proj_qkv|
in_proj_z, or a single module) from its calibration statistics: plain round-to-nearest (ModelOpt's
scales), or activation-aware scaling with an error-minimising search.

AWQ: x W^T = (x / s) (W diag(s))^T for any per-input-channel s > 0. Scaling up the columns of channels
with large activations before quantizing protects them; the input is multiplied by the pre_quant_scale
p = 1 / s (which a writer folds into the layer before: a norm's weight, or the rows of the projection
that produces x). s = mean|x|^alpha, normalised to a geometric mid-range of 1, with alpha from a grid
(0, 1/4, .., 1, then 1/8 either side of the best); the alpha kept minimises the output error on the
calibration activations,

    E = sum over parts of tr(D C D^T),   D = W - dequant(quant(W diag(s))) diag(1 / s),   C = X^T X / n,

which alpha = 0 (s = 1, plain rounding) bounds from above. Then each NVFP4 block's scale is picked from
a grid of scaled block maxima (0.6 to 1.1: clipping the largest values, or not) by the same error
restricted to the block (its 16 x 16 block of C), and kept only where the whole projection's E goes down.
E is measured on at most SEARCH_ROWS rows spread evenly over the parts, each part's share scaled to all its
rows; only the candidate kept is then quantized in full.
Method "gptq" adds the weights unscaled and scaled by the chosen s (the same where alpha is 0), each
rounded column by column with each column's error fed back into the columns after it
(_Group.round_with_feedback); the candidate of lowest E is kept.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from . import formats as F

METHODS = ("awq", "gptq", "rtn")
ALPHAS = np.linspace(0.0, 1.0, 5)  # the coarse grid of alpha; then its best +- ALPHA_REFINE
ALPHA_REFINE = 0.125
CLIP_GRID = np.array([1.1, 1.05, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6], np.float32)
DAMPING = 0.01  # of H's mean diagonal, added to its diagonal before the feedback rounding inverts it
FEEDBACK_BLOCK = 256  # columns whose rounding errors update the later columns together (a multiple of 16)
FEEDBACK_MIN_ROWS = 2048  # rows a thread takes at least in the feedback rounding
SEARCH_ROWS = 4096  # rows of the parts (spread evenly) that the alpha search quantizes
ERROR_ROWS = 4096  # rows of an output error's d^T d summed in float32 at a time


@dataclass
class QuantizedWeight:
    """One checkpoint module's weight as ModelOpt stores it: FP8 codes [N, K] with weight_scale, or NVFP4
    packed codes [N, K/2] with block scales [N, K/16] and weight_scale_2; input_scale for the activations
    (amax / 448, or amax / (6 * 448) for NVFP4)."""

    fmt: str
    codes: np.ndarray
    scale: np.float32
    input_scale: np.float32
    block_scale: np.ndarray | None = None

    def dequantize(self, threads: int = 0, col_divisor: np.ndarray | None = None,
                   minuend: np.ndarray | None = None) -> np.ndarray:
        """The dequantized weight [N, K] (minuend - it / col_divisor where given)."""
        if self.fmt == "fp8":
            return F.fp8_dequantize(self.codes, self.scale, col_divisor, minuend, threads)
        return F.nvfp4_dequantize(self.codes, self.block_scale, self.scale, col_divisor, minuend, threads)

    def take_rows(self, rows: np.ndarray) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.codes[rows], self.scale, self.input_scale,
                               None if self.block_scale is None else self.block_scale[rows])

    def tensors(self, module: str) -> dict[str, tuple[str, np.ndarray]]:
        """The safetensors entries of the module, named and typed as ModelOpt writes them."""
        scalar = lambda v: np.array(v, np.float32).reshape(())  # noqa: E731
        if self.fmt == "fp8":
            return {module + ".weight": ("F8_E4M3", self.codes), module + ".weight_scale": ("F32", scalar(self.scale)),
                    module + ".input_scale": ("F32", scalar(self.input_scale))}
        return {module + ".weight": ("U8", self.codes), module + ".weight_scale": ("F8_E4M3", self.block_scale),
                module + ".weight_scale_2": ("F32", scalar(self.scale)),
                module + ".input_scale": ("F32", scalar(self.input_scale))}


def format_bytes(fmt: str, rows: int, cols: int, dense_bytes_per_weight: int) -> int:
    """Checkpoint bytes of one [rows, cols] module in a format (scalar scales included)."""
    if fmt == "fp8":
        return rows * cols + 8
    if fmt == "nvfp4":
        return rows * cols // 2 + rows * cols // F.NVFP4_BLOCK + 8
    return rows * cols * dense_bytes_per_weight


@dataclass
class GroupQuantization:
    weights: list[QuantizedWeight]      # one per part
    pre_quant_scale: np.ndarray | None  # p [K] = 1 / s, multiplies the input; None: plain rounding
    alpha: float                        # 0 for plain rounding
    searched_blocks: float              # share of NVFP4 blocks whose scale the search changed
    error: float                        # E of these weights
    rtn_error: float                    # E of plain rounding

    def effective(self, threads: int = 0) -> list[np.ndarray]:
        """Each part's dequantized weight in the original input domain (as the model computes with it)."""
        p = None if self.pre_quant_scale is None else self.pre_quant_scale.astype(np.float32)
        out = [w.dequantize(threads) for w in self.weights]
        if p is not None:
            for e in out:
                e *= p[None, :]
        return out


class Moments:
    """The second moment C = X^T X / n of a projection's input: the full matrix, or only its diagonal
    (mean x^2) where the engine kept no matrix (inputs wider than it keeps them for)."""

    def __init__(self, full: np.ndarray | None, diag: np.ndarray) -> None:
        self.full = None if full is None else np.asarray(full, np.float32)
        self.diag = np.asarray(diag, np.float32)

    @staticmethod
    def of(stats: dict) -> Moments:
        return Moments(stats.get("second_moment"), stats["square_mean"])

    def error(self, d: np.ndarray) -> float:
        """tr(d C d^T) = <C, d^T d>: d^T d of ERROR_ROWS rows at a time in float32 (a matrix times its own
        transpose, which numpy hands to BLAS's syrk: half the work of d @ C), summed with C in float64."""
        d = np.asarray(d, np.float32)
        if self.full is None:
            return float(np.einsum("nk,nk,k->", d, d, self.diag, dtype=np.float64))
        total = 0.0
        for r0 in range(0, len(d), ERROR_ROWS):
            rows = d[r0:r0 + ERROR_ROWS]
            total += float(np.einsum("ij,ij->", rows.T @ rows, self.full, dtype=np.float64))
        return total

    def blocks(self, s: np.ndarray | None = None) -> np.ndarray:
        """The NVFP4 blocks' 16 x 16 diagonal blocks of C (of the moments of x / s with s), [K / 16, 16, 16]."""
        nb, b = len(self.diag) // F.NVFP4_BLOCK, F.NVFP4_BLOCK
        if self.full is None:
            diag = self.diag if s is None else self.diag / (s * s)
            return np.stack([np.diag(diag[i * b:(i + 1) * b]) for i in range(nb)])
        out = np.stack([self.full[i * b:(i + 1) * b, i * b:(i + 1) * b] for i in range(nb)])
        if s is not None:
            sb = s.reshape(nb, b)
            out /= sb[:, :, None] * sb[:, None, :]
        return out


def _scales(abs_mean: np.ndarray, alpha: float, tie: np.ndarray | None) -> np.ndarray:
    """s = mean|x|^alpha (tie: channels with one class id share their class's mean), normalised so that
    sqrt(max(s) * min(s)) = 1."""
    m = np.asarray(abs_mean, np.float64)
    if tie is not None:
        m = (np.bincount(tie, weights=m) / np.bincount(tie))[tie]
    m = np.maximum(m, max(float(m.max()), 1e-30) * 1e-6)
    s = m**alpha
    s = s / np.sqrt(s.max() * s.min())
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def _input_scale(fmt: str, abs_max: np.ndarray, p: np.ndarray | None) -> np.float32:
    amax = float(np.max(abs_max * (1.0 if p is None else p))) if len(abs_max) else 0.0
    return np.float32(amax / (F.FP8_MAX * (F.E2M1_MAX if fmt == "nvfp4" else 1.0))) if amax > 0 else np.float32(1.0)


class _Group:
    """The parts of one projection [N_i, K] (float32) and what every quantization of them needs: the
    largest |w| of each input channel over all rows (the amax of w diag(s) is max_k colmax_k s_k: rounding
    is monotonic, so that equals the maximum over the scaled weights), the input's moments, the threads."""

    def __init__(self, parts: list[np.ndarray], C: Moments, threads: int) -> None:
        self.parts, self.C, self.threads = parts, C, threads
        self._rows: tuple[list[np.ndarray], list[np.ndarray]] | None = None
        k = parts[0].shape[1]
        self.colmax = np.zeros(k, np.float32)
        for w in parts:
            if w.size:
                np.maximum(self.colmax, np.abs(w).max(axis=0), out=self.colmax)

    def amax(self, s: np.ndarray | None) -> float:
        return float((self.colmax if s is None else self.colmax * s).max()) if self.colmax.size else 0.0

    def quantize(self, fmt: str, s: np.ndarray | None, clip: bool,
                 rows: list[np.ndarray] | None = None) -> tuple[list[QuantizedWeight], float]:
        """The parts' columns times s quantized with one shared global scale (only `rows` of each part when
        given); returns the weights (input_scale unset) and the share of NVFP4 blocks the search changed
        (the mean over the parts)."""
        amax = self.amax(s)
        picked = self.parts if rows is None else self.rows_of(rows)
        if fmt == "fp8":
            scale = F.fp8_scale(amax)
            return [QuantizedWeight("fp8", F.fp8_quantize(w, scale, s, self.threads), scale, np.float32(1.0))
                    for w in picked], 0.0
        gs = F.nvfp4_global_scale(amax)
        moments = self.C.blocks(s) if clip else None
        out, searched = [], []
        for w in picked:
            bs, packed, changed = F.nvfp4_quantize(w, gs, CLIP_GRID if clip else None, moments, s, self.threads)
            searched.append(changed / bs.size if bs.size else 0.0)
            out.append(QuantizedWeight("nvfp4", packed, gs, np.float32(1.0), bs))
        return out, float(np.mean(searched)) if clip and searched else 0.0

    def round_with_feedback(self, fmt: str, s: np.ndarray | None) -> list[QuantizedWeight] | None:
        """The parts' columns times s rounded one column at a time, each column's rounding error fed back
        into the columns not yet rounded so that the output error E stays small (GPTQ, Frantar et al.
        2022, arXiv:2210.17323): with H the second moment of x / s plus DAMPING times its mean diagonal on
        the diagonal, and U the upper Cholesky factor of H^-1, column j's error e_j = (w_j - q_j) / U_jj
        updates w_k -= e_j U_jk for k > j. NVFP4 block scales are set from the updated weights when their
        block of 16 columns is reached. Rows are independent: chunks of them run on the threads. None
        where only the diagonal of C is kept (a diagonal H feeds nothing back)."""
        if self.C.full is None or not any(part.size for part in self.parts):
            return None
        w = np.concatenate(self.parts).astype(np.float32)
        h = self.C.full.copy()
        if s is not None:
            w *= s[None, :]
            h /= s[:, None] * s[None, :]
        diag = np.diag_indices(len(h))
        h[diag] = np.where(h[diag] > 0, h[diag], 1.0)  # a channel that was always 0
        h[diag] += DAMPING * float(np.mean(h[diag]))
        u = np.linalg.cholesky(np.linalg.inv(h)).T.copy()
        amax = self.amax(s)
        scale = F.fp8_scale(amax) if fmt == "fp8" else F.nvfp4_global_scale(amax)
        codes = np.zeros(w.shape, np.uint8)
        block_codes = np.zeros((w.shape[0], w.shape[1] // F.NVFP4_BLOCK), np.uint8) if fmt == "nvfp4" else None
        threads = self.threads if self.threads > 0 else os.cpu_count() or 1
        bounds = np.linspace(0, len(w), max(1, min(threads, len(w) // FEEDBACK_MIN_ROWS)) + 1).astype(int)
        with ThreadPoolExecutor(len(bounds) - 1) as pool:
            list(pool.map(lambda r0, r1: _round_rows(w[r0:r1], u, fmt, scale, codes, block_codes, r0),
                          bounds[:-1], bounds[1:]))
        out, r0 = [], 0
        for part in self.parts:
            r1 = r0 + part.shape[0]
            if fmt == "fp8":
                out.append(QuantizedWeight("fp8", codes[r0:r1], scale, np.float32(1.0)))
            else:
                packed = (codes[r0:r1, 0::2] | (codes[r0:r1, 1::2] << 4)).astype(np.uint8)
                out.append(QuantizedWeight("nvfp4", packed, scale, np.float32(1.0), block_codes[r0:r1]))
            r0 = r1
        return out

    def rows_of(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """`rows` of each part (the alpha search's; taken once)."""
        if self._rows is None or self._rows[0] is not rows:
            self._rows = (rows, [w[r] for w, r in zip(self.parts, rows)])
        return self._rows[1]

    def error(self, q: list[QuantizedWeight], s: np.ndarray | None, rows: list[np.ndarray] | None = None) -> float:
        """E of the quantized parts (their columns divided by s); with `rows`, q holds those rows of each
        part and each part's error on them is scaled to all its rows."""
        if rows is None:
            return sum(self.C.error(w.dequantize(self.threads, s, part)) for w, part in zip(q, self.parts))
        return sum(self.C.error(w.dequantize(self.threads, s, part)) * (len(full) / max(len(r), 1))
                   for w, part, full, r in zip(q, self.rows_of(rows), self.parts, rows))


def _round_rows(w: np.ndarray, u: np.ndarray, fmt: str, scale: np.float32, codes: np.ndarray,
                block_codes: np.ndarray | None, r0: int) -> None:
    """round_with_feedback on rows w (updated in place) into codes[r0:] (and block_codes[r0:]): columns in
    blocks of 16 whose errors update the rest of their FEEDBACK_BLOCK columns at the end of each block,
    and the columns past it at the end of the FEEDBACK_BLOCK (two levels, so that the later columns are
    rewritten K / FEEDBACK_BLOCK times rather than once a column)."""
    n, k = w.shape
    b, big = F.NVFP4_BLOCK, FEEDBACK_BLOCK
    rows = slice(r0, r0 + n)
    for o0 in range(0, k, big):
        o1 = min(o0 + big, k)
        err = np.zeros((n, o1 - o0), np.float32)
        for b0 in range(o0, o1, b):
            blk = w[:, b0:b0 + b]
            if fmt == "nvfp4":  # ModelOpt's block scale (the library's rule) of the updated weights
                bs_code = F.nvfp4_quantize(np.ascontiguousarray(blk), scale, threads=1)[0][:, 0]
                block_codes[rows, b0 // b] = bs_code
                step = F.e4m3_decode(bs_code) * scale
            for j in range(blk.shape[1]):  # 16, or fewer at the end of an FP8 row
                col = blk[:, j]
                if fmt == "fp8":
                    c = F.fp8_quantize(np.clip(col / scale, -F.FP8_MAX, F.FP8_MAX), np.float32(1.0), threads=1)
                    q = F.e4m3_decode(c.reshape(-1)) * scale
                else:
                    c = F.e2m1_encode(col / step)
                    q = F.e2m1_decode(c) * step
                codes[rows, b0 + j] = c.reshape(-1)
                e = (col - q) / u[b0 + j, b0 + j]
                blk[:, j + 1:] -= e[:, None] * u[b0 + j, b0 + j + 1:b0 + b][None, :]
                err[:, b0 + j - o0] = e
            w[:, b0 + b:o1] -= err[:, b0 - o0:b0 + b - o0] @ u[b0:b0 + b, b0 + b:o1]
        w[:, o1:] -= err @ u[o0:o1, o1:]


def quantize_group(parts: list[np.ndarray], fmt: str, stats: dict, method: str = "awq",
                   tie: np.ndarray | None = None, threads: int = 0) -> GroupQuantization:
    """Quantizes the parts [N_i, K] (float32) of one projection to fmt ("fp8" or "nvfp4") sharing one global
    scale. stats: the calibration statistics of the projection's input ("abs_max", "abs_mean",
    "square_mean", "second_moment", which may be None: its diagonal square_mean stands in). method "rtn":
    ModelOpt's round-to-nearest; "awq" / "gptq": the search of the module docstring (tie: per-channel class
    ids whose channels must share one scale, for a fold that needs it). threads: host threads for the codes
    (0: all cores)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    g = _Group([np.asarray(w, np.float32) for w in parts], Moments.of(stats), threads)

    def finish(weights: list[QuantizedWeight], p: np.ndarray | None, alpha: float, searched: float, error: float,
               rtn_error: float) -> GroupQuantization:
        for w in weights:
            w.input_scale = _input_scale(fmt, stats["abs_max"], p)
        return GroupQuantization(weights, p, alpha, searched, error, rtn_error)

    # The errors are measured on at most SEARCH_ROWS rows, spread evenly over the parts (every row of a
    # smaller group), each part's scaled to all its rows; a row's codes do not depend on the other rows
    # (the global scale comes from every row's maximum), so these are the final weights' own rows.
    total = sum(w.shape[0] for w in g.parts)
    rows = None
    if total > SEARCH_ROWS:
        rows = [np.linspace(0, w.shape[0] - 1, max(1, w.shape[0] * SEARCH_ROWS // total)).astype(np.int64)
                for w in g.parts]
    rtn, _ = g.quantize(fmt, None, clip=False, rows=rows)
    rtn_error = g.error(rtn, None, rows)
    if method == "rtn":
        return finish(g.quantize(fmt, None, clip=False)[0] if rows else rtn, None, 0.0, 0.0, rtn_error, rtn_error)

    errors = {0.0: rtn_error}  # alpha 0: s = 1, plain rounding

    def search(alpha: float) -> None:
        if 0.0 <= alpha <= 1.0 and alpha not in errors:
            s = _scales(stats["abs_mean"], alpha, tie)
            errors[alpha] = g.error(g.quantize(fmt, s, clip=False, rows=rows)[0], s, rows)

    for alpha in ALPHAS:
        search(float(alpha))
    coarse = min(errors, key=errors.__getitem__)
    for alpha in (coarse - ALPHA_REFINE, coarse + ALPHA_REFINE):
        search(alpha)
    best_alpha = min(errors, key=errors.__getitem__)
    s = _scales(stats["abs_mean"], best_alpha, tie)
    p_awq = (1.0 / s).astype(np.float32)
    # candidates: (weights of the measured rows, p, alpha, clip or None (feedback rounding: all rows
    # already), share of blocks searched, error); only the one kept is then quantized in full
    candidates: list[tuple[list[QuantizedWeight], np.ndarray | None, float, bool | None, float, float]] = [
        (rtn, None, 0.0, False, 0.0, rtn_error)]
    for clip in ((False, True) if fmt == "nvfp4" else (False,)):
        q, searched = g.quantize(fmt, s, clip=clip, rows=rows)
        candidates.append((q, p_awq, best_alpha, clip, searched, g.error(q, s, rows)))
    if method == "gptq":
        for scaled in (None,) if best_alpha == 0 else (None, s):  # alpha 0: s is 1, the same rounding
            q = g.round_with_feedback(fmt, scaled)
            if q is not None:
                p = None if scaled is None else p_awq
                candidates.append((q, p, best_alpha if scaled is not None else 0.0, None, 0.0,
                                   g.error([w.take_rows(r) for w, r in zip(q, rows)] if rows else q, scaled, rows)))
    q, p, alpha, clip, searched, err = min(candidates, key=lambda c: c[5])
    if rows and clip is not None:  # the kept candidate's every row
        q, searched = g.quantize(fmt, None if p is None else s, clip=clip)
    return finish(q, p, alpha, searched, err, rtn_error)

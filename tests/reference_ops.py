"""Plain numpy (float64) references of the ops, written from the formulas in csrc/ops/ops.h."""

from __future__ import annotations

import numpy as np


def rms_norm(x, w, eps, zero_centred=True):
    x = x.astype(np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y * ((1 + w) if zero_centred else w)


def silu(x):
    return x / (1 + np.exp(-x))


GLU_GROUP = 8  # kGluGroup, ops.h


def glu_layout(gate, up):
    """gate and up [I, ...] stacked into [2I, ...] in the GLU layout of ops.h: GLU_GROUP rows of
    gate, the same rows of up, the next GLU_GROUP rows of gate, ..."""
    I = gate.shape[0]
    g = gate.reshape(I // GLU_GROUP, GLU_GROUP, *gate.shape[1:])
    u = up.reshape(I // GLU_GROUP, GLU_GROUP, *up.shape[1:])
    return np.stack([g, u], axis=1).reshape(2 * I, *gate.shape[1:])


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def mrope_axes(half, section):
    """Which of (t, h, w) each rotary frequency follows under interleaved M-RoPE."""
    j = np.arange(half)
    axes = np.zeros(half, dtype=int)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


def rope(x, pos, rot, theta, section=(0, 0, 0)):
    """pos: a scalar, or the (t, h, w) triple of M-RoPE."""
    x = x.astype(np.float64).copy()
    half = rot // 2
    pos = np.broadcast_to(np.asarray(pos, dtype=np.float64), (3,))[mrope_axes(half, section)]
    ang = pos * (1.0 / theta ** (np.arange(0, rot, 2) / rot))
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half].copy(), x[..., half:rot].copy()
    x[..., :half] = a * c - b * s
    x[..., half:rot] = b * c + a * s
    return x


def attention_prepare(qkv, q_norm, k_norm, rope_positions, hq, hkv, hd, rot, theta, eps, section=(0, 0, 0)):
    T = qkv.shape[0]
    q = qkv[:, : hq * 2 * hd].reshape(T, hq, 2 * hd)[..., :hd]
    k = qkv[:, hq * 2 * hd : hq * 2 * hd + hkv * hd].reshape(T, hkv, hd)
    v = qkv[:, hq * 2 * hd + hkv * hd :].reshape(T, hkv, hd)
    q = np.stack([rope(rms_norm(q[t], q_norm, eps), rope_positions[t], rot, theta, section) for t in range(T)])
    k = np.stack([rope(rms_norm(k[t], k_norm, eps), rope_positions[t], rot, theta, section) for t in range(T)])
    return q, k, v


def attention(q, k_cache, v_cache, qkv, positions, hq, hkv, hd):
    T = q.shape[0]
    gate = qkv[:, : hq * 2 * hd].reshape(T, hq, 2 * hd)[..., hd:]
    out = np.zeros((T, hq, hd))
    for t in range(T):
        n = positions[t] + 1
        for h in range(hq):
            g = h // (hq // hkv)
            s = k_cache[:n, g].astype(np.float64) @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v_cache[:n, g]
    return (out * sigmoid(gate)).reshape(T, hq * hd)


def gdn_conv(x, w, state):
    K = w.shape[1]
    full = np.concatenate([state.T, x], 0).astype(np.float64)  # [K-1+T, C]
    T = x.shape[0]
    out = np.stack([(full[t : t + K] * w.T).sum(0) for t in range(T)])
    return silu(out), full[-(K - 1) :].T


def gdn(qkv, ba, A_log, dt_bias, state, hk, hv, dk, dv):
    T = qkv.shape[0]
    S = state.astype(np.float64).copy()
    out = np.zeros((T, hv * dv))
    for t in range(T):
        for h in range(hv):
            kh = h // (hv // hk)
            q = qkv[t, kh * dk : (kh + 1) * dk].astype(np.float64)
            k = qkv[t, hk * dk + kh * dk : hk * dk + (kh + 1) * dk].astype(np.float64)
            v = qkv[t, 2 * hk * dk + h * dv : 2 * hk * dk + (h + 1) * dv]
            q = q / np.sqrt((q * q).sum() + 1e-6) / np.sqrt(dk)
            k = k / np.sqrt((k * k).sum() + 1e-6)
            beta = sigmoid(ba[t, h])
            g = -np.exp(A_log[h]) * np.log1p(np.exp(ba[t, hv + h] + dt_bias[h]))
            S[h] *= np.exp(g)
            u = beta * (v - S[h].T @ k)
            S[h] += np.outer(k, u)
            out[t, h * dv : (h + 1) * dv] = S[h].T @ q
    return out, S


def gdn_gated_norm(o, z, w, hv, dv, eps):
    T = o.shape[0]
    y = rms_norm(o.reshape(T, hv, dv), w, eps, zero_centred=False) * silu(z.reshape(T, hv, dv))
    return y.reshape(T, hv * dv)


def layer_norm(x, w, b, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def gelu(x, tanh_approximation):
    from math import erf, sqrt

    x = x.astype(np.float64)
    if tanh_approximation:
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + np.vectorize(erf)(x / sqrt(2)))


def gather_blend_add(table, rows, weights, x):
    """x[n] + sum_k weights[n, k] * table[rows[n, k]]."""
    return x.astype(np.float64) + np.einsum("nk,nkd->nd", weights.astype(np.float64), table.astype(np.float64)[rows])


def vision_attention(qkv, patch_pos, cu_seqlens, heads, theta):
    N = qkv.shape[0]
    hd = qkv.shape[1] // (3 * heads)
    q, k, v = (qkv[:, i * heads * hd : (i + 1) * heads * hd].reshape(N, heads, hd).astype(np.float64) for i in range(3))
    quarter, half = hd // 4, hd // 2
    inv = 1.0 / theta ** (4 * np.arange(quarter) / hd)
    ang = np.concatenate([patch_pos[:, :1] * inv, patch_pos[:, 1:] * inv], 1)[:, None, :]  # [N, 1, hd/2]
    c, s = np.cos(ang), np.sin(ang)

    def rot(x):
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    q, k = rot(q), rot(k)
    out = np.zeros((N, heads, hd))
    for i in range(len(cu_seqlens) - 1):
        b0, b1 = cu_seqlens[i], cu_seqlens[i + 1]
        for h in range(heads):
            sc = q[b0:b1, h] @ k[b0:b1, h].T / np.sqrt(hd)
            p = np.exp(sc - sc.max(1, keepdims=True))
            out[b0:b1, h] = (p / p.sum(1, keepdims=True)) @ v[b0:b1, h]
    return out.reshape(N, heads * hd)


# ---- quantized weight formats (ops.h LinearWeight), bit by bit in numpy ----

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
NVFP4_BLOCK = 16


def e4m3_to_float(bits):
    """float8 e4m3fn bits (uint8) -> float64: bias 7, subnormals, S.1111.111 NaN, no infinities."""
    bits = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    exp, mant = (bits >> 3) & 0xF, bits & 0x7
    v = np.where(exp == 0, mant / 8 * 2.0**-6, (1 + mant / 8) * 2.0 ** (exp - 7))
    v = np.where((exp == 15) & (mant == 7), np.nan, v)
    return np.where(bits & 0x80, -v, v)


E4M3_POSITIVE = e4m3_to_float(np.arange(0x7F))  # codes 0 .. 0x7E (448), increasing


def _round_to_grid(x, grid):
    """Index of the nearest value of the increasing grid to |x| (clamped), ties to the even index."""
    a = np.minimum(np.abs(np.asarray(x, dtype=np.float64)), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    return np.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)


def float_to_e4m3(x):
    """float -> e4m3fn bits (uint8), round to nearest (ties to even), saturating at +-448."""
    x = np.asarray(x, dtype=np.float64)
    return (_round_to_grid(x, E4M3_POSITIVE) | np.where(x < 0, 0x80, 0)).astype(np.uint8)


def e2m1_to_float(codes):
    codes = np.asarray(codes, dtype=np.int64)
    v = E2M1_GRID[codes & 0x7]
    return np.where(codes & 0x8, -v, v)


def pack_e2m1(codes):
    """E2M1 codes [N, K] -> bytes [N, K / 2]: element 2j in the low nibble, 2j + 1 in the high one."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def unpack_e2m1(packed, low_first=True):
    packed = np.asarray(packed, dtype=np.uint8)
    lo, hi = packed & 0xF, packed >> 4
    first, second = (lo, hi) if low_first else (hi, lo)
    return np.stack([first, second], -1).reshape(packed.shape[0], -1)


def dequant_fp8(weight, row_scale):
    """W [N, K] = e4m3(weight) * row_scale[n]."""
    return e4m3_to_float(weight) * np.asarray(row_scale, dtype=np.float64)[:, None]


def dequant_nvfp4(packed, block_scale, row_scale, low_first=True):
    """W [N, K] = e2m1(q) * e4m3(block_scale[n, k / 16]) * row_scale[n]."""
    q = e2m1_to_float(unpack_e2m1(packed, low_first))
    blocks = np.repeat(e4m3_to_float(block_scale), NVFP4_BLOCK, axis=1)
    return q * blocks * np.asarray(row_scale, dtype=np.float64)[:, None]


def quantize_fp8(w, per_channel=False):
    """(weight bits [N, K], scale): amax / 448 per tensor (a scalar) or per row ([N])."""
    w = np.asarray(w, dtype=np.float64)
    amax = np.abs(w).max(1) if per_channel else np.abs(w).max()
    scale = (np.maximum(amax, 1e-12) / 448).astype(np.float32)
    return float_to_e4m3(w / (scale[:, None] if per_channel else scale)), scale


def quantize_nvfp4(w):
    """ModelOpt's NVFP4: (packed [N, K/2], block_scale bits [N, K/16], global scale weight_scale_2).
    global = amax / (6 * 448); block scale = block_amax / (6 * global) in e4m3 (an all-zero block 1.0);
    elements round half to even on the E2M1 grid."""
    w = np.asarray(w, dtype=np.float64)
    N, K = w.shape
    global_scale = np.float32(max(np.abs(w).max(), 1e-12) / (6 * 448))
    blocks = w.reshape(N, K // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = np.abs(blocks).max(-1)
    bs = float_to_e4m3(np.where(block_amax > 0, np.clip(block_amax / (6 * float(global_scale)), 2.0**-9, 448), 1.0))
    scaled = blocks / (e4m3_to_float(bs)[..., None] * float(global_scale))
    codes = (_round_to_grid(scaled, E2M1_GRID) | np.where(scaled < 0, 0x8, 0)).reshape(N, K)
    return pack_e2m1(codes), bs, global_scale


# ---- speculative decoding: the DFlash drafter's ops and the acceptance rule ----


def draft_store_kv(kv, k_norm, positions, k_cache, v_cache, hkv, hd, theta, eps):
    k_cache, v_cache = k_cache.astype(np.float64).copy(), v_cache.astype(np.float64).copy()
    for t, pos in enumerate(positions):
        k = kv[t, : hkv * hd].reshape(hkv, hd)
        k_cache[pos] = rope(rms_norm(k, k_norm, eps), pos, hd, theta)
        v_cache[pos] = kv[t, hkv * hd :].reshape(hkv, hd)
    return k_cache, v_cache


def draft_attention(q, q_norm, positions, k_cache, v_cache, hq, hkv, hd, theta, eps, causal, window):
    T = q.shape[0]
    last = positions[-1]
    out = np.zeros((T, hq, hd))
    for t in range(T):
        pos = positions[t]
        keys = np.arange(last + 1)
        seen = np.ones(last + 1, bool)
        if causal:
            seen &= keys <= pos
        if window:
            seen &= pos - keys < window
            if not causal:
                seen &= keys - pos < window
        for h in range(hq):
            g = h // (hq // hkv)
            qh = rope(rms_norm(q[t, h * hd : (h + 1) * hd], q_norm, eps), pos, hd, theta)
            s = k_cache[: last + 1, g].astype(np.float64) @ qh / np.sqrt(hd)
            s[~seen] = -np.inf
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ v_cache[: last + 1, g]
    return out.reshape(T, hq * hd)


def dynamic_conv(x, dyn, base, group):
    T, C = x.shape
    K = base.shape[0]
    G = C // group
    out = np.zeros((T, C))
    for o in range(K):
        w = base[o][None, :] + np.repeat(dyn[:, o * G : (o + 1) * G], group, axis=1)  # [T, C]
        shifted = np.zeros((T, C))
        shifted[o:] = x[: T - o]
        out += w * shifted
    return out


def selector_walk_greedy(logits, h, pred, succ, anchor, top_k):
    prev, tokens = anchor, []
    for t in range(logits.shape[0]):
        cand = np.argsort(-logits[t], kind="stable")[:top_k]
        s = logits[t, cand] + (pred[prev].astype(np.float64) * h[t]) @ succ[cand].T
        prev = int(cand[np.argmax(s)])
        tokens.append(prev)
    return tokens


def sampler_probs(logits, temperature, top_k=0, top_p=1.0):
    """The distribution sample() draws from: softmax(logits / T), top-k, then the smallest top-p prefix."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep = order[: top_k] if top_k else order
    if top_p < 1:
        cum, n = 0.0, 0
        for i in keep:
            cum += p[i]
            n += 1
            if cum >= top_p:
                break
        keep = keep[:n]
    out = np.zeros_like(p)
    out[keep] = p[keep]
    return out / out.sum()

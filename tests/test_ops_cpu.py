"""Every CPU op against a float64 numpy reference, fresh random inputs, several (odd) shapes."""

from __future__ import annotations

import numpy as np
import pytest

import ocria_rt
import reference_ops as ref
from support import check_post_mailbox, relerr
from ocria_rt import _core

TOL = 1e-5


@pytest.fixture(scope="module")
def cpu():
    return _core.OpRunner("cpu")


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("M,K,N", [(1, 64, 96), (3, 33, 17), (16, 128, 250), (70, 257, 31)])
def test_linear(cpu, M, K, N):
    rng = np.random.default_rng(M * 1000 + K)
    x, w = randn(rng, M, K), randn(rng, N, K)
    assert relerr(cpu.linear(x, w), x.astype(np.float64) @ w.T) <= TOL


@pytest.mark.parametrize("M,K,I", [(1, 40, 48), (5, 33, 72), (40, 96, 64)])
def test_linear_glu(cpu, M, K, I):
    rng = np.random.default_rng(M + I)
    x, wg, wu = randn(rng, M, K), randn(rng, I, K, scale=0.3), randn(rng, I, K, scale=0.3)
    want = ref.silu(x.astype(np.float64) @ wg.T) * (x.astype(np.float64) @ wu.T)
    assert relerr(cpu.linear_glu(x, ref.glu_layout(wg, wu)), want) <= TOL


def quant_parts(rng, fmt, N, K, per_channel=True, from_bytes=False):
    """(format, weight bytes, block_scale bytes or None, row_scale) of a quantized W [N, K], and W
    dequantized in float64. The weight is either a random normal matrix quantized as ModelOpt does,
    or (from_bytes) random bytes: every E2M1 code and nibble pattern, block scales in [2^-9, 8]."""
    w = rng.standard_normal((N, K))
    if fmt == "fp8":
        bits, scale = ref.quantize_fp8(w, per_channel)
        if from_bytes:
            bits = rng.integers(0, 256, (N, K), dtype=np.uint8)
            bits[(bits & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        row_scale = np.broadcast_to(scale, (N,)).astype(np.float32)
        return (fmt, bits, None, row_scale), ref.dequant_fp8(bits, row_scale)
    bits, block_scale, g = ref.quantize_nvfp4(w)
    if from_bytes:
        bits = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
        block_scale = rng.integers(0x00, 0x58, (N, K // 16), dtype=np.uint8)
    # per_channel: each row its own global scale, as in a fused projection of separately quantized parts
    row_scale = (rng.uniform(0.5, 2, N) * g if per_channel else np.full(N, g)).astype(np.float32)
    return (fmt, bits, block_scale, row_scale), ref.dequant_nvfp4(bits, block_scale, row_scale)


QUANT_CASES = [("fp8", 1, 33, 17, False, False), ("fp8", 5, 64, 48, True, True), ("fp8", 20, 128, 40, True, False),
               ("nvfp4", 1, 64, 96, False, False), ("nvfp4", 3, 48, 17, True, True), ("nvfp4", 19, 160, 40, True, False)]


@pytest.mark.parametrize("fmt,M,K,N,input_scale,from_bytes", QUANT_CASES)
def test_linear_quantized(cpu, fmt, M, K, N, input_scale, from_bytes):
    """out = (x * input_scale) · W^T + bias with W dequantized as ops.h defines."""
    rng = np.random.default_rng(M * 100 + K + N)
    parts, dense = quant_parts(rng, fmt, N, K, per_channel=M > 1, from_bytes=from_bytes)
    s = rng.uniform(0.5, 1.5, K).astype(np.float32) if input_scale else None
    x, bias = randn(rng, M, K), randn(rng, N)
    xs = x.astype(np.float64) * (s if s is not None else 1)
    assert relerr(cpu.linear(x, _core.QuantWeight(*parts, s), bias), xs @ dense.T + bias) <= TOL


def test_nvfp4_nibble_order(cpu):
    """The same bytes read high nibble first are a different matrix: element 2j is the low nibble."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((32, 64))
    packed, bs, g = ref.quantize_nvfp4(w)
    rs = np.full(32, g, np.float32)
    x = randn(rng, 4, 64)
    got = cpu.linear(x, _core.QuantWeight("nvfp4", packed, bs, rs))
    assert relerr(got, x @ ref.dequant_nvfp4(packed, bs, rs).T) <= TOL
    assert relerr(got, x @ w.T) < 0.15  # NVFP4's own error on a normal matrix, about 0.1
    assert relerr(got, x @ ref.dequant_nvfp4(packed, bs, rs, low_first=False).T) > 0.5


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_residual_block_ends_quantized(cpu, fmt):
    """The defaults linear_glu, rms_norm_linear(_glu) and linear_add with quantized weights whose
    input_scale carries the RMSNorm's (1 + w), nothing folded into the weight."""
    rng = np.random.default_rng(21)
    M, K, I = 5, 64, 32
    x, nw, bias = randn(rng, M, K, scale=3), randn(rng, K, scale=0.1), randn(rng, 2 * I)
    parts, dense = quant_parts(rng, fmt, 2 * I, K)  # rows taken to be in the GLU layout
    gate, up = (dense.reshape(I // ref.GLU_GROUP, 2, ref.GLU_GROUP, K)[:, i].reshape(I, K) for i in range(2))
    xd = x.astype(np.float64)
    assert relerr(cpu.linear_glu(x, _core.QuantWeight(*parts)), ref.silu(xd @ gate.T) * (xd @ up.T)) <= TOL

    norm_scale = (1 + nw).astype(np.float32)
    normed = ref.rms_norm(x, nw, 1e-6)
    out, _ = cpu.rms_norm_linear(x, _core.QuantWeight(*parts, norm_scale), 1e-6, bias)
    assert relerr(out, normed @ dense.T + bias) <= TOL
    act, _ = cpu.rms_norm_linear(x, _core.QuantWeight(*parts, norm_scale), 1e-6, glu=True)
    assert relerr(act, ref.silu(normed @ gate.T) * (normed @ up.T)) <= TOL

    res = randn(rng, M, 2 * I)
    s = rng.uniform(0.5, 1.5, K).astype(np.float32)
    got = cpu.linear_add(x, _core.QuantWeight(*parts, s), res, bias)
    assert relerr(got, res + (xd * s) @ dense.T + bias) <= TOL


def test_quant_weight_errors(cpu):
    rng = np.random.default_rng(4)
    (fmt, bits, bs, rs), _ = quant_parts(rng, "nvfp4", 8, 32)
    x = randn(rng, 2, 32)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="format must be"):
        _core.QuantWeight("int4", bits, bs, rs)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="block_scale is required"):
        _core.QuantWeight("nvfp4", bits, None, rs)
    with pytest.raises(TypeError):  # float data is refused, not converted to bytes
        _core.QuantWeight("nvfp4", bits.astype(np.float32), bs, rs)
    with pytest.raises(ocria_rt.InternalError, match=r"block_scale must be F8E4M3 \[N, K / 16\]"):
        cpu.linear(x, _core.QuantWeight("nvfp4", bits, bs[:, :1], rs))
    with pytest.raises(ocria_rt.InternalError, match=r"row_scale must be F32 \[N\]"):
        cpu.linear(x, _core.QuantWeight("nvfp4", bits, bs, rs[:4]))
    with pytest.raises(ocria_rt.InternalError, match=r"input_scale must be F32 \[K\]"):
        cpu.linear(x, _core.QuantWeight("nvfp4", bits, bs, rs, np.ones(16, np.float32)))
    with pytest.raises(ocria_rt.InternalError, match="NVFP4 needs K a multiple of 16"):
        cpu.linear(randn(rng, 2, 24), _core.QuantWeight("nvfp4", bits[:, :12], bs[:, :1], rs))


def test_embedding(cpu):
    rng = np.random.default_rng(1)
    table = randn(rng, 50, 24)
    ids = rng.integers(0, 50, 13).astype(np.int32)
    np.testing.assert_array_equal(cpu.embedding(table, ids), table[ids])


@pytest.mark.parametrize("R,D", [(1, 64), (5, 37), (33, 256)])
def test_norms(cpu, R, D):
    rng = np.random.default_rng(R + D)
    x, w = randn(rng, R, D, scale=3), randn(rng, D, scale=0.1)
    assert relerr(cpu.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)) <= TOL
    assert relerr(cpu.rms_norm(x, None, 1e-6), ref.rms_norm(x, np.zeros(D), 1e-6)) <= TOL  # the unit weight


def test_fold_norm_weight(cpu):
    rng = np.random.default_rng(3)
    w, nw = randn(rng, 9, 40), randn(rng, 40, scale=0.1)
    np.testing.assert_allclose(cpu.fold_norm_weight(w, nw), w * (1 + nw), rtol=1e-6)


@pytest.mark.parametrize("M,K,N", [(1, 64, 96), (5, 33, 48), (20, 128, 16)])
def test_residual_block_ends(cpu, M, K, N):
    """rms_norm_linear(_glu) of a folded weight against the RMSNorm (with its weight) and the linear
    apart; linear_add against residual + x · W^T."""
    rng = np.random.default_rng(M + K + N)
    x, w, nw, bias = randn(rng, M, K, scale=3), randn(rng, N, K), randn(rng, K, scale=0.1), randn(rng, N)
    normed = ref.rms_norm(x, nw, 1e-6)
    folded = cpu.fold_norm_weight(w, nw)
    out, unit_normed = cpu.rms_norm_linear(x, folded, 1e-6, bias)
    assert relerr(out, normed @ w.T.astype(np.float64) + bias) <= TOL
    assert relerr(unit_normed, ref.rms_norm(x, np.zeros(K), 1e-6)) <= TOL  # the default forms it in `normed`
    gate, up = w[: N // 2], w[N // 2:]
    act, _ = cpu.rms_norm_linear(x, cpu.fold_norm_weight(ref.glu_layout(gate, up), nw), 1e-6, glu=True)
    assert relerr(act, ref.silu(normed @ gate.T.astype(np.float64)) * (normed @ up.T.astype(np.float64))) <= TOL
    res = randn(rng, M, N)
    assert relerr(cpu.linear_add(x, w, res, bias), res + x.astype(np.float64) @ w.T + bias) <= TOL


def test_silu_mul(cpu):
    rng = np.random.default_rng(2)
    g, u = randn(rng, 7, 40, scale=2), randn(rng, 7, 40, scale=2)
    gu = ref.glu_layout(g.T, u.T).T.copy()  # [7, 80] in the GLU layout
    assert relerr(cpu.silu_mul(gu), ref.silu(g.astype(np.float64)) * u) <= TOL


@pytest.mark.parametrize("hq,hkv,hd,rot,T,start,section", [(4, 2, 32, 8, 5, 0, ()), (4, 1, 16, 4, 1, 9, ()),
                                                            (6, 3, 64, 16, 12, 3, ()), (4, 2, 64, 64, 9, 2, (11, 11, 10))])
def test_attention(cpu, hq, hkv, hd, rot, T, start, section):
    rng = np.random.default_rng(hq * hd + T)
    ctx = start + T + 4
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    qn, kn = randn(rng, hd, scale=0.1), randn(rng, hd, scale=0.1)
    k_cache, v_cache = randn(rng, ctx, hkv, hd), randn(rng, ctx, hkv, hd)  # rows < start: earlier tokens
    pos = np.arange(start, start + T, dtype=np.int32)
    # rotary positions: equal axes for text; distinct (t, h, w) when M-RoPE sections are given
    rope_pos = np.repeat(pos[:, None], 3, 1) if not section else rng.integers(0, 50, (T, 3)).astype(np.int32)
    q, kc, vc = cpu.attention_prepare(qkv, qn, kn, pos, rope_pos, k_cache, v_cache, hq, hkv, hd, rot, 1e6, 1e-6,
                                      list(section))
    rq, rk, rv = ref.attention_prepare(qkv, qn, kn, rope_pos, hq, hkv, hd, rot, 1e6, 1e-6, section or (0, 0, 0))
    assert relerr(q, rq) <= TOL
    assert relerr(kc[pos], rk) <= TOL and relerr(vc[pos], rv) <= TOL
    untouched = np.setdiff1d(np.arange(ctx), pos)
    np.testing.assert_array_equal(kc[untouched], k_cache[untouched])
    out = cpu.attention(q, kc, vc, qkv, pos, hq, hkv, hd)
    assert relerr(out, ref.attention(q, kc, vc, qkv, pos, hq, hkv, hd)) <= TOL


@pytest.mark.parametrize("hq,hkv,hd,rot,T,start", [(4, 2, 32, 8, 1, 0), (4, 2, 32, 8, 1, 9), (6, 3, 64, 16, 5, 3)])
def test_attention_decode(cpu, hq, hkv, hd, rot, T, start):
    """The one op the model calls is attention_prepare, then attention: q, the caches and out exactly;
    attention_decode_steps runs it with the positions advancing, each step writing its cache row."""
    rng = np.random.default_rng(hq * hd + T + start)
    ctx = start + 3 * T + 4
    qkv = randn(rng, T, (2 * hq + 2 * hkv) * hd)
    qn, kn = randn(rng, hd, scale=0.1), randn(rng, hd, scale=0.1)
    k_cache, v_cache = randn(rng, ctx, hkv, hd), randn(rng, ctx, hkv, hd)
    pos = np.arange(start, start + T, dtype=np.int32)
    rope_pos = np.repeat(pos[:, None], 3, 1)
    common = (hq, hkv, hd, rot, 1e6, 1e-6)
    q, kc, vc, out = cpu.attention_decode(qkv, qn, kn, pos, rope_pos, k_cache, v_cache, *common)
    wq, wk, wv = cpu.attention_prepare(qkv, qn, kn, pos, rope_pos, k_cache, v_cache, *common)
    for got, want in ((q, wq), (kc, wk), (vc, wv), (out, cpu.attention(wq, wk, wv, qkv, pos, hq, hkv, hd))):
        np.testing.assert_array_equal(got, want)
    outs, kc, vc = cpu.attention_decode_steps(qkv, qn, kn, pos, rope_pos, k_cache, v_cache, *common, [], 2, T)
    np.testing.assert_array_equal(outs[0], out)
    _, wk, wv, want = cpu.attention_decode(qkv, qn, kn, pos + T, rope_pos + T, wk, wv, *common)
    np.testing.assert_array_equal(outs[1], want)
    np.testing.assert_array_equal(kc, wk)
    np.testing.assert_array_equal(vc, wv)


@pytest.mark.parametrize("T,C", [(1, 48), (6, 160), (70, 33)])
def test_gdn_conv(cpu, T, C):
    rng = np.random.default_rng(T + C)
    x, w, state = randn(rng, T, C), randn(rng, C, 4, scale=0.3), randn(rng, C, 3)
    out, new_state = cpu.gdn_conv(x, w, state)
    rout, rstate = ref.gdn_conv(x, w, state)
    assert relerr(out, rout) <= TOL
    assert relerr(new_state, rstate) <= TOL


GDN_SHAPES = [(2, 4, 16, 16, 1), (2, 4, 16, 24, 17), (1, 3, 8, 8, 64), (2, 2, 32, 16, 150)]


@pytest.mark.parametrize("hk,hv,dk,dv,T", GDN_SHAPES)
@pytest.mark.parametrize("chunked", [False, True])
def test_gdn(cpu, hk, hv, dk, dv, T, chunked):
    rng = np.random.default_rng(hv * dv + T)
    qkv = randn(rng, T, 2 * hk * dk + hv * dv)
    ba = randn(rng, T, 2 * hv)
    A_log = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32)
    dt_bias = randn(rng, hv, scale=0.1)
    state = randn(rng, hv, dk, dv, scale=0.2)
    out, new_state = cpu.gdn(qkv, ba, A_log, dt_bias, state, hk, hv, dk, dv, chunked)
    rout, rstate = ref.gdn(qkv, ba, A_log, dt_bias, state, hk, hv, dk, dv)
    assert relerr(out, rout) <= TOL
    assert relerr(new_state, rstate) <= TOL


def test_gdn_chunked_equals_recurrent(cpu):
    rng = np.random.default_rng(5)
    hk, hv, dk, dv, T = 2, 4, 32, 32, 200
    args = (randn(rng, T, 2 * hk * dk + hv * dv), randn(rng, T, 2 * hv),
            np.log(rng.uniform(0.05, 8, hv)).astype(np.float32), randn(rng, hv, scale=0.1))
    state = randn(rng, hv, dk, dv, scale=0.2)
    a = cpu.gdn(*args, state, hk, hv, dk, dv, True)
    b = cpu.gdn(*args, state, hk, hv, dk, dv, False)
    assert relerr(a[0], b[0]) <= 1e-5 and relerr(a[1], b[1]) <= 1e-5


def test_gdn_gated_norm(cpu):
    rng = np.random.default_rng(6)
    T, hv, dv = 5, 4, 24
    o, z, w = randn(rng, T, hv * dv), randn(rng, T, hv * dv), 1 + randn(rng, dv, scale=0.1)
    assert relerr(cpu.gdn_gated_norm(o, z, w, hv, dv, 1e-6), ref.gdn_gated_norm(o, z, w, hv, dv, 1e-6)) <= TOL


def test_gdn_decode(cpu):
    """gdn_decode (the base class's three ops) on column ranges of the in_proj output qkv | z | b | a,
    two calls in a row carrying both states, against the references in sequence."""
    rng = np.random.default_rng(9)
    hk, hv, dk, dv, T, calls, pad = 2, 4, 16, 24, 3, 2, 5
    C, vdim = 2 * hk * dk + hv * dv, hv * dv
    proj = randn(rng, calls * T, C + vdim + 2 * hv + pad)
    conv_w, conv_state = randn(rng, C, 4, scale=0.3), randn(rng, C, 3)
    A_log, dt_bias = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32), randn(rng, hv, scale=0.1)
    norm_w, state = 1 + randn(rng, dv, scale=0.1), randn(rng, hv, dk, dv, scale=0.2)
    out, new_conv_state, new_state = cpu.gdn_decode(proj, conv_w, conv_state, A_log, dt_bias, norm_w, state,
                                                    hk, hv, dk, dv, calls, pad, True)
    want, cs, st = [], conv_state, state
    for i in range(calls):
        p = proj[i * T : (i + 1) * T]
        x, cs = ref.gdn_conv(p[:, :C], conv_w, cs)
        o, st = ref.gdn(x, p[:, C + vdim : C + vdim + 2 * hv], A_log, dt_bias, st, hk, hv, dk, dv)
        want.append(ref.gdn_gated_norm(o, p[:, C : C + vdim], norm_w, hv, dv, 1e-6))
    assert relerr(out, np.concatenate(want)) <= TOL
    assert relerr(new_conv_state, cs) <= TOL
    assert relerr(new_state, st) <= TOL


def test_layer_norm_and_gelu(cpu):
    rng = np.random.default_rng(8)
    x, w, b = randn(rng, 9, 40, scale=3), randn(rng, 40), randn(rng, 40)
    assert relerr(cpu.layer_norm(x, w, b, 1e-6), ref.layer_norm(x, w, b, 1e-6)) <= TOL
    for tanh in (True, False):
        assert relerr(cpu.gelu(x, tanh), ref.gelu(x, tanh)) <= TOL


@pytest.mark.parametrize("R,N,D,K", [(16, 1, 8, 4), (49, 37, 33, 4), (9, 20, 64, 3)])
def test_gather_blend_add(cpu, R, N, D, K):
    """Updates x's top-left [N, D] block (a row-strided view) only; rows repeat across and within patches."""
    rng = np.random.default_rng(R + N + D)
    table = randn(rng, R, D)
    rows = rng.integers(0, R, (N, K)).astype(np.int32)
    rows[::3, -1] = rows[::3, 0]
    rows[1::4] = rows[0]
    weights = rng.uniform(0, 1, (N, K)).astype(np.float32)
    x = np.full((N + 2, D + 3), np.nan, np.float32)
    x[:N, :D] = randn(rng, N, D)
    got = cpu.gather_blend_add(table, rows, weights, x, N, D)
    assert relerr(got[:N, :D], ref.gather_blend_add(table, rows, weights, x[:N, :D])) <= TOL
    np.testing.assert_array_equal(got[N:], x[N:])
    np.testing.assert_array_equal(got[:, D:], x[:, D:])


@pytest.mark.parametrize("heads,hd,lengths", [(2, 16, [8, 12]), (3, 32, [20]), (1, 64, [4, 16, 8])])
def test_vision_attention(cpu, heads, hd, lengths):
    rng = np.random.default_rng(heads * hd)
    N = sum(lengths)
    qkv = randn(rng, N, 3 * heads * hd)
    pos = rng.integers(0, 40, (N, 2)).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    got = cpu.vision_attention(qkv, pos, cu, heads, 10000.0)
    assert relerr(got, ref.vision_attention(qkv, pos, cu, heads, 10000.0)) <= TOL


def test_post_mailbox(cpu):
    check_post_mailbox(cpu)

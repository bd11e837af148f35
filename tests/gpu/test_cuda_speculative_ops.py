"""The CUDA ops of speculative decoding against the CPU reference and against the CUDA decode ops they
stand in for (skipped without CUDA, by tests/conftest.py).

Inputs are rounded to BF16 first, so both backends see the same numbers. Outputs are poisoned with
NaN by OpRunner before each op, and relerr() fails on any NaN left behind.
- gdn_verify / gdn_commit are designed to be gdn_decode's arithmetic: compared bit for bit with the
  CUDA gdn_decode of every prefix (the 4B shape, the fixtures' shapes, dv not a multiple of 32, dk up
  to 256, several column groups per head, a conv width other than 4, more tokens than one chunk).
- The drafter's attention and convolutions against the CPU within BF16 tolerances (reasons below).
- selector_walk and speculative_accept: token for token with the CPU at temperature 0, and draw for
  draw at temperature > 0 on BF16-exact inputs (both backends form the same floats in the same
  order, see cuda/dflash.cu and cuda/sampling.cu).
"""

from __future__ import annotations

import numpy as np
import pytest

import ocria_rt
from support import relerr
from ocria_rt import _core

pytestmark = pytest.mark.gpu

OUT_TOL = 1e-2  # a BF16 output (q, P rounded to BF16 inside the attention) against the fp32 reference
# gdn_verify's output against the CPU: gdn_decode's bound (tests/gpu/test_cuda_ops.py: the GPU rounds
# the conv output and o to BF16 between the steps and the gated norm amplifies it; measured up to 2.9e-2
# and 3.0e-3 with the CPU ops modelling those roundings).
DECODE_OUT_TOL = 5e-2
DECODE_STATE_TOL = 5e-3


@pytest.fixture(scope="module")
def cpu():
    return _core.OpRunner("cpu")


@pytest.fixture(scope="module")
def gpu():
    return _core.OpRunner("cuda")


def bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest BF16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def randn(rng, *shape, scale=1.0):
    return bf16((rng.standard_normal(shape) * scale).astype(np.float32))


# ---- gdn_verify / gdn_commit ----


def gdn_block(rng, hk, hv, dk, dv, T, pad, width=4):
    """A verified block's in_proj output [T, qkv | z | b | a (+ pad)] and the layer's states."""
    C = 2 * hk * dk + hv * dv
    proj = randn(rng, T, C + hv * dv + 2 * hv + pad)
    conv_w, conv_state = randn(rng, C, width, scale=0.3), randn(rng, C, width - 1)
    A_log = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32)
    dt_bias, norm_w = randn(rng, hv, scale=0.1), bf16(1 + randn(rng, dv, scale=0.1))
    state = randn(rng, hv, dk, dv, scale=0.2)
    return proj, (conv_w, conv_state, A_log, dt_bias, norm_w, state, hk, hv, dk, dv)


VERIFY_CASES = [
    # hk, hv, dk, dv, T, conv width
    (16, 32, 128, 128, 16, 4),  # the 4B shape at B = 16
    (2, 4, 16, 16, 8, 4),  # text_tied's DeltaNet
    (2, 4, 16, 24, 6, 4),  # text_untied_dkdv's: dv not a multiple of 32
    (2, 4, 32, 32, 16, 4),  # tiny-random's
    (4, 8, 64, 128, 5, 4),
    (1, 3, 64, 40, 16, 4),  # two column groups, the second mostly empty; HV / HK = 3
    (2, 2, 32, 200, 9, 4),  # seven column groups (a cluster of 7)
    (1, 2, 256, 64, 7, 4),  # dk 256: gdn_decode runs the three ops
    (2, 4, 32, 256, 3, 4),  # dv 256: eight column groups
    (2, 4, 32, 48, 20, 4),  # 20 tokens: two chunks, the conv window restarting from the raw inputs
    (2, 4, 16, 16, 5, 3),  # conv width 3 (the run-time-width kernel)
    (2, 2, 16, 32, 1, 2),  # one token, width 2
]


@pytest.mark.parametrize("hk,hv,dk,dv,T,width", VERIFY_CASES)
def test_gdn_verify_commit_equal_decode(cpu, gpu, hk, hv, dk, dv, T, width):
    """gdn_verify's outputs are the CUDA gdn_decode's of the whole block, bit for bit, and leave both
    states untouched; gdn_commit of every prefix 1..T leaves the states gdn_decode of that prefix
    leaves, bit for bit (conv state and recurrent state). proj is a column range of a wider buffer."""
    rng = np.random.default_rng(hk * dk + hv * dv + T + width)
    pad = 5
    proj, args = gdn_block(rng, hk, hv, dk, dv, T, pad, width)
    conv_state, state = args[1], args[5]
    want_out, _, _ = gpu.gdn_decode(proj, *args, 1, pad, True)
    assert np.all(np.isfinite(want_out))
    for keep in range(1, T + 1):
        out, cs_v, st_v, cs, st = gpu.gdn_verify_commit(proj, *args, keep, pad)
        np.testing.assert_array_equal(out, want_out, err_msg=f"keep {keep}: verify's outputs")
        np.testing.assert_array_equal(cs_v, conv_state)
        np.testing.assert_array_equal(st_v, state)
        _, want_cs, want_st = gpu.gdn_decode(proj[:keep], *args, 1, pad, True)
        np.testing.assert_array_equal(cs, want_cs, err_msg=f"keep {keep}: conv state")
        np.testing.assert_array_equal(st, want_st, err_msg=f"keep {keep}: state")
    # against the CPU reference (the last keep: the whole block)
    cout, _, _, ccs, cst = cpu.gdn_verify_commit(proj, *args, T, pad)
    assert relerr(out, cout) <= DECODE_OUT_TOL
    assert relerr(cs, ccs) <= 1e-6  # a copy of (BF16) inputs
    assert relerr(st, cst) <= DECODE_STATE_TOL


@pytest.mark.parametrize("hk,hv,dk,dv,T", [(16, 32, 128, 128, 16), (2, 4, 16, 24, 6), (1, 3, 64, 40, 16)])
def test_gdn_verify_commit_graph_replay(gpu, hk, hv, dk, dv, T):
    """verify + commit captured once in a CUDA graph and replayed with keep changed on the device in
    between (as a captured speculative step reads the accepted count): each replay commits its own
    prefix, bit for bit gdn_decode's."""
    rng = np.random.default_rng(hk + hv + dk + dv + T)
    proj, args = gdn_block(rng, hk, hv, dk, dv, T, 0)
    keeps = [T, 1, T // 2, 2, T, 1]
    outs, conv_states, states = gpu.gdn_verify_commit_replay(proj, *args, keeps)
    want_out, _, _ = gpu.gdn_decode(proj, *args, 1, 0, True)
    for i, keep in enumerate(keeps):
        _, want_cs, want_st = gpu.gdn_decode(proj[:keep], *args, 1, 0, True)
        np.testing.assert_array_equal(outs[i], want_out)
        np.testing.assert_array_equal(conv_states[i], want_cs, err_msg=f"replay {i}, keep {keep}")
        np.testing.assert_array_equal(states[i], want_st, err_msg=f"replay {i}, keep {keep}")


def test_gdn_verify_refuses_unsupported_shapes(gpu):
    rng = np.random.default_rng(3)
    proj, args = gdn_block(rng, 1, 1, 16, 264, 2, 0)
    with pytest.raises(ocria_rt.errors.InternalError, match="v_head_dim 264"):
        gpu.gdn_verify_commit(proj, *args, 1)


# ---- the drafter's attention ----

DRAFT_ATTN_CASES = [
    # hq, hkv, hd, cache rows, block start, T, causal, window
    (4, 2, 16, 40, 9, 6, False, 0),  # the fixtures' head_dim 16, bidirectional
    (4, 4, 16, 40, 9, 6, False, 3),  # two-sided window (dflash2_tied's layers)
    (2, 1, 32, 60, 20, 6, True, 5),  # causal sliding window (dflash_sliding's)
    (4, 2, 32, 100, 50, 16, True, 0),  # causal
    (32, 8, 128, 4096, 3000, 16, False, 0),  # a 4B-sized drafter: GQA 4, 64 query rows a block
    (32, 4, 128, 20000, 19000, 16, False, 0),  # tens of thousands of rows: many splits; GQA 8: 128 rows
    (16, 2, 64, 9000, 8000, 15, True, 0),
    (12, 4, 64, 3000, 2000, 7, False, 100),  # GQA 3, a window of 100 rows over a long cache
    (8, 8, 256, 700, 600, 16, False, 0),  # head_dim 256
    (4, 2, 128, 16, 0, 16, False, 0),  # the block is the whole context
    (6, 2, 32, 300, 1, 1, False, 0),  # one query, two rows
]


@pytest.mark.parametrize("hq,hkv,hd,rows,start,T,causal,window", DRAFT_ATTN_CASES)
def test_draft_attention(cpu, gpu, hq, hkv, hd, rows, start, T, causal, window):
    """draft_store_kv (k_norm, RoPE over the whole head, the cache rows of the block) and
    draft_attention against the CPU. Rows past the block and, with a window, rows before the earliest
    visible one are NaN: no kernel may read them (the CPU does not). The attention compares both
    backends on the same (BF16-rounded CPU) cache."""
    rng = np.random.default_rng(hq * hd + rows + T + window + int(causal))
    theta, eps = 1e6, 1e-6
    k_cache, v_cache = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    last = start + T - 1
    k_cache[last + 1 :] = v_cache[last + 1 :] = np.nan
    if window:
        first = max(0, start - window + 1)
        k_cache[:first] = v_cache[:first] = np.nan
    kv, q = randn(rng, T, 2 * hkv * hd), randn(rng, T, hq * hd)
    q_norm, k_norm = randn(rng, hd, scale=0.1), randn(rng, hd, scale=0.1)
    positions = np.arange(start, start + T, dtype=np.int32)
    gk, gv = gpu.draft_store_kv(kv, k_norm, positions, k_cache, v_cache, hkv, hd, theta, eps)
    ck, cv = cpu.draft_store_kv(kv, k_norm, positions, k_cache, v_cache, hkv, hd, theta, eps)
    assert relerr(gk[positions], ck[positions]) <= OUT_TOL
    np.testing.assert_array_equal(gv[positions], cv[positions])  # v is stored as it came (BF16)
    rest = np.setdiff1d(np.arange(rows), positions)
    np.testing.assert_array_equal(gk[rest], k_cache[rest])  # NaN compares equal in assert_array_equal
    np.testing.assert_array_equal(gv[rest], v_cache[rest])
    kc, vc = bf16(ck), bf16(cv)
    args = (q, q_norm, positions, kc, vc, hq, hkv, hd, theta, eps, causal, window)
    assert relerr(gpu.draft_attention(*args), cpu.draft_attention(*args)) <= OUT_TOL


def test_draft_attention_positions_grow(cpu, gpu):
    """The same cache with the block at later and later positions: the split count is the launch's,
    the lengths the positions' (short contexts take one split, long ones many)."""
    rng = np.random.default_rng(5)
    hq, hkv, hd, rows, T = 8, 2, 64, 12000, 8
    kc, vc = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    q, q_norm = randn(rng, T, hq * hd, scale=2), randn(rng, hd, scale=0.1)
    for start in (0, 40, 700, 5000, rows - T):
        positions = np.arange(start, start + T, dtype=np.int32)
        args = (q, q_norm, positions, kc, vc, hq, hkv, hd, 1e4, 1e-6, False, 0)
        assert relerr(gpu.draft_attention(*args), cpu.draft_attention(*args)) <= OUT_TOL, start


# ---- dynamic_conv, scale_softcap ----


@pytest.mark.parametrize("T,C,K,group", [(7, 64, 2, 16), (16, 2560, 2, 16), (5, 48, 3, 8), (1, 32, 1, 4), (16, 96, 4, 32)])
def test_dynamic_conv(cpu, gpu, T, C, K, group):
    rng = np.random.default_rng(T * C + K + group)
    x, dyn, base = randn(rng, T, C), randn(rng, T, K * (C // group)), randn(rng, K, C)
    assert relerr(gpu.dynamic_conv(x, dyn, base, group), cpu.dynamic_conv(x, dyn, base, group)) <= OUT_TOL


@pytest.mark.parametrize("R,V", [(4, 50), (15, 248320), (3, 1)])
def test_scale_softcap(cpu, gpu, R, V):
    x = randn(np.random.default_rng(R + V), R, V, scale=20)
    for multiplier, softcap in ((0.37, 3.0), (2.0, 0.0), (1.0, 30.0)):
        assert relerr(gpu.scale_softcap(x, multiplier, softcap), cpu.scale_softcap(x, multiplier, softcap)) <= OUT_TOL


# ---- selector_walk ----

WALK_CASES = [
    # R, V, rank, K, tied logits
    (7, 90, 12, 6, False),
    (7, 90, 12, 6, True),  # many equal logits: candidates in id order among equals
    (15, 8193, 33, 16, False),  # one logit past a block of the first pass
    (15, 20000, 256, 16, True),
    (3, 64, 8, 64, False),  # every logit a candidate
    (15, 248320, 32, 16, False),  # the 4B vocabulary
]


def walk_inputs(R, V, rank, tied, seed):
    rng = np.random.default_rng(seed)
    logits = bf16(rng.integers(-8, 8, (R, V)) / 4) if tied else randn(rng, R, V, scale=2)
    h = randn(rng, R, rank)
    pred, succ = randn(rng, V, rank, scale=0.3), randn(rng, V, rank, scale=0.3)
    return logits, h, pred, succ


@pytest.mark.parametrize("R,V,rank,K,tied", WALK_CASES)
def test_selector_walk_matches_cpu(cpu, gpu, R, V, rank, K, tied):
    """Greedy: the CPU's walk token for token, the same candidates in the same order, one-hot q.
    Sampled: the same draws and the same q (both form the scores' products of BF16 values exactly and
    sum them in the same order, and the softmax as the CPU does)."""
    logits, h, pred, succ = walk_inputs(R, V, rank, tied, R * V + rank + K)
    anchor = V // 3
    for temperature, seed, step in ((0.0, 0, 0), (0.7, 3, 10), (1.5, 11, 12345)):
        gt, gc, gq = gpu.selector_walk(logits, h, pred, succ, anchor, K, temperature, seed, step)
        ct, cc, cq = cpu.selector_walk(logits, h, pred, succ, anchor, K, temperature, seed, step)
        np.testing.assert_array_equal(gc, cc, err_msg=f"candidates at T={temperature}")
        np.testing.assert_array_equal(gt, ct, err_msg=f"tokens at T={temperature}")
        if temperature == 0:
            np.testing.assert_array_equal(gq, cq)
        else:
            np.testing.assert_allclose(gq, cq, rtol=1e-6, atol=1e-7)


def test_selector_walk_steps_match_cpu(cpu, gpu):
    """selector_walk captured in a graph, replayed with the counter advanced on the device."""
    logits, h, pred, succ = walk_inputs(7, 300, 16, False, 9)
    got = gpu.selector_walk_steps(logits, h, pred, succ, 4, 8, 1.0, 17, 200, 5)
    want = cpu.selector_walk_steps(logits, h, pred, succ, 4, 8, 1.0, 17, 200, 5)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, atol=1e-7)


# ---- speculative_accept ----


@pytest.mark.parametrize("B,V", [(6, 40), (16, 248320), (2, 7), (1, 100)])
def test_speculative_accept_greedy(cpu, gpu, B, V):
    """Every acceptance length: the CPU's emitted tokens, count and step; the argmax of tied rows is
    the lowest index, as the sampler's."""
    rng = np.random.default_rng(B + V)
    logits = randn(rng, B, V)
    logits[:, V // 2] = logits[:, V - 1] = logits.max(1) + 1  # two equal maxima per row
    logits = bf16(logits)
    target = logits.argmax(1)
    assert np.all(target == V // 2)
    for a in range(B):
        draft = target[: B - 1].astype(np.int32).copy()
        if a < B - 1:
            draft[a] = (draft[a] + 1) % V
        cand, q = draft[:, None].copy(), np.ones((B - 1, 1), np.float32)
        got = gpu.speculative_accept(logits, draft, cand, q, 0.0, 0, 1.0, 0, 5)
        want = cpu.speculative_accept(logits, draft, cand, q, 0.0, 0, 1.0, 0, 5)
        assert list(got[0]) == list(want[0]) and got[1:] == want[1:] == (a + 1, 5 + B)


ACCEPT_SAMPLING_CASES = [
    # B, V, top_k, top_p, candidates per draft
    (3, 7, 0, 1.0, 4),
    (3, 7, 4, 1.0, 4),
    (3, 7, 0, 0.8, 4),
    (5, 300, 20, 0.95, 1),  # a deterministic draft (DFlash)
    (5, 3000, 0, 1.0, 16),  # no cut: the draw's bin, the residual's descent over the whole row
    (4, 20000, 50, 1.0, 16),
    (8, 248320, 0, 0.9, 16),  # the 4B vocabulary, top-p
]


@pytest.mark.parametrize("B,V,top_k,top_p,Kq", ACCEPT_SAMPLING_CASES)
def test_speculative_accept_sampling_draws_as_cpu(cpu, gpu, B, V, top_k, top_p, Kq):
    """At temperature > 0, over many seeds: the CPU's emitted tokens, counts and steps exactly. The
    drafts are drawn from q, whose candidates are the target's likeliest tokens and others, with
    padding (-1) and repeated ids, so drafts are accepted and rejected, and corrections come from
    every part of the residual."""
    rng = np.random.default_rng(B * V + top_k + Kq)
    # Every probability above 2^-29, where the CPU's double sums are exact (and so equal the CUDA
    # sampler's fixed-point sums): logits of standard deviation 1 over the 4B vocabulary.
    logits = randn(rng, B, V, scale=1.5 if V <= 10000 else 1.0)
    seeds = 40 if V > 10000 else 300
    accepted = set()
    for seed in range(seeds):
        cand = np.empty((B - 1, Kq), np.int32)
        q = np.zeros((B - 1, Kq), np.float32)
        for i in range(B - 1):
            likely = np.argsort(-logits[i], kind="stable")[: max(1, Kq // 2)]
            ids = np.concatenate([likely, rng.integers(0, V, Kq - len(likely))]).astype(np.int32)
            if Kq > 2:
                ids[-1] = -1  # padding
                ids[-2] = ids[0]  # a repeated id: its q is the sum of its slots
            cand[i] = ids
            q[i] = rng.dirichlet(np.ones(Kq)).astype(np.float32)
            q[i][ids < 0] = 0
        valid = [[k for k in range(Kq) if cand[i, k] >= 0] for i in range(B - 1)]
        draft = np.array([cand[i, rng.choice(valid[i], p=q[i, valid[i]] / q[i, valid[i]].sum())]
                          for i in range(B - 1)], np.int32)
        step = int(rng.integers(0, 1 << 20))
        got = gpu.speculative_accept(logits, draft, cand, q, 0.9, top_k, top_p, seed, step)
        want = cpu.speculative_accept(logits, draft, cand, q, 0.9, top_k, top_p, seed, step)
        assert list(got[0]) == list(want[0]) and got[1:] == want[1:], f"seed {seed}"
        accepted.add(got[1] - 1)
    assert len(accepted) >= 2, "the drafts were all accepted or all rejected"


def test_speculative_accept_steps_match_cpu(cpu, gpu):
    """speculative_accept captured in a graph and replayed: the step advances on the device, each
    replay draws as the CPU at that step."""
    rng = np.random.default_rng(31)
    B, V = 4, 50
    logits = randn(rng, B, V, scale=2)
    draft = logits[:-1].argmax(1).astype(np.int32)
    cand = np.stack([draft, (draft + 1) % V], 1).astype(np.int32)
    q = np.tile(np.array([[0.6, 0.4]], np.float32), (B - 1, 1))
    got = gpu.speculative_accept_steps(logits, draft, cand, q, 1.0, 10, 1.0, 7, 1000, 12)
    want = cpu.speculative_accept_steps(logits, draft, cand, q, 1.0, 10, 1.0, 7, 1000, 12)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2] == 1000 + 12 * B

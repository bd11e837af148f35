"""The CPU ops of speculative decoding against float64 numpy references and against the decode ops
they stand in for; the acceptance rule's output distribution against the target's (chi-square)."""

from __future__ import annotations

import numpy as np
import pytest

import reference_ops as ref
from support import chi2_pvalue, relerr
from ocria_rt import _core

TOL = 1e-5


@pytest.fixture(scope="module")
def cpu():
    return _core.OpRunner("cpu")


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("hk,hv,dk,dv,T", [(2, 4, 16, 16, 8), (1, 3, 8, 24, 5), (2, 2, 32, 16, 16)])
def test_gdn_verify_commit_equals_decode(cpu, hk, hv, dk, dv, T):
    """gdn_verify's outputs are gdn_decode's for the whole block, bit for bit, and leave both states as
    they were; gdn_commit of any prefix leaves the states gdn_decode of that prefix leaves, bit for bit
    (the CPU replays the recorded updates with the recurrence's own arithmetic)."""
    rng = np.random.default_rng(hv * dv + T)
    C, vdim, pad = 2 * hk * dk + hv * dv, hv * dv, 3
    proj = randn(rng, T, C + vdim + 2 * hv + pad)
    conv_w, conv_state = randn(rng, C, 4, scale=0.3), randn(rng, C, 3)
    A_log, dt_bias = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32), randn(rng, hv, scale=0.1)
    norm_w, state = 1 + randn(rng, dv, scale=0.1), randn(rng, hv, dk, dv, scale=0.2)
    args = (conv_w, conv_state, A_log, dt_bias, norm_w, state, hk, hv, dk, dv)
    full_out, _, _ = cpu.gdn_decode(proj, *args, 1, pad, False)
    for keep in range(1, T + 1):
        out, cs_v, st_v, cs, st = cpu.gdn_verify_commit(proj, *args, keep, pad)
        assert np.array_equal(out, full_out)
        assert np.array_equal(cs_v, conv_state) and np.array_equal(st_v, state)
        _, want_cs, want_st = cpu.gdn_decode(proj[:keep], *args, 1, pad, False)
        assert np.array_equal(cs, want_cs), keep
        assert np.array_equal(st, want_st), keep


@pytest.mark.parametrize("causal,window", [(False, 0), (True, 0), (True, 4), (False, 3)])
def test_draft_attention(cpu, causal, window):
    rng = np.random.default_rng(7 + window)
    hq, hkv, hd, rows, start, T = 4, 2, 16, 20, 9, 6
    k_cache, v_cache = randn(rng, rows, hkv, hd), randn(rng, rows, hkv, hd)
    kv = randn(rng, T, 2 * hkv * hd)
    q = randn(rng, T, hq * hd)
    q_norm, k_norm = randn(rng, hd, scale=0.1), randn(rng, hd, scale=0.1)
    positions = np.arange(start, start + T, dtype=np.int32)
    kc, vc = cpu.draft_store_kv(kv, k_norm, positions, k_cache, v_cache, hkv, hd, 1e4, 1e-6)
    rkc, rvc = ref.draft_store_kv(kv, k_norm, positions, k_cache, v_cache, hkv, hd, 1e4, 1e-6)
    assert relerr(kc, rkc) <= TOL and relerr(vc, rvc) <= TOL
    assert np.array_equal(kc[start + T :], k_cache[start + T :])  # rows past the block untouched
    out = cpu.draft_attention(q, q_norm, positions, kc, vc, hq, hkv, hd, 1e4, 1e-6, causal, window)
    want = ref.draft_attention(q, q_norm, positions, rkc, rvc, hq, hkv, hd, 1e4, 1e-6, causal, window)
    assert relerr(out, want) <= TOL


@pytest.mark.parametrize("K,group", [(2, 16), (3, 8), (1, 4)])
def test_dynamic_conv(cpu, K, group):
    rng = np.random.default_rng(K * group)
    T, C = 7, 64
    x, dyn, base = randn(rng, T, C), randn(rng, T, K * (C // group)), randn(rng, K, C)
    assert relerr(cpu.dynamic_conv(x, dyn, base, group), ref.dynamic_conv(x, dyn, base, group)) <= TOL


def test_scale_softcap(cpu):
    x = np.random.default_rng(3).standard_normal((4, 50)).astype(np.float32) * 20
    assert relerr(cpu.scale_softcap(x, 0.37, 3.0), np.tanh(x * 0.37 / 3.0) * 3.0) <= TOL
    assert relerr(cpu.scale_softcap(x, 2.0, 0.0), x * 2.0) <= TOL


def test_selector_walk(cpu):
    """Greedy: the walk of the reference; sampled: each position's q is softmax(score / T) over its
    candidates and the token drawn is one of them."""
    rng = np.random.default_rng(11)
    R, V, r, K = 7, 90, 12, 6
    logits, h = randn(rng, R, V, scale=2), randn(rng, R, r)
    pred, succ = randn(rng, V, r), randn(rng, V, r)
    tokens, cand, prob = cpu.selector_walk(logits, h, pred, succ, 5, K, 0.0, 0, 0)
    assert list(tokens) == ref.selector_walk_greedy(logits, h, pred, succ, 5, K)
    assert np.array_equal(prob.sum(1), np.ones(R)) and set(np.unique(prob)) == {0.0, 1.0}
    tokens, cand, prob = cpu.selector_walk(logits, h, pred, succ, 5, K, 0.7, 3, 10)
    prev = 5
    for t in range(R):
        assert sorted(cand[t]) == sorted(np.argsort(-logits[t], kind="stable")[:K])
        s = logits[t, cand[t]] + (pred[prev].astype(np.float64) * h[t]) @ succ[cand[t]].T
        q = np.exp((s - s.max()) / 0.7)
        assert np.allclose(prob[t], q / q.sum(), atol=1e-6)
        assert tokens[t] in cand[t]
        prev = tokens[t]


def test_speculative_accept_greedy(cpu):
    rng = np.random.default_rng(4)
    B, V = 6, 40
    logits = randn(rng, B, V)
    target = logits.argmax(1)
    for a in range(B):  # the first a drafts agree with the target's argmax
        draft = target[: B - 1].copy()
        if a < B - 1:
            draft[a] = (draft[a] + 1) % V
        out, n, step = cpu.speculative_accept(logits, draft.astype(np.int32), draft[:, None].astype(np.int32),
                                              np.ones((B - 1, 1), np.float32), 0.0, 0, 1.0, 0, 5)
        assert n == a + 1 and list(out) == list(target[: a + 1]) and step == 5 + B


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (4, 1.0), (0, 0.8)])
def test_speculative_accept_is_lossless(cpu, top_k, top_p):
    """Over many seeds, the first emitted token follows p_0 (the sampler's distribution of row 0), and
    the token after an accepted first draft follows p_1, for a draft distribution q that overlaps p,
    puts mass where p has none, and misses some of p's tokens (q is far from p: emitting the drafts
    unchecked would fail the test)."""
    rng = np.random.default_rng(top_k + int(10 * top_p))
    B, V, Kq, T, N = 3, 7, 4, 0.9, 6000
    logits = randn(rng, B, V, scale=1.5)
    p = [ref.sampler_probs(logits[i], T, top_k, top_p) for i in range(B)]
    cand = np.array([[0, 1, 2, 6], [1, 3, 5, 6]], np.int32)
    q = np.array([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]], np.float32)
    q0 = np.zeros(V)
    q0[cand[0]] = q[0]
    assert 0.5 * np.abs(q0 - p[0]).sum() > 0.2
    first, second = np.zeros(V), np.zeros(V)
    for seed in range(N):
        # the drafts are drawn from q, as the drafter draws them
        d = np.array([rng.choice(cand[i], p=q[i] / q[i].sum()) for i in range(B - 1)], np.int32)
        out, n, _ = cpu.speculative_accept(logits, d, cand, q, T, top_k, top_p, seed, 3 * seed)
        first[out[0]] += 1
        if n >= 2:
            second[out[1]] += 1
    assert chi2_pvalue(first, p[0]) > 1e-3
    assert chi2_pvalue(second, p[1]) > 1e-3


def test_gdn_verify_commit_replay(cpu):
    """The op runner's captured step (states restored, verify, commit of a device-side keep) run with
    several keeps in turn: each leaves gdn_decode's states of that prefix, and verify's outputs."""
    rng = np.random.default_rng(21)
    hk, hv, dk, dv, T = 2, 4, 16, 24, 7
    C, vdim = 2 * hk * dk + hv * dv, hv * dv
    proj = randn(rng, T, C + vdim + 2 * hv)
    conv_w, conv_state = randn(rng, C, 4, scale=0.3), randn(rng, C, 3)
    A_log, dt_bias = np.log(rng.uniform(0.05, 8, hv)).astype(np.float32), randn(rng, hv, scale=0.1)
    norm_w, state = 1 + randn(rng, dv, scale=0.1), randn(rng, hv, dk, dv, scale=0.2)
    args = (conv_w, conv_state, A_log, dt_bias, norm_w, state, hk, hv, dk, dv)
    keeps = [T, 1, 4, 2, T]
    outs, conv_states, states = cpu.gdn_verify_commit_replay(proj, *args, keeps)
    full_out, _, _ = cpu.gdn_decode(proj, *args, 1, 0, False)
    for i, keep in enumerate(keeps):
        _, want_cs, want_st = cpu.gdn_decode(proj[:keep], *args, 1, 0, False)
        assert np.array_equal(outs[i], full_out)
        assert np.array_equal(conv_states[i], want_cs) and np.array_equal(states[i], want_st), keep


def test_selector_walk_steps(cpu):
    """Repeated steps of selector_walk with the counter advanced on the device draw as single calls at
    the advanced counters."""
    rng = np.random.default_rng(12)
    R, V, r, K = 5, 70, 8, 4
    logits, h = randn(rng, R, V, scale=2), randn(rng, R, r)
    pred, succ = randn(rng, V, r), randn(rng, V, r)
    tokens, cand, prob = cpu.selector_walk_steps(logits, h, pred, succ, 3, K, 0.8, 9, 40, 3)
    for i in range(3):
        want = cpu.selector_walk(logits, h, pred, succ, 3, K, 0.8, 9, 40 + i * R)
        assert np.array_equal(tokens[i], want[0]) and np.array_equal(cand[i], want[1])
        assert np.array_equal(prob[i], want[2])


def test_speculative_accept_steps(cpu):
    """Repeated steps of speculative_accept (step advanced by B on the device each time) emit what
    single calls at the advanced counters emit."""
    rng = np.random.default_rng(13)
    B, V = 4, 9
    logits = randn(rng, B, V, scale=1.5)
    draft = np.array([2, 5, 1], np.int32)
    cand = np.array([[2, 0], [5, 4], [1, -1]], np.int32)
    q = np.array([[0.7, 0.3], [0.5, 0.5], [1.0, 0.0]], np.float32)
    emitted, counts, step = cpu.speculative_accept_steps(logits, draft, cand, q, 1.0, 0, 1.0, 5, 100, 6)
    assert step == 100 + 6 * B
    for i in range(6):
        out, n, _ = cpu.speculative_accept(logits, draft, cand, q, 1.0, 0, 1.0, 5, 100 + i * B)
        assert counts[i] == n and list(emitted[i][:n]) == list(out) and all(emitted[i][n:] == -1)

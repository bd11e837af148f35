"""The calibration hooks (projection-input observer, in-memory weight replacement) and ocria_rt.quantize on
the CUDA backend, against the CPU (run on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import numpy as np

import ocria_rt
import quant_numpy as qn
from support import FIXTURES, relerr

TEXT = FIXTURES / "text_tied"
# The first projection (layer 0) reads the normalised embeddings, the same values on both backends up
# to BF16 rounding: its statistics pin the observer's arithmetic (FIRST_TOL, relerr CUDA against CPU).
# Deeper inputs differ by the BF16 drift of the CUDA engine's activations against the CPU's fp32
# (DEEP_TOL): a channel's maximum over the tokens picks out one token's drift (relerr up to 0.104 over
# 48 tokens on the H100, single channels 25% apart), the squares weigh the largest values most (up to
# 0.055), the second moments' cross products more (0.107 over 48 tokens, 0.126 over 2,000). Those bounds check that every slot observes its own input over every token; the input of
# another slot, or tokens missed, is far off.
FIRST_TOL = 5e-3
DEEP_TOL = {"abs_max": 0.25, "abs_mean": 0.1, "square_mean": 0.1, "second_moment": 0.2}


def check_stats(cpu_slots: list[dict], cuda_slots: list[dict], tokens: int) -> None:
    assert len(cpu_slots) == len(cuda_slots) > 1
    for i, (cpu, cuda) in enumerate(zip(cpu_slots, cuda_slots)):
        assert cpu["tokens"] == cuda["tokens"] == tokens
        for key, deep_tol in DEEP_TOL.items():
            assert relerr(cuda[key], cpu[key]) <= (FIRST_TOL if i == 0 else deep_tol), (i, key)


def ids(n=40, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def test_observer_matches_cpu():
    """The statistics of every projection's input agree with the CPU's (FIRST_TOL, DEEP_TOL);
    observing leaves the scores as they are."""
    tokens = ids(48)
    stats = {}
    for device in ("cpu", "cuda"):
        eng = ocria_rt.Engine(TEXT, device=device, linear_observer=True)
        eng.observe_linear_inputs(True, second_moment=True)
        got = eng.score(tokens)
        eng.observe_linear_inputs(False)
        stats[device] = eng.linear_input_stats()
        if device == "cuda":
            assert relerr(got, ocria_rt.Engine(TEXT, device="cuda").score(tokens)) <= 1e-2
    check_stats(stats["cpu"], stats["cuda"], 48)


def test_set_linear_weight_restores_bits():
    """Replacing a weight changes the scores and greedy tokens (captured decode graphs included); restoring
    gives the same bits back; a tied LM head replaced leaves the embeddings alone."""
    t = qn.read_checkpoint(TEXT)
    eng = ocria_rt.Engine(TEXT, device="cuda")
    tokens = ids()
    base = eng.score(tokens)
    greedy = eng.generate(tokens[:8], max_new_tokens=16, stop_token_ids=[]).token_ids
    eng.set_linear_weight("model.layers.2.mlp.up_proj", 0.5 * t["model.layers.2.mlp.up_proj.weight"].f32())
    assert relerr(eng.score(tokens), base) > 1e-3
    eng.restore_linear_weights()
    np.testing.assert_array_equal(eng.score(tokens), base)
    eng.set_linear_weight("lm_head", -t["model.embed_tokens.weight"].f32())
    np.testing.assert_allclose(eng.score(tokens), -base, rtol=2e-2, atol=2e-2)
    assert eng.generate(tokens[:8], max_new_tokens=16, stop_token_ids=[]).token_ids != greedy
    eng.restore_linear_weights()
    assert eng.generate(tokens[:8], max_new_tokens=16, stop_token_ids=[]).token_ids == greedy


def test_quantize_on_cuda(tmp_path):
    """quantize(device="cuda") writes the checkpoint the CPU run writes, up to the calibration's BF16
    activations: the same plan, tensors and bytes; it loads on both backends."""
    res = {d: ocria_rt.quantize(TEXT, tmp_path / d, "nvfp4", calib_synthetic=4, heldout=1, device=d, progress=False)
           for d in ("cpu", "cuda")}
    assert res["cpu"].plan == res["cuda"].plan
    a, b = (qn.read_checkpoint(res[d].out_dir) for d in ("cpu", "cuda"))
    assert {n: (x.dtype, x.shape) for n, x in a.items()} == {n: (x.dtype, x.shape) for n, x in b.items()}
    assert res["cpu"].report["total"]["bytes"] == res["cuda"].report["total"]["bytes"]
    for d in ("cpu", "cuda"):
        logits = ocria_rt.Engine(res["cuda"].out_dir, device=d).score(ids())
        assert np.all(np.isfinite(logits))


def kl_numpy(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    def log_softmax(z):
        z = z.astype(np.float64) - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=1)


def test_reference_kl_on_cuda():
    """Reference logits kept on the GPU (computed 256 rows at a time) agree with score()'s; the KL per row
    computed there is numpy's float64 KL of the kept logits and of the current weights' (read back with
    keep_reference), 0 for the same weights; references move between engines through the host."""
    t = qn.read_checkpoint(TEXT)
    eng = ocria_rt.Engine(TEXT, device="cuda")
    tokens = ids(300, seed=4)  # more rows than one 256-row block
    i = eng.keep_reference(tokens, 5, 299)
    ref = eng.reference_logits(i)
    assert ref.shape == (294, 512) and relerr(ref, eng.score(tokens)[5:299]) <= 1e-2
    np.testing.assert_array_equal(eng.reference_kl(i), np.zeros(294))
    eng.set_linear_weight("model.layers.1.mlp.down_proj", t["model.layers.1.mlp.down_proj.weight"].f32() * 0.9)
    kl = eng.reference_kl(i)
    now = eng.reference_logits(eng.keep_reference(tokens, 5, 299))
    np.testing.assert_allclose(kl, kl_numpy(ref, now), rtol=1e-5, atol=1e-9)
    assert kl.mean() > 1e-6
    other = ocria_rt.Engine(TEXT, device="cuda")
    j = other.keep_reference(tokens, 5, 299, logits=ref)
    np.testing.assert_array_equal(other.reference_logits(j), ref)
    np.testing.assert_array_equal(other.reference_kl(j), np.zeros(294))


def test_observer_second_moment_on_cuda_long():
    """The device statistics over many tokens (several prefill chunks, rows not a multiple of 16) are the
    CPU observer's (check_stats): the Kahan-summed accumulators lose nothing over 2,000 tokens."""
    tokens = ids(2003, seed=6)
    stats = {}
    for device in ("cpu", "cuda"):
        eng = ocria_rt.Engine(TEXT, device=device, linear_observer=True, prefill_chunk=512)
        eng.observe_linear_inputs(True, second_moment=True)
        eng.score(tokens)
        eng.observe_linear_inputs(False)
        stats[device] = eng.linear_input_stats()
    check_stats(stats["cpu"], stats["cuda"], 2003)
    for cuda in stats["cuda"]:
        np.testing.assert_allclose(np.diag(cuda["second_moment"]), cuda["square_mean"], rtol=1e-3)

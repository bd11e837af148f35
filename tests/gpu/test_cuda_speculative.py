"""Speculative decoding on CUDA end to end with the drafter fixtures (tests/fixtures/drafters; see
tests/test_speculative.py for the CPU's tests): greedy output against plain greedy decoding on the same
CUDA engine, with the drafter's own proposals and with every acceptance length forced through the
proposal hook; against the CPU's speculative output where the BF16 margins allow; the sampled tokens'
distribution against the CUDA target's own. Skipped without CUDA (tests/conftest.py).

The verify step runs the target on B tokens at once (gdn_verify is gdn_decode's bits, but the linears
and the attention of B tokens add in other orders than those of one token), so speculative and plain
greedy decoding on CUDA may part where the target's two best logits are within that rounding: a
divergence is accepted only there (check_same_or_near_tie).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES, chi2_pvalue
from test_speculative import DRAFTERS, ForcedHook, forced_run, target_dir, text_vocab
import reference_ops as ref

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
# Drafter -> target. dflash_sliding's own target (text_untied_dkdv, head_dim 16) is below the CUDA
# attention's smallest head, so it drafts for text_tied here (same hidden size, vocabulary and depth:
# its proposals are poor, which only makes rejections more frequent).
TARGETS = {
    "dflash_tied": target_dir("dflash_tied"),
    "dflash2_tied": target_dir("dflash2_tied"),
    "dflash2_tiny": target_dir("dflash2_tiny"),
    "dflash_vlm": target_dir("dflash_vlm"),
    "dflash_sliding": FIXTURES / "text_tied",
}
NAMES = list(TARGETS)


@lru_cache(maxsize=None)
def engine(name: str) -> ocria_rt.Engine:
    return ocria_rt.Engine(TARGETS[name], device=DEVICE, drafter=DRAFTERS / name)


@lru_cache(maxsize=None)
def cpu_engine(name: str) -> ocria_rt.Engine:
    return ocria_rt.Engine(TARGETS[name], device="cpu", drafter=DRAFTERS / name, num_threads=1)


def block_size(name: str) -> int:
    return int(engine(name).stats()["draft_block_size"])


def check_same_or_near_tie(name: str, prompt: list[int], got: list[int], want: list[int], **images) -> bool:
    """True where got (speculative) == want (plain greedy). Otherwise the first difference must be a
    near tie that BF16 rounding can flip. Decoding (score chunk=1) and verifying (stood in for by a
    B-token forward, score chunk=B with filler tokens after the sequence so that its last position sits
    in a chunk of a whole B rows as in a verify step) each lie within e_1 and e_B of the exact logits
    (the CPU's fp32); if they pick different tokens, the decode path's top-2 margin is at most
    2 (e_1 + e_B). score() runs the DeltaNet layers in their chunked form where a verify step runs
    gdn_verify on the states earlier steps committed, so the B-token forward alone can show no
    difference from decoding where a verify step has one."""
    if got == want:
        return True
    assert len(got) == len(want), f"{name}: {len(got)} tokens against {len(want)}"
    i = next(k for k in range(len(want)) if got[k] != want[k])
    eng, seq, B = engine(name), prompt + want[:i], block_size(name)
    exact = cpu_engine(name).score(seq, **images)[-1]
    one = eng.score(seq, chunk=1, **images)[-1]
    block = eng.score(seq + [0] * (-len(seq) % B), chunk=B, **images)[len(seq) - 1]
    top2 = np.sort(one)[-2:]
    margin = float(top2[1] - top2[0])
    e_one, e_block = float(np.abs(one - exact).max()), float(np.abs(block - exact).max())
    assert margin <= 2 * (e_one + e_block) + 1e-6, (
        f"{name}: speculative decoding parts from plain greedy at token {i} although the margin {margin:.3g} > "
        f"2 x ({e_one:.3g} + {e_block:.3g})")
    return False


def test_engine_takes_a_drafter_on_cuda():
    for name in NAMES:
        stats = engine(name).stats()
        assert stats["device"] == DEVICE and stats["draft_block_size"] == block_size(name) > 1
        assert stats["drafter_weight_bytes"] > 0 and stats["drafter_state_bytes"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_plain_decoding(name):
    """20 random prompts per drafter (100 in all): speculative greedy emits plain greedy's tokens (or
    parts at a near tie), and the acceptance lengths account for every token after the first."""
    eng, B = engine(name), block_size(name)
    rng = np.random.default_rng(len(name))
    for _ in range(20):
        prompt = rng.integers(0, text_vocab(name), int(rng.integers(1, 40))).tolist()
        n = int(rng.integers(2, 40))
        plain = eng.generate(prompt, n, stop_token_ids=[], speculative=False)
        spec = eng.generate(prompt, n, stop_token_ids=[])
        check_same_or_near_tie(name, prompt, spec.token_ids, plain.token_ids)
        assert sum(spec.acceptance_lengths) == n - 1 and all(1 <= a <= B for a in spec.acceptance_lengths)


@pytest.mark.parametrize("name", NAMES)
def test_every_acceptance_length(name):
    """Forced acceptance of 0 .. B-1 drafts, in both orders, so every rollback length of the DeltaNet
    states (gdn_commit), the conv states and the K/V rows runs on the device: plain greedy's tokens and
    the forced acceptance lengths."""
    eng, B = engine(name), block_size(name)
    prompt = np.random.default_rng(1).integers(0, text_vocab(name), 9).tolist()
    n = B * (B + 1) // 2 + 2
    greedy = eng.generate(prompt, n, stop_token_ids=[], speculative=False).token_ids
    for schedule in (list(range(B)), list(range(B - 1, -1, -1))):
        res, hook = forced_run(eng, prompt, greedy, schedule, n, [])
        if check_same_or_near_tie(name, prompt, res.token_ids, greedy):
            assert res.acceptance_lengths == hook.expected_lengths(n)
            assert set(res.acceptance_lengths[:B]) == set(range(1, B + 1))


@pytest.mark.parametrize("name", NAMES)
def test_matches_cpu_where_margin_allows(name):
    """The CUDA engine's speculative greedy tokens are the CPU's (whose speculative greedy is its plain
    greedy) up to a position where the CPU's top-2 margin is within twice the logit difference between
    the backends, as for plain decoding (tests/gpu/test_cuda_engine.py)."""
    prompt = np.random.default_rng(2).integers(0, text_vocab(name), 12).tolist()
    n = 48
    want = cpu_engine(name).generate(prompt, n, stop_token_ids=[]).token_ids
    got = engine(name).generate(prompt, n, stop_token_ids=[]).token_ids
    if got == want:
        return
    i = next(k for k in range(n) if got[k] != want[k])
    seq = prompt + want[:i]
    lc, lg = cpu_engine(name).score(seq)[-1], engine(name).score(seq)[-1]
    top2 = np.sort(lc)[-2:]
    margin, err = float(top2[1] - top2[0]), float(np.abs(lc - lg).max())
    assert margin <= 2 * err, f"{name}: tokens part from the CPU's at {i} although the margin {margin:.3g} > 2 x {err:.3g}"


def test_image_prompt():
    """A chat with an image (M-RoPE positions behind the sequence indices) through the verify steps:
    plain greedy's tokens with the drafter's proposals and with forced rollbacks of every length."""
    from ocria_rt.chat import build_multimodal_prompt

    name = "dflash_vlm"
    eng, B = engine(name), block_size(name)
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(FIXTURES / "images" / "vis_a.png")},
                                         {"type": "text", "text": "Read the page."}]}]
    ids, pv, grid = build_multimodal_prompt(eng, msgs)
    images = dict(pixel_values=pv, image_grid_thw=grid)
    n = B * (B + 1) // 2 + 2
    greedy = eng.generate(ids, n, stop_token_ids=[], speculative=False, **images).token_ids
    check_same_or_near_tie(name, ids, eng.generate(ids, n, stop_token_ids=[], **images).token_ids, greedy, **images)
    res, hook = forced_run(eng, ids, greedy, list(range(B)), n, [], **images)
    if check_same_or_near_tie(name, ids, res.token_ids, greedy, **images):
        assert res.acceptance_lengths == hook.expected_lengths(n)


@pytest.mark.parametrize("name,forced", [("dflash_tied", True), ("dflash2_tied", False)])
def test_sampling_is_lossless(name, forced):
    """Temperature 1, top-k 3: the joint distribution of the first three tokens over 600 seeds fits the
    CUDA target's own (from scoring every prefix on the decode path) by a chi-square test. DFlash with
    the target's likeliest tokens forced in (drafts accepted and rejected); DFlash2 with its own walk
    sampled on the device (q a softmax over its candidates)."""
    eng = engine(name)
    T, K, N = 1.0, 3, 600
    prompt = np.random.default_rng(3).integers(0, text_vocab(name), 6).tolist()

    def probs_after(seq):
        return ref.sampler_probs(eng.score(seq, chunk=1)[-1], T, K)

    probs = {(): probs_after(prompt)}
    for x1 in np.flatnonzero(probs[()]):
        probs[(x1,)] = probs_after(prompt + [int(x1)])
        for x2 in np.flatnonzero(probs[(x1,)]):
            probs[(x1, x2)] = probs_after(prompt + [int(x1), int(x2)])
    cells = [(a, b, c) for a in np.flatnonzero(probs[()]) for b in np.flatnonzero(probs[(a,)])
             for c in np.flatnonzero(probs[(a, b)])]
    exact = [probs[()][a] * probs[(a,)][b] * probs[(a, b)][c] for a, b, c in cells]
    likeliest = {tuple(int(t) for t in key): int(np.argmax(p)) for key, p in probs.items()}
    generated: list[int] = []

    def hook(position, proposals):  # the target's likeliest tokens along the drafted path
        prefix = tuple(generated[: position - len(prompt) + 1])
        out = []
        for _ in proposals:
            out.append(likeliest.get(prefix, 0))
            prefix += (out[-1],)
        return out

    index = {tuple(int(t) for t in c): i for i, c in enumerate(cells)}
    counts, accepted, outside = np.zeros(len(cells)), [], 0
    eng._core.set_proposal_hook(hook if forced else None)
    try:
        for seed in range(N):
            generated.clear()
            for tok in eng.stream(prompt, 3, temperature=T, top_k=K, seed=seed, stop_token_ids=[]):
                generated.append(tok)
            # The verify path's third-best logit may trade places with the fourth where the decode
            # path's two are within BF16 rounding: such draws are counted, and must be rare.
            if tuple(generated) in index:
                counts[index[tuple(generated)]] += 1
            else:
                outside += 1
            accepted += eng.acceptance_lengths
    finally:
        eng._core.set_proposal_hook(None)
    assert outside <= N // 100, f"{outside} draws outside the target's top-{K} support"
    assert chi2_pvalue(counts, exact) > 1e-3
    if forced:
        assert 2 in accepted and 1 in accepted


def test_engine_uses_the_model_directorys_drafter_by_default(tmp_path):
    """On CUDA as on the CPU, a model directory's own drafter/ is loaded unless drafter=False."""
    import shutil

    from support import TINY_VLM

    model = tmp_path / "tiny-vlm"
    shutil.copytree(TINY_VLM, model)
    shutil.copytree(DRAFTERS / "trained_tiny_vlm", model / "drafter")
    eng = ocria_rt.Engine(model, device=DEVICE)
    assert eng.drafter_dir == model / "drafter" and eng.stats()["draft_block_size"] > 1
    res = eng.generate([1, 2, 3, 4, 5], 20, stop_token_ids=[])
    assert res.acceptance_lengths and sum(res.acceptance_lengths) == 19
    off = ocria_rt.Engine(model, device=DEVICE, drafter=False)
    assert off.drafter_dir is None and off.generate([1, 2, 3, 4, 5], 20, stop_token_ids=[]).acceptance_lengths == []

"""The speculative step as device-driven work (positions, anchor and step index advanced on the device
by speculative_advance, the tokens read back through the mailbox): the same generations as the
host-driven loop it replaced (recorded by tests/fixtures/make_speculative_outputs.py), the
benchmark-only forced acceptance, and the ops it added, on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import ocria_rt
from ocria_rt import _core
from support import FIXTURES

sys.path.insert(0, str(FIXTURES))
from make_speculative_outputs import run  # noqa: E402
from test_speculative import DRAFTERS, block_size, engine, target_dir, text_vocab  # noqa: E402

RECORDED = json.loads((DRAFTERS / "speculative_outputs.json").read_text())


def test_same_generations_as_the_host_driven_loop():
    """105 generations over the five drafters, greedy and at three sampler settings, with the drafter's
    own proposals and with the target's greedy continuation forced in (long blocks accepted, and
    rejected at temperature > 0): the tokens and acceptance lengths are those recorded from the loop
    that copied positions and anchors from the host and read the results back after each step."""
    assert len(RECORDED) == 105 and max(a for c in RECORDED for a in c["acceptance_lengths"]) == 16
    for case in RECORDED:
        tokens, lengths = run(case)
        assert tokens == case["token_ids"], case
        assert lengths == case["acceptance_lengths"], case


@pytest.mark.parametrize("name", ["dflash_sliding", "dflash2_tied"])
def test_forced_acceptance(name):
    """benchmark_forced_acceptance = tau: every step emits tau tokens, the drafter's first tau - 1
    proposals (Engine.draft over the sequence so far) and then the target's greedy token after them
    (Engine.score); tau = 1 is plain greedy decoding."""
    B = block_size(name)
    prompt = np.random.default_rng(5).integers(0, text_vocab(name), 7).tolist()
    n = 2 * B + 3
    greedy = engine(name).generate(prompt, n, stop_token_ids=[], speculative=False).token_ids
    for tau in (1, 2, B - 1, B):
        eng = ocria_rt.Engine(target_dir(name), drafter=DRAFTERS / name, num_threads=1, benchmark_forced_acceptance=tau)
        res = eng.generate(prompt, n, stop_token_ids=[])
        steps = (n - 1 + tau - 1) // tau
        assert res.acceptance_lengths == [tau] * (steps - 1) + [n - 1 - tau * (steps - 1)], tau
        if tau == 1:
            assert res.token_ids == greedy
        out = res.token_ids
        assert out[0] == greedy[0]
        for j in range(0, n - 1, tau):  # out[j] is the anchor of a step
            context = prompt + out[:j]
            drafts = eng.draft(context)[: tau - 1]
            bonus = int(eng.score(context + [out[j]] + drafts)[-1].argmax())
            assert out[j + 1 : j + 1 + tau] == (drafts + [bonus])[: n - 1 - j], (tau, j)
        # sampling: still tau tokens per step
        res = eng.generate(prompt, n, temperature=0.8, seed=3, stop_token_ids=[])
        assert res.acceptance_lengths[:-1] == [tau] * (len(res.acceptance_lengths) - 1)
        assert all(0 <= t < eng.vocab_size for t in res.token_ids)


def test_forced_acceptance_and_timing_options_checked():
    with pytest.raises(ocria_rt.errors.InvalidArgumentError, match="benchmark_forced_acceptance must be in 0 .. the drafter's block size \\(8\\)"):
        ocria_rt.Engine(target_dir("dflash_tied"), drafter=DRAFTERS / "dflash_tied", benchmark_forced_acceptance=9)
    with pytest.raises(ocria_rt.errors.InvalidArgumentError, match="need a drafter"):
        ocria_rt.Engine(target_dir("dflash_tied"), benchmark_forced_acceptance=2)
    with pytest.raises(ocria_rt.errors.InvalidArgumentError, match="need a drafter"):
        ocria_rt.Engine(target_dir("dflash_tied"), benchmark_phase_timing=True)


def test_phase_timing():
    """benchmark_phase_timing: every step's draft, verify and commit are timed (host clock on the CPU,
    where ops run as they are issued); the tokens are those of an engine without it."""
    name = "dflash2_tied"
    prompt = [3, 1, 4, 1, 5]
    eng = ocria_rt.Engine(target_dir(name), drafter=DRAFTERS / name, num_threads=1, benchmark_phase_timing=True)
    res = eng.generate(prompt, 20, stop_token_ids=[])
    assert res.token_ids == engine(name).generate(prompt, 20, stop_token_ids=[]).token_ids
    s = eng.stats()
    assert s["timed_speculative_steps"] == len(res.acceptance_lengths) > 0
    for phase in ("draft", "verify", "commit"):
        assert s[f"speculative_{phase}_seconds"] > 0, phase
    assert s["launches_per_speculative_step"] == 0 and s["kernels_per_speculative_step"] == 0  # no graphs on the CPU


def test_speculative_advance_op():
    """The bookkeeping op against its definition: positions and rotary positions advance by the count,
    the last emitted token becomes the anchor of both block id buffers, the step index advances."""
    cpu = _core.OpRunner("cpu")
    rng = np.random.default_rng(0)
    B = 6
    for count in range(1, B + 1):
        tokens = rng.integers(0, 1000, B).astype(np.int32)
        positions = np.arange(40, 40 + B, dtype=np.int32)
        rope = (positions[:, None] - np.array([3, 5, 7], np.int32)).astype(np.int32)
        draft_ids, verify_ids = rng.integers(0, 1000, (2, B)).astype(np.int32)
        got = cpu.speculative_advance(count, tokens, positions, rope, draft_ids, verify_ids, 11)
        want_draft, want_verify = draft_ids.copy(), verify_ids.copy()
        want_draft[0] = want_verify[0] = tokens[count - 1]
        for g, w in zip(got, (positions + count, rope + count, want_draft, want_verify, 12)):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ocria_rt.errors.InternalError, match="speculative_advance: count 0"):
        cpu.speculative_advance(0, tokens, positions, rope, draft_ids, verify_ids, 0)


def test_vector_posts():
    """post_i32 of a vector tagged like a speculative step's (count + tokens): each tag's own values
    come back, whole; more values than a post holds is an error."""
    from support import check_vector_posts

    check_vector_posts(_core.OpRunner("cpu"))


@pytest.mark.parametrize("name", ["dflash2_tiny", "dflash_vlm"])
def test_whole_blocks_at_the_context_limit(name):
    """Forced acceptance of whole blocks with prompt + max_new_tokens = max_context: the last step writes
    cache rows past the context limit (into the spare rows), and the next generation on the same
    engine is a fresh engine's."""
    B = block_size(name)
    prompt = np.random.default_rng(8).integers(0, text_vocab(name), 6).tolist()
    n = 2 * B + 3
    options = dict(drafter=DRAFTERS / name, num_threads=1, max_context=len(prompt) + n, benchmark_forced_acceptance=B)
    eng = ocria_rt.Engine(target_dir(name), **options)
    first = eng.generate(prompt, n, stop_token_ids=[]).token_ids
    assert eng.generate(prompt, n, stop_token_ids=[]).token_ids == first
    assert ocria_rt.Engine(target_dir(name), **options).generate(prompt, n, stop_token_ids=[]).token_ids == first

"""Prefill, chunked prefill and token-by-token decode compute the same function."""

from __future__ import annotations

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES, MODEL_FIXTURES, load_reference, relerr


@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_token_by_token_equals_full_score(name):
    ref = load_reference(name)
    eng = ocria_rt.Engine(FIXTURES / name)
    full = eng.score(ref["input_ids"])
    stepped = eng.score(ref["input_ids"], chunk=1)  # recurrent DeltaNet, one token per forward
    assert relerr(stepped, full) <= 1e-4


def test_prefill_chunks_carry_state():
    ref = load_reference("text_tied")
    eng = ocria_rt.Engine(FIXTURES / "text_tied", prefill_chunk=48)  # 150 tokens: 48 + 48 + 48 + 6
    small = eng.score(ref["long_ids"])
    odd = eng.score(ref["long_ids"], chunk=7)
    one = ocria_rt.Engine(FIXTURES / "text_tied").score(ref["long_ids"])
    assert relerr(small, one) <= 1e-4
    assert relerr(odd, one) <= 1e-4


def test_generate_equals_argmax_of_score():
    ref = load_reference("text_untied_dkdv")
    eng = ocria_rt.Engine(FIXTURES / "text_untied_dkdv")
    prompt = list(ref["greedy_prompt"])
    res = eng.generate(prompt, max_new_tokens=20, stop_token_ids=[])
    logits = eng.score(prompt + res.token_ids[:-1])
    np.testing.assert_array_equal(logits[len(prompt) - 1 :].argmax(-1), res.token_ids)


def test_generations_do_not_leak_state():
    ref = load_reference("text_tied")
    eng = ocria_rt.Engine(FIXTURES / "text_tied")
    a1 = eng.generate(ref["greedy_prompt"], max_new_tokens=30, stop_token_ids=[]).token_ids
    b = eng.generate(ref["long_ids"][:100], max_new_tokens=10, stop_token_ids=[]).token_ids
    eng.score(ref["input_ids"][:5])
    a2 = eng.generate(ref["greedy_prompt"], max_new_tokens=30, stop_token_ids=[]).token_ids
    fresh_b = ocria_rt.Engine(FIXTURES / "text_tied").generate(ref["long_ids"][:100], max_new_tokens=10, stop_token_ids=[])
    assert a1 == a2
    assert b == fresh_b.token_ids


def test_stream_equals_generate():
    ref = load_reference("text_tied")
    eng = ocria_rt.Engine(FIXTURES / "text_tied")
    kwargs = dict(max_new_tokens=25, temperature=0.8, top_k=50, top_p=0.9, seed=7, stop_token_ids=[])
    streamed = list(eng.stream(ref["greedy_prompt"], **kwargs))
    assert streamed == eng.generate(ref["greedy_prompt"], **kwargs).token_ids
    assert len(streamed) == 25


def test_stop_tokens_end_generation():
    ref = load_reference("text_tied")
    eng = ocria_rt.Engine(FIXTURES / "text_tied")
    full = eng.generate(ref["greedy_prompt"], max_new_tokens=64, stop_token_ids=[]).token_ids
    stop = full[10]
    res = eng.generate(ref["greedy_prompt"], max_new_tokens=64, stop_token_ids=[stop])
    first = full.index(stop)
    assert res.finish_reason == "stop"
    assert res.token_ids == full[: first + 1]

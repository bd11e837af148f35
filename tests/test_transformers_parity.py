"""The CPU backend against transformers' fp32 outputs (fixtures made by tests/fixtures/make_fixtures.py)."""

from __future__ import annotations

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES, MODEL_FIXTURES, TINY_RANDOM, load_reference, relerr

LOGIT_TOL = 1e-4


@pytest.fixture(scope="module", params=MODEL_FIXTURES)
def model(request):
    return request.param, ocria_rt.Engine(FIXTURES / request.param), load_reference(request.param)


def test_score_matches_transformers(model):
    name, eng, ref = model
    logits = eng.score(ref["input_ids"])
    assert logits.shape == ref["logits"].shape and logits.dtype == np.float32
    err = relerr(logits, ref["logits"])
    assert err <= LOGIT_TOL, f"{name}: relative logit error {err:.3g}"
    # every position, not just on average
    for t in range(len(ref["input_ids"])):
        assert relerr(logits[t], ref["logits"][t]) <= LOGIT_TOL, f"{name}: position {t}"


def test_long_prompt_crosses_gdn_chunks():
    ref = load_reference("text_tied")
    eng = ocria_rt.Engine(FIXTURES / "text_tied")
    assert len(ref["long_ids"]) > 2 * 64
    err = relerr(eng.score(ref["long_ids"]), ref["long_logits"])
    assert err <= LOGIT_TOL, f"relative logit error {err:.3g} over {len(ref['long_ids'])} tokens"


def test_greedy_generate_matches_transformers(model):
    name, eng, ref = model
    res = eng.generate(ref["greedy_prompt"], max_new_tokens=64, stop_token_ids=[])
    assert res.finish_reason == "length"
    np.testing.assert_array_equal(np.array(res.token_ids), ref["greedy_tokens"], err_msg=name)


def test_packaged_tiny_random_matches_transformers():
    ref = load_reference("tiny-random")
    eng = ocria_rt.Engine(TINY_RANDOM)
    assert relerr(eng.score(ref["input_ids"]), ref["logits"]) <= LOGIT_TOL
    res = eng.generate(ref["greedy_prompt"], max_new_tokens=len(ref["greedy_tokens"]), stop_token_ids=[])
    np.testing.assert_array_equal(np.array(res.token_ids), ref["greedy_tokens"])

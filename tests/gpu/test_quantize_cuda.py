"""The calibration hooks (projection-input observer, in-memory weight replacement) and ocria_rt.quantize on
the CUDA backend, against the CPU (run on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import numpy as np

import ocria_rt
import quant_numpy as qn
from support import FIXTURES, relerr

TEXT = FIXTURES / "text_tied"


def ids(n=40, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def test_observer_matches_cpu():
    """The statistics of every projection's input agree with the CPU's within BF16 activations; observing
    leaves the scores as they are."""
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
    for cpu, cuda in zip(stats["cpu"], stats["cuda"]):
        assert cpu["tokens"] == cuda["tokens"] == 48
        for key in ("abs_max", "abs_mean", "square_mean", "second_moment"):
            assert relerr(cuda[key], cpu[key]) <= 3e-2, key


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

"""bench/torch_peer.py's fused path on the GPU (fla kernels, torch flash attention, the decode step in
one CUDA graph) against ocria_rt's CPU engine: the peer bench/decode.py reports must compute this model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fla")
pytest.importorskip("safetensors")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device", allow_module_level=True)

import ocria_rt  # noqa: E402

from support import FIXTURES, MODEL_FIXTURES, relerr  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from torch_peer import TorchPeer  # noqa: E402

STEPS = 48


@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_graph_peer_matches_cpu_engine(name):
    """Over a 300-token prompt (flash attention's split-KV over the used part of a 512-row cache):
    teacher-forced BF16 logits as close to the fp32 engine as the pure-torch peer's in BF16, graph
    replays giving the eager fused steps' tokens, and greedy tokens the engine's until a step whose
    margin is within twice the logit error."""
    cpu = ocria_rt.Engine(FIXTURES / name)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, cpu.vocab_size, 300)]
    cont = cpu.generate(prompt, max_new_tokens=STEPS, stop_token_ids=[]).token_ids
    want = cpu.score(prompt + cont[:-1])[len(prompt) - 1:]

    def peer(**kw):
        return TorchPeer(FIXTURES / name, device="cuda", dtype=torch.bfloat16, max_context=512, max_new_tokens=64, **kw)

    graph = peer()
    assert graph.kernels.name == "fla + flash attention" and graph.use_graph
    got = graph.teacher_forced_logits(prompt, cont).numpy()
    assert graph.graph is not None
    yard = peer(fused=False).teacher_forced_logits(prompt, cont).numpy()
    errs = np.array([relerr(g, w) for g, w in zip(got, want)])
    yard_errs = np.array([relerr(g, w) for g, w in zip(yard, want)])
    assert np.all(np.isfinite(errs))
    assert errs.mean() <= 1.25 * yard_errs.mean() + 5e-3, (errs.mean(), yard_errs.mean())

    tokens, seconds = graph.generate(prompt, STEPS)
    assert seconds > 0 and tokens == peer(cuda_graph=False).generate(prompt, STEPS)[0]
    if tokens != cont:
        i = next(k for k in range(STEPS) if tokens[k] != cont[k])
        top2 = np.sort(want[i])[-2:]
        err = float(np.abs(got[i] - want[i]).max())
        assert top2[1] - top2[0] <= 2 * err, f"step {i}: margin {top2[1] - top2[0]:.3g} > 2 x error {err:.3g}"

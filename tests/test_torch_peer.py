"""bench/torch_peer.py, the graph-captured torch decoder bench/decode.py measures ours against: its math
(the pure-torch path, fp32 on the CPU) against ocria_rt's CPU engine on the fixtures. The fused CUDA
path (fla kernels, flash attention, the CUDA graph) is checked in tests/gpu/test_torch_peer_cuda.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import ocria_rt  # noqa: E402

from support import FIXTURES, MODEL_FIXTURES, load_reference, relerr  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from torch_peer import TorchPeer  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The peer's CPU path is many tiny ops: one thread is several times faster than two, busy ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prompt_of(name: str, length: int, vocab: int) -> list[int]:
    """The fixture's greedy prompt, extended with seeded ids to `length` tokens (conv windows and
    attention over more than a few positions)."""
    prompt = [int(t) for t in load_reference(name)["greedy_prompt"]]
    extra = np.random.default_rng(7).integers(0, vocab, max(0, length - len(prompt)))
    return prompt + [int(t) for t in extra]


@pytest.mark.parametrize("name", MODEL_FIXTURES)
def test_peer_matches_cpu_engine(name):
    """Teacher-forced logits (the prefill's last row, then one decode step per token) equal the
    engine's within fp32 rounding, and free-running greedy decoding gives the engine's tokens."""
    eng = ocria_rt.Engine(FIXTURES / name, num_threads=1)
    prompt = prompt_of(name, 40, eng.vocab_size)
    cont = eng.generate(prompt, max_new_tokens=24, stop_token_ids=[]).token_ids
    want = eng.score(prompt + cont[:-1])[len(prompt) - 1:]
    peer = TorchPeer(FIXTURES / name, device="cpu", dtype=torch.float32, max_context=128, max_new_tokens=32)
    assert not peer.use_graph and peer.kernels.name == "torch"
    got = peer.teacher_forced_logits(prompt, cont).numpy()
    assert got.shape == want.shape
    errs = [relerr(g, w) for g, w in zip(got, want)]
    assert max(errs) < 1e-4, errs
    tokens, seconds = peer.generate(prompt, 24)
    assert tokens == cont and seconds > 0
    # a second sequence on the same buffers starts from scratch
    assert peer.generate(prompt[:20], 8)[0] == eng.generate(prompt[:20], max_new_tokens=8, stop_token_ids=[]).token_ids


def test_peer_refuses_what_does_not_fit(tmp_path):
    peer = TorchPeer(FIXTURES / "text_tied", device="cpu", dtype=torch.float32, max_context=32, max_new_tokens=8)
    with pytest.raises(ocria_rt.InvalidArgumentError):
        peer.generate(list(range(30)), 8)  # 30 + 8 positions > 32
    with pytest.raises(ocria_rt.InvalidArgumentError):
        peer.generate([1, 2, 3], 10)  # more tokens than the output buffer
    with pytest.raises(ocria_rt.InvalidArgumentError, match="CUDA"):
        TorchPeer(FIXTURES / "text_tied", device="cpu", fused=True)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ocria_rt.ModelError, match="llama"):
        TorchPeer(bad, device="cpu")

"""The speculative step on CUDA as device-driven work, replayed as one captured graph per step with the
host a step ahead (run on the GPU machine; skipped elsewhere): the mailbox's vector posts and
speculative_advance against the CPU, then whole generations with the fixture drafters whose shapes
the CUDA kernels run: the graph-replayed step gives the tokens of the op-by-op one and of plain
greedy decoding, one launch per step and its kernels counted, the proposal hook, stop tokens, the
context limit and forced acceptance behaving as on the CPU.

The engine tests need the CUDA kernels of the speculative ops (gdn_verify, gdn_commit, the drafter's
ops, speculative_accept); where this build lacks them they are skipped with that reason."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

import ocria_rt
from ocria_rt import _core
from support import FIXTURES, PACKAGE_MODELS, check_vector_posts
from test_speculative import text_vocab

pytestmark = pytest.mark.gpu

DRAFTERS = FIXTURES / "drafters"
# (drafter, target): the fixtures with heads the CUDA kernels take (32 wide); blocks of 16 and of 5
PAIRS = [("dflash2_tiny", "tiny-random"), ("dflash_vlm", "tiny-vlm")]
MISSING_KERNELS = "not yet implemented on"  # the message of an op (or engine) without CUDA kernels


def test_vector_posts():
    check_vector_posts(_core.OpRunner("cuda"))


def test_speculative_advance_matches_cpu():
    cpu, gpu = _core.OpRunner("cpu"), _core.OpRunner("cuda")
    rng = np.random.default_rng(1)
    for B in (5, 16):
        for count in (1, 2, B - 1, B):
            tokens = rng.integers(0, 1 << 20, B).astype(np.int32)
            positions = np.arange(100, 100 + B, dtype=np.int32)
            rope = (positions[:, None] - rng.integers(0, 50, 3)).astype(np.int32)
            draft_ids, verify_ids = rng.integers(0, 1 << 20, (2, B)).astype(np.int32)
            args = (count, tokens, positions, rope, draft_ids, verify_ids, 7)
            for want, got in zip(cpu.speculative_advance(*args), gpu.speculative_advance(*args)):
                np.testing.assert_array_equal(got, want)


@lru_cache(maxsize=None)
def cuda_engine(drafter: str, target: str, **options) -> ocria_rt.Engine:
    try:
        eng = ocria_rt.Engine(PACKAGE_MODELS / target, device="cuda", drafter=DRAFTERS / drafter, **options)
        eng.generate([1, 2, 3], 3, stop_token_ids=[])
    except ocria_rt.OcriaError as e:
        if MISSING_KERNELS in str(e):
            pytest.skip(f"this build has no CUDA kernels for speculative decoding: {e}")
        raise
    return eng


def prompts(drafter: str, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, text_vocab(drafter), int(rng.integers(4, 40))).tolist() for _ in range(count)]


def assert_greedy_or_close(eng, prompt: list[int], got: list[int], want: list[int]) -> None:
    """got == want, or they part where want's step had a top-2 margin within twice the logit difference
    between two of the engine's own BF16 paths (decode token by token, prefill), which is where the
    verify's 16-row products, rounded otherwise than decode's single rows, may pick the other token."""
    if got == want:
        return
    i = next(k for k in range(len(want)) if got[k] != want[k])
    seq = prompt + want[:i]
    decode, prefill = eng.score(seq, chunk=1)[-1], eng.score(seq)[-1]
    top2 = np.sort(decode)[-2:]
    margin, noise = float(top2[1] - top2[0]), float(np.abs(decode - prefill).max())
    assert margin <= 2 * noise, f"tokens part at {i} although the margin {margin:.3g} > 2 x {noise:.3g}"


@pytest.mark.parametrize("drafter,target", PAIRS)
def test_graph_step_equals_eager_step_and_plain_greedy(drafter, target):
    graph = cuda_engine(drafter, target)
    eager = cuda_engine(drafter, target, cuda_graphs=False)
    for prompt in prompts(drafter, 4, seed=2):
        n = 48
        g = graph.generate(prompt, n, stop_token_ids=[])
        e = eager.generate(prompt, n, stop_token_ids=[])
        assert g.token_ids == e.token_ids and g.acceptance_lengths == e.acceptance_lengths
        assert sum(g.acceptance_lengths) == n - 1
        plain = graph.generate(prompt, n, stop_token_ids=[], speculative=False).token_ids
        assert_greedy_or_close(graph, prompt, g.token_ids, plain)
        for seed in range(3):  # the same draws, replayed or op by op
            kw = dict(temperature=0.8, top_k=50, seed=seed, stop_token_ids=[])
            g, e = graph.generate(prompt, n, **kw), eager.generate(prompt, n, **kw)
            assert g.token_ids == e.token_ids and g.acceptance_lengths == e.acceptance_lengths
    s = graph.stats()
    assert s["launches_per_speculative_step"] == 1 and s["kernels_per_speculative_step"] > 20
    assert s["launches_per_decode_step"] == 1  # the decode graph kept beside the speculative one
    assert eager.stats()["launches_per_speculative_step"] == 0


@pytest.mark.parametrize("drafter,target", PAIRS)
def test_phase_graphs_hold_the_step(drafter, target):
    """benchmark_phase_timing: the step as three graphs with events between them holds the kernels of
    the one-graph step; every step is timed, and the tokens are the same."""
    graph = cuda_engine(drafter, target)
    timed = cuda_engine(drafter, target, benchmark_phase_timing=True)
    prompt = prompts(drafter, 1, seed=3)[0]
    res = timed.generate(prompt, 30, stop_token_ids=[])
    assert res.token_ids == graph.generate(prompt, 30, stop_token_ids=[]).token_ids
    s, one = timed.stats(), graph.stats()
    assert s["launches_per_speculative_step"] == 3
    assert s["kernels_per_speculative_step"] == one["kernels_per_speculative_step"] > 0
    assert s["timed_speculative_steps"] == len(res.acceptance_lengths)
    assert all(s[f"speculative_{p}_seconds"] > 0 for p in ("draft", "verify", "commit"))


@pytest.mark.parametrize("drafter,target", PAIRS)
def test_proposal_hook_steps_op_by_op(drafter, target):
    """With a hook the steps run op by op, the host waiting for each: the hook sees every step's anchor
    position once, in order; returning the proposals unchanged keeps the tokens (greedy)."""
    eng = cuda_engine(drafter, target)
    prompt = prompts(drafter, 1, seed=4)[0]
    want = eng.generate(prompt, 40, stop_token_ids=[])
    seen: list[int] = []

    def hook(position, proposals):
        seen.append(position)
        return proposals

    eng._core.set_proposal_hook(hook)
    try:
        got = eng.generate(prompt, 40, stop_token_ids=[])
    finally:
        eng._core.set_proposal_hook(None)
    assert got.token_ids == want.token_ids and got.acceptance_lengths == want.acceptance_lengths
    ends = np.cumsum([0] + got.acceptance_lengths[:-1])
    assert seen == [len(prompt) + int(j) for j in ends]


@pytest.mark.parametrize("drafter,target", PAIRS)
def test_stops_and_context_limit_with_steps_ahead(drafter, target):
    """Forced acceptance of whole blocks at the context limit (prompt + max_new_tokens = max_context):
    steps issued ahead run past the last token, into the caches' spare rows. Every generation equals a
    fresh engine's; a stop token inside a block ends the generation right there, and stream() yields
    the same tokens."""
    B = int(cuda_engine(drafter, target).stats()["draft_block_size"])
    prompt = prompts(drafter, 1, seed=5)[0]
    n = 3 * B + 2
    options = dict(max_context=len(prompt) + n, benchmark_forced_acceptance=B)
    eng = cuda_engine(drafter, target, **options)
    first = eng.generate(prompt, n, stop_token_ids=[])
    assert first.acceptance_lengths[:-1] == [B] * (len(first.acceptance_lengths) - 1)
    fresh = ocria_rt.Engine(PACKAGE_MODELS / target, device="cuda", drafter=DRAFTERS / drafter, **options)
    assert fresh.generate(prompt, n, stop_token_ids=[]).token_ids == first.token_ids
    tokens = first.token_ids
    inside = [k for k in range(2, n) if (k - 1) % B not in (0, B - 1) and tokens[k] not in tokens[:k]]
    if inside:
        k = inside[0]
        stopped = eng.generate(prompt, n, stop_token_ids=[tokens[k]])
        assert stopped.token_ids == tokens[: k + 1] and stopped.finish_reason == "stop"
    for cut in (1, 2, B, B + 1):  # max_new_tokens ending at every place in a block
        assert eng.generate(prompt, cut, stop_token_ids=[]).token_ids == tokens[:cut]
    assert list(eng.stream(prompt, n, stop_token_ids=[])) == tokens
    assert eng.generate(prompt, n, stop_token_ids=[]).token_ids == tokens


@pytest.mark.parametrize("drafter,target", PAIRS)
def test_forced_acceptance_on_the_device(drafter, target):
    """benchmark_forced_acceptance inside the captured step: tau tokens per step, replayed or op by op."""
    B = int(cuda_engine(drafter, target).stats()["draft_block_size"])
    prompt = prompts(drafter, 1, seed=6)[0]
    for tau in sorted({1, 2, B}):
        graph = cuda_engine(drafter, target, benchmark_forced_acceptance=tau)
        eager = cuda_engine(drafter, target, benchmark_forced_acceptance=tau, cuda_graphs=False)
        for kw in (dict(), dict(temperature=0.8, seed=1)):
            g = graph.generate(prompt, 37, stop_token_ids=[], **kw)
            assert g.acceptance_lengths[:-1] == [tau] * (len(g.acceptance_lengths) - 1)
            assert g.token_ids == eager.generate(prompt, 37, stop_token_ids=[], **kw).token_ids
        assert graph.stats()["launches_per_speculative_step"] == 1

"""Speculative decoding on the CPU with DFlash / DFlash2 drafters (tests/fixtures/drafters, made with
z-lab's dflash package by make_drafter_fixtures.py): proposals against z-lab's, greedy outputs against
plain decoding, every rollback length forced through a proposal hook, a cache-free oracle of the
loop, the sampled tokens' distribution against the target's exact one, and bad drafters."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from functools import lru_cache

import numpy as np
import pytest

import ocria_rt
import reference_ops as ref
from ocria_rt import cli
from support import FIXTURES, PACKAGE_MODELS, chi2_pvalue

DRAFTERS = FIXTURES / "drafters"
REF = dict(np.load(DRAFTERS / "reference.npz"))
NAMES = ["dflash_tied", "dflash_sliding", "dflash2_tied", "dflash2_tiny", "dflash_vlm"]


def target_dir(name: str):
    path = str(REF[f"{name}/target"])  # relative to the repository, as the fixture script ran
    base = path.rsplit("/", 1)[1]
    return PACKAGE_MODELS / base if path.startswith("python/ocria_rt/models/") else FIXTURES / base


@lru_cache(maxsize=None)
def engine(name: str) -> ocria_rt.Engine:
    return ocria_rt.Engine(target_dir(name), drafter=DRAFTERS / name, num_threads=1)


def text_vocab(name: str) -> int:
    """Token ids below this are text (a VLM's vision tokens come last)."""
    cfg = json.loads((target_dir(name) / "config.json").read_text())
    vision = [cfg[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in cfg]
    return min([engine(name).vocab_size] + vision)


def block_size(name: str) -> int:
    return int(engine(name).stats()["draft_block_size"])


def reference_prompts(name: str) -> list[list[int]]:
    out, offset = [], 0
    for n in REF[f"{name}/prompt_lengths"]:
        out.append(REF[f"{name}/prompts"][offset : offset + n].tolist())
        offset += n
    return out


@pytest.mark.parametrize("name", NAMES)
def test_proposals_match_zlab(name):
    """Engine.draft: the B - 1 tokens z-lab's modules propose after the target's greedy first token, with
    the prompt's taps as context (taps of the last layer final-normed, the mask token's embedding,
    per-layer causality and windows, the embedding scale, the multiplier and softcap in DFlash2's walk)."""
    eng = engine(name)
    for i, prompt in enumerate(reference_prompts(name)):
        assert eng.generate(prompt, 1, speculative=False).token_ids == [REF[f"{name}/anchors"][i]]
        assert eng.draft(prompt) == REF[f"{name}/proposals"][i].tolist(), f"prompt {i}"


def test_greedy_equals_plain_decoding():
    """100 random prompts over the five drafters: speculative greedy emits exactly the tokens of plain
    greedy decoding, and the acceptance lengths account for every token after the first."""
    rng = np.random.default_rng(0)
    for name in NAMES:
        eng, B = engine(name), block_size(name)
        for _ in range(20):
            prompt = rng.integers(0, text_vocab(name), int(rng.integers(1, 30))).tolist()
            n = int(rng.integers(2, 9))
            plain = eng.generate(prompt, n, stop_token_ids=[], speculative=False)
            spec = eng.generate(prompt, n, stop_token_ids=[])
            assert spec.token_ids == plain.token_ids, (name, prompt)
            assert plain.acceptance_lengths == []
            assert sum(spec.acceptance_lengths) == n - 1 and all(1 <= a <= B for a in spec.acceptance_lengths)


class ForcedHook:
    """Replaces each step's proposals so that exactly schedule[step] of them match the greedy sequence
    `greedy` (the rest mismatch), recording the drafter's own proposals per step."""

    def __init__(self, greedy: list[int], prompt_len: int, schedule: list[int], vocab: int):
        self.greedy, self.prompt_len, self.schedule, self.vocab = greedy, prompt_len, schedule, vocab
        self.steps: list[tuple[int, list[int], list[int]]] = []  # (anchor index in greedy, drafted, forced)

    def __call__(self, position: int, proposals: list[int]) -> list[int]:
        j = position - self.prompt_len
        m = self.schedule[len(self.steps) % len(self.schedule)]
        forced = []
        for i in range(len(proposals)):
            truth = self.greedy[j + 1 + i] if j + 1 + i < len(self.greedy) else 0
            forced.append(truth if i < m else (truth + 1) % self.vocab)
        self.steps.append((j, list(proposals), forced))
        return forced

    def expected_lengths(self, n: int) -> list[int]:
        """Tokens each step contributes to a generation of n tokens."""
        out, j = [], 0
        while j + 1 < n:
            m = self.schedule[len(out) % len(self.schedule)]
            out.append(min(m + 1, n - 1 - j))
            j += m + 1
        return out


def forced_run(eng, prompt, greedy, schedule, max_new, stops, **images):
    hook = ForcedHook(greedy, len(prompt), schedule, eng.vocab_size)
    eng._core.set_proposal_hook(hook)
    try:
        res = eng.generate(prompt, max_new, stop_token_ids=stops, **images)
    finally:
        eng._core.set_proposal_hook(None)
    return res, hook


@pytest.mark.parametrize("name", NAMES)
def test_every_rollback_length(name):
    """Forced acceptance of 0 .. B-1 drafts (so every rollback length of the DeltaNet states, the conv
    states and the K/V rows runs), in two orders: the output is plain greedy's, the acceptance lengths
    the forced ones. Then with a stop token inside an accepted block: the generation stops right there."""
    eng, B = engine(name), block_size(name)
    prompt = np.random.default_rng(1).integers(0, text_vocab(name), 9).tolist()
    n = B * (B + 1) // 2 + 2  # each schedule runs every acceptance length once
    greedy = eng.generate(prompt, n, stop_token_ids=[], speculative=False).token_ids
    for schedule in (list(range(B)), list(range(B - 1, -1, -1))):
        res, hook = forced_run(eng, prompt, greedy, schedule, n, [])
        assert res.token_ids == greedy
        assert res.acceptance_lengths == hook.expected_lengths(n)
        assert res.finish_reason == "length"
    # a stop token strictly inside a block of B - 1 accepted drafts, at its first occurrence in greedy
    schedule = [B - 1]
    inside = [k for k in range(2, n) if (k - 1) % B not in (0, B - 1) and greedy[k] not in greedy[:k]]
    assert inside, "no token of the greedy sequence lies inside a block at its first occurrence"
    k = inside[0]
    res, hook = forced_run(eng, prompt, greedy, schedule, n, [greedy[k]])
    assert res.token_ids == greedy[: k + 1] and res.finish_reason == "stop"
    assert res.acceptance_lengths == hook.expected_lengths(k + 1)
    # stream() runs the same loop
    hook = ForcedHook(greedy, len(prompt), [B - 1, 0, 2], eng.vocab_size)
    eng._core.set_proposal_hook(hook)
    try:
        assert list(eng.stream(prompt, n, stop_token_ids=[])) == greedy
    finally:
        eng._core.set_proposal_hook(None)
    assert eng.acceptance_lengths == hook.expected_lengths(n)


def test_image_prompt():
    """A chat with an image, whose tokens' rotary positions (M-RoPE) run behind their sequence indices:
    the verified blocks take the target's rotary positions and the drafter the sequence indices; the
    output equals plain greedy decoding with the drafter's own proposals and with forced rollbacks of
    every length."""
    from ocria_rt.chat import build_multimodal_prompt

    eng, B = engine("dflash_vlm"), block_size("dflash_vlm")
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(FIXTURES / "images" / "vis_a.png")},
                                         {"type": "text", "text": "Read the page."}]}]
    ids, pv, grid = build_multimodal_prompt(eng, msgs)
    images = dict(pixel_values=pv, image_grid_thw=grid)
    n = B * (B + 1) // 2 + 2
    greedy = eng.generate(ids, n, stop_token_ids=[], speculative=False, **images).token_ids
    assert eng.generate(ids, n, stop_token_ids=[], **images).token_ids == greedy
    res, hook = forced_run(eng, ids, greedy, list(range(B)), n, [], **images)
    assert res.token_ids == greedy and res.acceptance_lengths == hook.expected_lengths(n)
    assert len(eng.draft(ids, **images)) == B - 1


@pytest.mark.parametrize("name", ["dflash_sliding", "dflash2_tied"])
def test_cache_free_oracle(name):
    """The loop against an oracle that reruns everything from scratch at each step: the drafter's
    proposals with its incrementally pushed context (rejected rows included, then overwritten) equal
    Engine.draft over the whole sequence so far, and the number of forced drafts the target accepts
    equals what a full forward of the sequence plus the block says."""
    eng, B = engine(name), block_size(name)
    prompt = np.random.default_rng(2).integers(0, text_vocab(name), 7).tolist()
    n = 3 * B
    greedy = eng.generate(prompt, n, stop_token_ids=[], speculative=False).token_ids
    res, hook = forced_run(eng, prompt, greedy, [3, 0, B - 1, 1, B - 2, 2], n, [])
    assert res.token_ids == greedy
    for step, (j, drafted, forced) in enumerate(hook.steps):
        context = prompt + greedy[:j]
        assert eng.draft(context) == drafted, f"step {step}"
        logits = eng.score(context + [greedy[j]] + forced)
        target = logits[len(context) :].argmax(1)
        accepted = 0
        while accepted < B - 1 and forced[accepted] == target[accepted]:
            accepted += 1
        assert min(accepted + 1, n - 1 - j) == res.acceptance_lengths[step], f"step {step}"


@pytest.mark.parametrize("name,forced", [("dflash_sliding", True), ("dflash2_tied", False)])
def test_sampling_is_lossless(name, forced):
    """Temperature 1, top-k 3: the joint distribution of the first three tokens over 600 seeds fits
    the target's exact one (from scoring every prefix) by a chi-square test. DFlash drafts with the
    target's likeliest tokens forced in (so drafts are accepted and rejected often); DFlash2 with its
    own sampled walk, whose q is a softmax over its candidates."""
    eng = engine(name)
    V, T, K, N = eng.vocab_size, 1.0, 3, 600
    prompt = np.random.default_rng(3).integers(0, text_vocab(name), 6).tolist()
    probs = {(): ref.sampler_probs(eng.score(prompt)[-1], T, K)}
    for x1 in np.flatnonzero(probs[()]):
        logits = eng.score(prompt + [int(x1)])
        probs[(x1,)] = ref.sampler_probs(logits[-1], T, K)
        for x2 in np.flatnonzero(probs[(x1,)]):
            probs[(x1, x2)] = ref.sampler_probs(eng.score(prompt + [int(x1), int(x2)])[-1], T, K)
    cells = [(a, b, c) for a in np.flatnonzero(probs[()]) for b in np.flatnonzero(probs[(a,)])
             for c in np.flatnonzero(probs[(a, b)])]
    exact = [probs[()][a] * probs[(a,)][b] * probs[(a, b)][c] for a, b, c in cells]
    likeliest = {tuple(int(t) for t in key): int(np.argmax(p)) for key, p in probs.items()}
    generated: list[int] = []

    def hook(position, proposals):  # the target's likeliest tokens along the drafted path
        prefix = tuple(generated[: position - len(prompt) + 1])  # the tokens so far, the anchor last
        out = []
        for _ in proposals:
            out.append(likeliest.get(prefix, 0))
            prefix += (out[-1],)
        return out

    index = {tuple(int(t) for t in c): i for i, c in enumerate(cells)}
    counts, accepted = np.zeros(len(cells)), []
    eng._core.set_proposal_hook(hook if forced else None)
    try:
        for seed in range(N):
            generated.clear()
            for tok in eng.stream(prompt, 3, temperature=T, top_k=K, seed=seed, stop_token_ids=[]):
                generated.append(tok)
            counts[index[tuple(generated)]] += 1
            accepted += eng.acceptance_lengths
    finally:
        eng._core.set_proposal_hook(None)
    assert chi2_pvalue(counts, exact) > 1e-3
    if forced:  # the forced drafts were accepted and rejected
        assert 2 in accepted and 1 in accepted


def test_speculative_off_and_errors(tmp_path):
    eng = engine("dflash_tied")
    res = eng.generate([1, 2, 3], 5, stop_token_ids=[], speculative=False)
    assert res.acceptance_lengths == [] and res.mean_acceptance_length == 0.0
    stats = eng.stats()
    assert stats["draft_block_size"] == 8 and stats["drafter_weight_bytes"] > 0 and stats["drafter_state_bytes"] > 0
    plain = ocria_rt.Engine(target_dir("dflash_tied"), num_threads=1)
    assert plain.stats()["draft_block_size"] == 0
    with pytest.raises(ocria_rt.errors.InvalidArgumentError, match="no drafter"):
        plain.draft([1, 2])
    eng._core.set_proposal_hook(lambda pos, props: props[:-1])
    try:
        with pytest.raises(ocria_rt.errors.InvalidArgumentError, match="proposal hook"):
            eng.generate([1, 2, 3], 5, stop_token_ids=[])
    finally:
        eng._core.set_proposal_hook(None)

    with pytest.raises(ocria_rt.errors.ModelError, match="hidden_size"):
        ocria_rt.Engine(target_dir("dflash_tied"), drafter=DRAFTERS / "dflash2_tiny")
    with pytest.raises(ocria_rt.errors.FileError, match="drafter directory"):
        ocria_rt.Engine(target_dir("dflash_tied"), drafter=tmp_path / "missing")

    def broken(edit, match):
        d = tmp_path / f"broken{len(list(tmp_path.iterdir()))}"
        shutil.copytree(DRAFTERS / "dflash2_tied", d)
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ocria_rt.errors.ModelError, match=match):
            ocria_rt.Engine(target_dir("dflash2_tied"), drafter=d)

    broken(lambda c: c["dflash_config"].update(target_layer_ids=[2, 8]), "dflash_config.target_layer_ids")
    broken(lambda c: c["dflash_config"].update(mask_token_id=512), "mask_token_id")
    broken(lambda c: c["dflash_config"].update(block_size=1), "block_size")
    broken(lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank")
    broken(lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures")
    broken(lambda c: c.update(num_target_layers=12), "num_target_layers")
    broken(lambda c: c.update(head_dim=32), "self_attn.*has shape")  # the tensors no longer fit the config


@pytest.mark.parametrize("name", ["dflash_sliding", "dflash2_tied"])
def test_linear_observer_passes_the_speculative_ops(name):
    """An engine whose backend is wrapped in the linear observer decodes speculatively as the plain
    one does: the observer hands the drafter's, verify's and acceptance's ops to the wrapped backend."""
    observed = ocria_rt.Engine(target_dir(name), drafter=DRAFTERS / name, num_threads=1, linear_observer=True)
    for temperature in (0.0, 0.8):
        kw = dict(stop_token_ids=[], temperature=temperature, seed=5)
        got = observed.generate([3, 1, 4, 1, 5], 7, **kw)
        want = engine(name).generate([3, 1, 4, 1, 5], 7, **kw)
        assert got.token_ids == want.token_ids and got.acceptance_lengths == want.acceptance_lengths
        assert sum(got.acceptance_lengths) == 6


def test_cli_generate_with_drafter():
    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main(["generate", "--model", str(target_dir("dflash_tied")), "--drafter", str(DRAFTERS / "dflash_tied"),
                       "--prompt", "5 6 7", "--max-new-tokens", "9", "--ignore-eos", "--json", "--threads", "1"])
    assert rc == 0
    r = json.loads(out.getvalue())
    plain = engine("dflash_tied").generate([5, 6, 7], 9, stop_token_ids=[], speculative=False)
    assert r["token_ids"] == plain.token_ids and sum(r["acceptance_lengths"]) == 8

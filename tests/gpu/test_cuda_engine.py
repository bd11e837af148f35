"""The CUDA engine end to end against the CPU reference (run on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ocria_rt

from support import FIXTURES, TINY_RANDOM, load_reference, relerr

TF_TOL = 2e-2  # BF16 weights and activations against the fp32 CPU reference
CONTINUATION = 256
# text_untied_dkdv has head_dim 16, below the CUDA attention kernel's smallest head (32): it checks
# the load-time refusal instead (test_unsupported_shapes_refused_at_load).
CUDA_FIXTURES = ["text_tied", "vlm_untied"]


@pytest.fixture(scope="module", params=CUDA_FIXTURES)
def pair(request):
    d = FIXTURES / request.param
    return request.param, ocria_rt.Engine(d, device="cpu"), ocria_rt.Engine(d, device="cuda")


def bf16_yardstick(model_dir, seq: list[int], want: np.ndarray) -> np.ndarray | None:
    """Per-position relative error of transformers run in BF16 on the GPU against our fp32 CPU
    logits: what BF16 itself costs on this model (None where torch / transformers are absent)."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    vlm = ocria_rt.Engine(model_dir).config["has_vision"]
    cls = transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        got = model(torch.tensor([seq], device="cuda")).logits[0].float().cpu().numpy()
    return np.array([relerr(got[t], want[t]) for t in range(len(seq))])


def test_teacher_forced_logits_match_cpu(pair):
    """The random fixtures amplify BF16 rounding (transformers' own BF16 run on the GPU is 0.16-0.25
    off its fp32 run here, measured), so TF_TOL cannot hold for any BF16 engine. The bound is
    transformers-BF16's own error over the same 256-token continuation."""
    name, cpu, gpu = pair
    ref = load_reference(name)
    prompt = list(ref["greedy_prompt"])
    cont = cpu.generate(prompt, max_new_tokens=CONTINUATION, stop_token_ids=[]).token_ids
    seq = prompt + cont[:-1]
    want = cpu.score(seq)
    yard = bf16_yardstick(FIXTURES / name, seq, want)
    # decode path (one token per forward, graph-free) and prefill path (one chunked forward)
    for chunk in (1, 0):
        got = gpu.score(seq, chunk=chunk)
        errs = np.array([relerr(got[t], want[t]) for t in range(len(seq))])
        assert np.all(np.isfinite(errs)), f"{name} chunk={chunk}: non-finite logits"
        if yard is None:
            pytest.skip("torch + transformers are needed for the BF16 yardstick")
        assert errs.mean() <= 1.25 * yard.mean() + 5e-3, (
            f"{name} chunk={chunk}: mean error {errs.mean():.3g} vs transformers-BF16 {yard.mean():.3g}")


def test_greedy_tokens_match_cpu_where_margin_allows(pair):
    name, cpu, gpu = pair
    ref = load_reference(name)
    prompt = list(ref["greedy_prompt"])
    want = cpu.generate(prompt, max_new_tokens=CONTINUATION, stop_token_ids=[]).token_ids
    got = gpu.generate(prompt, max_new_tokens=CONTINUATION, stop_token_ids=[]).token_ids
    if got == want:
        return
    i = next(k for k in range(len(want)) if got[k] != want[k])
    seq = prompt + want[:i]
    lc, lg = cpu.score(seq)[-1], gpu.score(seq)[-1]
    top2 = np.sort(lc)[-2:]
    margin = float(top2[1] - top2[0])
    err = float(np.abs(lc - lg).max())
    assert margin <= 2 * err, f"{name}: tokens diverge at step {i} although the CPU margin {margin:.3g} > 2 x error {err:.3g}"


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, top_p=0.95, seed=5)])
def test_graph_replay_equals_eager(sampling):
    d = FIXTURES / "text_tied"
    ref = load_reference("text_tied")
    graph = ocria_rt.Engine(d, device="cuda", cuda_graphs=True)
    eager = ocria_rt.Engine(d, device="cuda", cuda_graphs=False)
    a = graph.generate(ref["greedy_prompt"], max_new_tokens=64, stop_token_ids=[], **sampling).token_ids
    b = eager.generate(ref["greedy_prompt"], max_new_tokens=64, stop_token_ids=[], **sampling).token_ids
    assert a == b
    stats = graph.stats()
    assert stats["launches_per_decode_step"] == 1
    assert stats["kernels_per_decode_step"] > 8 * 3  # the whole step is in the one graph


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, top_p=0.95, seed=5)])
def test_pdl_off_gives_identical_results(monkeypatch, sampling):
    """Programmatic dependent launch changes when kernels start, not what they compute: the decode
    graph's tokens and the eager token-by-token logits are the same bits with it off
    (OCRIA_RT_PDL=0, read when the engine's backend is constructed)."""
    d = FIXTURES / "text_tied"
    prompt = list(load_reference("text_tied")["greedy_prompt"])
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("OCRIA_RT_PDL", pdl)
        eng = ocria_rt.Engine(d, device="cuda")
        tokens = eng.generate(prompt, max_new_tokens=64, stop_token_ids=[], **sampling).token_ids
        runs[pdl] = (tokens, eng.score(prompt + tokens[:16], chunk=1), eng.stats()["kernels_per_decode_step"])
    assert runs["1"][0] == runs["0"][0]
    np.testing.assert_array_equal(runs["1"][1], runs["0"][1])
    assert runs["1"][2] == runs["0"][2]


def test_unfused_gdn_gives_identical_results(monkeypatch):
    """gdn_decode's fused kernel computes the bits of the three DeltaNet ops it replaces: the decode
    graph's tokens and the eager token-by-token logits are the same with it off (OCRIA_RT_GDN_FUSED=0,
    read when the engine's backend is constructed), and each DeltaNet layer's decode step has two
    kernels fewer with it on."""
    d = FIXTURES / "text_tied"
    prompt = list(load_reference("text_tied")["greedy_prompt"])
    text = json.loads((d / "config.json").read_text())
    gdn_layers = sum(t == "linear_attention" for t in text.get("text_config", text)["layer_types"])
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("OCRIA_RT_GDN_FUSED", fused)
        eng = ocria_rt.Engine(d, device="cuda")
        tokens = eng.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
        runs[fused] = (tokens, eng.score(prompt + tokens[:16], chunk=1), eng.stats()["kernels_per_decode_step"])
    assert runs["1"][0] == runs["0"][0]
    np.testing.assert_array_equal(runs["1"][1], runs["0"][1])
    assert runs["0"][2] - runs["1"][2] == 2 * gdn_layers


def test_unfused_attention_gives_close_results(monkeypatch):
    """attention_decode runs a decode step's attention as one kernel, and with OCRIA_RT_ATTN_FUSED=0
    (read when the engine's backend is constructed) as attention_prepare + attention. The eager
    token-by-token logits are as close to the CPU's as the two ops' (the kernel adds the new row and
    merges the splits in its own order, so they differ by rounding); the decode graph
    gives the eager engine's tokens, and each attention layer's decode step has two kernels fewer
    (attention_prepare_kernel and the combine)."""
    d = FIXTURES / "text_tied"
    prompt = list(load_reference("text_tied")["greedy_prompt"])
    text = json.loads((d / "config.json").read_text())
    attention_layers = sum(t == "full_attention" for t in text.get("text_config", text)["layer_types"])
    cpu = ocria_rt.Engine(d)
    seq = prompt + cpu.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
    want = cpu.score(seq)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("OCRIA_RT_ATTN_FUSED", fused)
        graph = ocria_rt.Engine(d, device="cuda", cuda_graphs=True)
        eager = ocria_rt.Engine(d, device="cuda", cuda_graphs=False)
        tokens = graph.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
        assert tokens == eager.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids, f"fused={fused}"
        runs[fused] = (eager.score(seq, chunk=1), graph.stats()["kernels_per_decode_step"])
    errs = {f: np.mean([relerr(got[t], want[t]) for t in range(len(seq))]) for f, (got, _) in runs.items()}
    assert np.isfinite(errs["1"]) and errs["1"] <= 1.25 * errs["0"] + 5e-3, errs
    assert runs["0"][1] - runs["1"][1] == 2 * attention_layers


def test_cluster_splitk_engine(monkeypatch):
    """Cluster split-K in every decode-path linear (OCRIA_RT_SKINNY_CLUSTER=2; the fixture's K of 64-128
    gives every block 1-2 chunks): captured in the decode graph it gives the eager engine's tokens, and
    its teacher-forced logits are as close to the CPU's as the default kernels' are."""
    d = FIXTURES / "text_tied"
    prompt = list(load_reference("text_tied")["greedy_prompt"])
    cpu = ocria_rt.Engine(d)
    seq = prompt + cpu.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
    want = cpu.score(seq)
    errs = {}
    for cluster in ("0", "2"):
        monkeypatch.setenv("OCRIA_RT_SKINNY_CLUSTER", cluster)
        got = ocria_rt.Engine(d, device="cuda").score(seq, chunk=1)
        errs[cluster] = np.mean([relerr(got[t], want[t]) for t in range(len(seq))])
    assert np.isfinite(errs["2"]) and errs["2"] <= 1.25 * errs["0"] + 5e-3, errs
    graph = ocria_rt.Engine(d, device="cuda", cuda_graphs=True)
    eager = ocria_rt.Engine(d, device="cuda", cuda_graphs=False)
    a = graph.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids
    assert a == eager.generate(prompt, max_new_tokens=64, stop_token_ids=[]).token_ids


def test_generations_in_a_row_do_not_leak():
    d = FIXTURES / "text_tied"
    ref = load_reference("text_tied")
    gpu = ocria_rt.Engine(d, device="cuda")
    first = gpu.generate(ref["greedy_prompt"], max_new_tokens=40, stop_token_ids=[]).token_ids
    gpu.generate(ref["long_ids"], max_new_tokens=7, stop_token_ids=[])
    gpu.generate(ref["greedy_prompt"][:3], max_new_tokens=100, temperature=1.0, seed=3, stop_token_ids=[])
    again = gpu.generate(ref["greedy_prompt"], max_new_tokens=40, stop_token_ids=[]).token_ids
    assert first == again


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "seed": 5}])
def test_stopping_early_does_not_leak(sampling):
    """The engine queues decode step k + 1 before it waits for token k, so a generation that ends at a
    stop token, a cancelled stream or a short max_new_tokens has computed a step it never returned:
    what follows must not see it."""
    d = FIXTURES / "text_tied"
    ref = load_reference("text_tied")
    gpu = ocria_rt.Engine(d, device="cuda")
    prompt = list(ref["greedy_prompt"])
    full = gpu.generate(prompt, max_new_tokens=24, stop_token_ids=[], **sampling).token_ids
    stop = full[5]
    r = gpu.generate(prompt, max_new_tokens=24, stop_token_ids=[stop], **sampling)
    assert r.finish_reason == "stop" and r.token_ids == full[: full.index(stop) + 1]
    for n in (1, 2, 3):
        assert gpu.generate(prompt, max_new_tokens=n, stop_token_ids=[], **sampling).token_ids == full[:n]
    stream = gpu.stream(prompt, max_new_tokens=24, stop_token_ids=[], **sampling)
    assert [next(stream) for _ in range(4)] == full[:4]
    stream.close()  # cancelled with steps in flight
    assert gpu.generate(prompt, max_new_tokens=24, stop_token_ids=[], **sampling).token_ids == full


def test_long_context_chunked_prefill():
    d = FIXTURES / "text_tied"
    n = 33000
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 512, n)]
    big = ocria_rt.Engine(d, device="cuda", max_context=n + 16)
    small = ocria_rt.Engine(d, device="cuda", max_context=n + 16, prefill_chunk=1000)
    la, lb = big.score(prompt)[-4:], small.score(prompt)[-4:]
    assert relerr(la, lb) <= TF_TOL
    r = big.generate(prompt, max_new_tokens=8, stop_token_ids=[])
    assert len(r.token_ids) == 8 and all(0 <= t < 512 for t in r.token_ids)


def test_unsupported_shapes_refused_at_load():
    with pytest.raises(ocria_rt.ModelError, match="head_dim = 16"):
        ocria_rt.Engine(FIXTURES / "text_untied_dkdv", device="cuda")


def test_tiny_random_on_cuda():
    ref = load_reference("tiny-random")
    gpu = ocria_rt.Engine(TINY_RANDOM, device="cuda")
    got = gpu.score(ref["input_ids"])
    errs = np.array([relerr(got[t], ref["logits"][t]) for t in range(len(got))])
    yard = bf16_yardstick(TINY_RANDOM, list(ref["input_ids"]), ref["logits"])
    assert np.all(np.isfinite(errs))
    if yard is not None:
        assert errs.mean() <= 1.25 * yard.mean() + 5e-3, f"mean error {errs.mean():.3g} vs transformers-BF16 {yard.mean():.3g}"
    res = gpu.generate("The table below lists", max_new_tokens=16, stop_token_ids=[])
    assert len(res.token_ids) == 16 and isinstance(res.text, str)


def test_shipped_model_on_cuda():
    """ocria-mini (the default model) on the GPU against transformers' fp32 logits of a held-out page
    (tests/fixtures/ocria_mini): BF16's error, the same argmax wherever transformers' top-2 margin is
    clear of it, and parse of the shipped sample reads like the CPU's."""
    from ocria_rt.chat import build_multimodal_prompt
    from ocria_rt.pipeline import DEFAULT_PROMPT, parse

    ref = dict(np.load(FIXTURES / "ocria_mini" / "reference.npz"))
    gpu = ocria_rt.Engine(ocria_rt.default_model_dir(), device="cuda")
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(FIXTURES / "ocria_mini" / "page.png")},
                                         {"type": "text", "text": DEFAULT_PROMPT}]}]
    _, pv, grid = build_multimodal_prompt(gpu, msgs)
    got = gpu.score(list(ref["input_ids"]), pixel_values=pv, image_grid_thw=grid)[-len(ref["logits"]):]
    errs = np.array([relerr(g, w) for g, w in zip(got, ref["logits"])])
    assert np.all(np.isfinite(errs)) and errs.mean() <= TF_TOL, errs
    top2 = np.sort(ref["logits"], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.5
    assert np.array_equal(got.argmax(-1)[clear], ref["logits"].argmax(-1)[clear])
    doc = parse(ocria_rt.sample_document(), engine=gpu, progress=False)
    assert doc.ok and all(p.markdown.strip() for p in doc.pages)


def test_hidden_states_match_cpu():
    """Engine.hidden_states of ocria-mini on a held-out page (its drafter taps, layers 2, 6, 7) on the GPU
    against the CPU's: within BF16's error at every tapped layer, text-only prompts too."""
    from ocria_rt.chat import build_multimodal_prompt
    from ocria_rt.pipeline import DEFAULT_PROMPT

    engines = [ocria_rt.Engine(ocria_rt.default_model_dir(), device=d) for d in ("cpu", "cuda")]
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(FIXTURES / "ocria_mini" / "page.png")},
                                         {"type": "text", "text": DEFAULT_PROMPT}]}]
    ids, pv, grid = build_multimodal_prompt(engines[0], msgs)
    H = engines[0].config["hidden_size"]
    for tokens, images in ((ids, dict(pixel_values=pv, image_grid_thw=grid)), (ids[-12:], {})):
        want, got = (e.hidden_states(tokens, [2, 6, 7], **images) for e in engines)
        assert got.shape == want.shape == (len(tokens), 3 * H) and np.all(np.isfinite(got))
        for i in range(3):
            errs = [relerr(g, w) for g, w in zip(got[:, i * H:(i + 1) * H], want[:, i * H:(i + 1) * H])]
            assert np.mean(errs) <= TF_TOL, (i, np.mean(errs))


def test_cuda_errors_are_clear():
    with pytest.raises(ocria_rt.InvalidArgumentError, match="device"):
        ocria_rt.Engine(FIXTURES / "text_tied", device="cuda:x")
    with pytest.raises(ocria_rt.DeviceError):
        ocria_rt.Engine(FIXTURES / "text_tied", device="cuda:99")


def test_vision_encoder_on_cuda_matches_cpu():
    ref = dict(np.load(FIXTURES / "vision_reference.npz"))
    d = FIXTURES / "vlm_untied"
    cpu, gpu = ocria_rt.Engine(d), ocria_rt.Engine(d, device="cuda")
    want = cpu.encode_images(ref["pixel_values"], ref["image_grid_thw"])
    assert relerr(gpu.encode_images(ref["pixel_values"], ref["image_grid_thw"]), want) <= TF_TOL
    res = gpu.generate(list(ref["p2_input_ids"]), max_new_tokens=8, stop_token_ids=[],
                       pixel_values=ref["pixel_values"], image_grid_thw=ref["image_grid_thw"])
    assert len(res.token_ids) == 8

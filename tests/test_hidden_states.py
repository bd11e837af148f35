"""Engine.hidden_states: the decoder's hidden states after chosen layers (the taps a drafter reads), on
the CPU: the last layer's give score()'s logits through the LM head, each layer's columns are those it
asks for, a prefix's rows are the whole sequence's, images enter as in score(); with torch and
transformers, every layer equals transformers' hidden_states[id + 1]."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image

import ocria_rt
import quant_numpy as qn
from ocria_rt.chat import build_multimodal_prompt
from support import FIXTURES, TINY_VLM, relerr

TEXT = FIXTURES / "text_tied"  # 8 layers, hidden 64, tied LM head
LAYERS = 8
TOL = 1e-5  # two fp32 computations of the same values in another order


def ids(n: int = 40, seed: int = 3) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def image_prompt(eng: ocria_rt.Engine):
    pixels = np.random.default_rng(0).integers(0, 255, (64, 96, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(pixels)},
                                             {"type": "text", "text": "Read the page."}]}]
    return build_multimodal_prompt(eng, messages)


@pytest.fixture(scope="module")
def text_engine() -> ocria_rt.Engine:
    return ocria_rt.Engine(TEXT, num_threads=1)


def test_last_layer_gives_the_logits(text_engine):
    tokens = ids()
    h = text_engine.hidden_states(tokens, [LAYERS - 1])
    assert h.shape == (40, 64) and h.dtype == np.float32
    embed = qn.read_checkpoint(TEXT)["model.embed_tokens.weight"].f32()
    assert relerr(h @ embed.T, text_engine.score(tokens)) <= TOL


def test_columns_follow_the_layers_asked_for(text_engine):
    tokens = ids()
    both = text_engine.hidden_states(tokens, [5, 1])
    assert both.shape == (40, 128)
    np.testing.assert_array_equal(both[:, :64], text_engine.hidden_states(tokens, [5]))
    np.testing.assert_array_equal(both[:, 64:], text_engine.hidden_states(tokens, [1]))
    assert relerr(both[:, :64], both[:, 64:]) > 0.1  # two layers, two different states


def test_rows_of_a_prefix_are_the_sequences(text_engine):
    tokens = ids(70)
    whole = text_engine.hidden_states(tokens, [0, 3, 7])
    assert relerr(text_engine.hidden_states(tokens[:30], [0, 3, 7]), whole[:30]) <= TOL
    chunked = ocria_rt.Engine(TEXT, num_threads=1, prefill_chunk=16)  # the taps of every prefill chunk
    assert relerr(chunked.hidden_states(tokens, [0, 3, 7]), whole) <= TOL


def test_image_prompt_through_the_lm_head():
    eng = ocria_rt.Engine(TINY_VLM, num_threads=1)
    tokens, pv, grid = image_prompt(eng)
    h = eng.hidden_states(tokens, [7], pixel_values=pv, image_grid_thw=grid)
    embed = qn.read_checkpoint(TINY_VLM)["model.language_model.embed_tokens.weight"].f32()
    assert relerr(h @ embed.T, eng.score(tokens, pixel_values=pv, image_grid_thw=grid)) <= TOL
    text = [t for t in tokens if t != eng.config["image_token_id"]]
    assert eng.hidden_states(text, [7]).shape == (len(text), h.shape[1])  # a VLM without images


@pytest.mark.parametrize("layers,what", [([], "no layers"), ([8], "layer 8"), ([-1], "layer -1")])
def test_bad_layers_are_named(text_engine, layers, what):
    with pytest.raises(ocria_rt.InvalidArgumentError, match=what):
        text_engine.hidden_states(ids(), layers)


def test_bad_tokens_and_images_are_named(text_engine):
    with pytest.raises(ocria_rt.InvalidArgumentError, match="token id 512 at index 1 is outside the vocabulary"):
        text_engine.hidden_states([1, 512, 3], [0])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="context limit of 32"):
        ocria_rt.Engine(TEXT, max_context=32).hidden_states(ids(40), [0])
    vlm = ocria_rt.Engine(TINY_VLM, num_threads=1)
    tokens, _, _ = image_prompt(vlm)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="image tokens .* but no images"):
        vlm.hidden_states(tokens, [0])


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="the comparison with transformers needs torch and transformers")
def test_every_layer_matches_transformers():
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    eng = ocria_rt.Engine(TINY_VLM, num_threads=1)
    tokens, pv, grid = image_prompt(eng)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(TINY_VLM, dtype=torch.float32).eval()
    x = torch.tensor([tokens])
    with torch.no_grad():
        out = model(input_ids=x, pixel_values=torch.from_numpy(pv), image_grid_thw=torch.from_numpy(grid),
                    mm_token_type_ids=(x == eng.config["image_token_id"]).int(), output_hidden_states=True,
                    use_cache=False)
    ours = eng.hidden_states(tokens, range(LAYERS), pixel_values=pv, image_grid_thw=grid)
    for layer in range(LAYERS):
        theirs = out.hidden_states[layer + 1][0].numpy()
        assert relerr(ours[:, layer * theirs.shape[1]:(layer + 1) * theirs.shape[1]], theirs) <= 1e-4, layer

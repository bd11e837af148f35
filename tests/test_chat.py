"""Chat templates, multimodal prompts and Engine.chat on the shipped tiny VLM, against transformers.

The reference (tests/fixtures/tiny_vlm_ref.npz, from tests/fixtures/make_default_vlm.py) holds the
chat text transformers' processor renders, its input ids with the image placeholders expanded, and the
fp32 logits / greedy tokens of transformers on the same weights.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

import ocria_rt
from ocria_rt.chat import (
    apply_chat_template,
    build_multimodal_prompt,
    expand_image_tokens,
    load_chat_template,
    vision_token_ids,
)
from support import FIXTURES, TINY_RANDOM, TINY_VLM, relerr

REF = dict(np.load(FIXTURES / "tiny_vlm_ref.npz"))
IMAGES = FIXTURES / "images"


def messages(tag: str) -> list[dict]:
    """The reference conversation `tag` ("", "chat2_", "chat3_") with image names made paths."""
    msgs = json.loads(str(REF[f"{tag}messages_json"]))
    for m in msgs:
        if isinstance(m["content"], list):
            for item in m["content"]:
                if item.get("type") == "image":
                    item["image"] = str(IMAGES / item["image"])
    return msgs


@pytest.fixture(scope="module")
def vlm():
    return ocria_rt.Engine(TINY_VLM)


def test_tiny_vlm_files():
    cfg = json.loads((TINY_VLM / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5" and cfg["dtype"] == "bfloat16"
    v = cfg["vision_config"]
    assert (v["patch_size"], v["temporal_patch_size"], v["spatial_merge_size"]) == (16, 2, 2)
    assert int(v["num_position_embeddings"] ** 0.5) ** 2 == v["num_position_embeddings"]
    size = sum(f.stat().st_size for f in TINY_VLM.iterdir())
    assert size < 6 * 2**20, size
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY_VLM / "tokenizer.json"))
    for name, key in (("<|image_pad|>", "image_token_id"), ("<|vision_start|>", "vision_start_token_id"),
                      ("<|vision_end|>", "vision_end_token_id")):
        assert tok.token_to_id(name) == cfg[key]
    assert tok.get_vocab_size() <= cfg["text_config"]["vocab_size"]
    gen = json.loads((TINY_VLM / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == sorted([tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


@pytest.mark.parametrize("tag", ["", "chat2_", "chat3_"])
def test_template_and_expansion_match_transformers_processor(vlm, tag):
    text_key = "chat_text" if tag == "" else f"{tag}text"
    msgs = messages(tag)
    assert apply_chat_template(vlm, msgs) == str(REF[text_key])
    assert apply_chat_template(TINY_VLM, msgs) == str(REF[text_key])  # a directory works too
    ids, pv, grid = build_multimodal_prompt(vlm, msgs)
    assert ids == REF[f"{tag}input_ids"].tolist()
    if f"{tag}image_grid_thw" in REF:
        np.testing.assert_array_equal(grid, REF[f"{tag}image_grid_thw"])
        assert pv.shape == (int(np.prod(grid, axis=1).sum()), 3 * 2 * 16 * 16)
    else:
        assert pv is None and grid is None


def test_multimodal_logits_match_transformers(vlm):
    # transformers' reference used its PIL image processor (the oracle has no torchvision)
    ids, pv, grid = build_multimodal_prompt(vlm, messages(""), backend="pil")
    assert float(pv.astype(np.float64).sum()) == pytest.approx(float(REF["pixel_sum"]), rel=1e-12)
    logits = vlm.score(ids, pixel_values=pv, image_grid_thw=grid)
    assert logits.shape == REF["logits"].shape
    assert relerr(logits, REF["logits"]) <= 1e-4


def test_engine_chat_greedy_matches_transformers(vlm):
    r = vlm.chat(messages(""), max_new_tokens=16, stop_token_ids=[], backend="pil")
    assert isinstance(r, ocria_rt.GenerationResult)
    assert r.token_ids == REF["greedy_tokens"].tolist()
    assert r.text == vlm.decode(r.token_ids, skip_special_tokens=True)
    assert r.prompt_tokens == len(REF["input_ids"])
    streamed = list(vlm.chat(messages(""), max_new_tokens=16, stop_token_ids=[], backend="pil", stream=True))
    assert streamed == r.token_ids


def test_engine_chat_text_only_and_default_stops(vlm):
    r = vlm.chat([{"role": "user", "content": "Extract the invoice total."}], max_new_tokens=8)
    assert 1 <= len(r.token_ids) <= 8 and r.finish_reason in ("stop", "length")
    assert r.prompt_tokens == len(REF["chat3_input_ids"])


def test_image_sources_are_equivalent(vlm):
    """A path, a PIL image, a numpy array, encoded bytes, file:// and data: URLs give the same prompt."""
    from PIL import Image

    path = IMAGES / "vis_a.png"
    raw = path.read_bytes()
    with Image.open(path) as im:
        pil = im.convert("RGB")
    variants = [
        {"type": "image", "image": str(path)},
        {"type": "image", "image": path},
        {"type": "image", "image": pil},
        {"type": "image", "image": np.asarray(pil)},
        {"type": "image", "image": raw},
        {"type": "image", "path": str(path)},
        {"type": "image", "url": path.as_uri()},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(raw).decode()}},
    ]
    want = None
    for item in variants:
        got = build_multimodal_prompt(vlm, [{"role": "user", "content": [item, {"type": "text", "text": "Read."}]}])
        if want is None:
            want = got
        assert got[0] == want[0]
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
    # an image that is already preprocessed
    pre = {"type": "image", "pixel_values": want[1], "image_grid_thw": want[2]}
    got = build_multimodal_prompt(vlm, [{"role": "user", "content": [pre, {"type": "text", "text": "Read."}]}])
    assert got[0] == want[0]


def test_expand_image_tokens():
    grids = np.array([[1, 2, 4], [1, 4, 4]])
    assert expand_image_tokens([5, 9, 6, 9, 7], grids, 9, 2) == [5, 9, 9, 6, 9, 9, 9, 9, 7]
    with pytest.raises(ocria_rt.InvalidArgumentError, match="1 image placeholder"):
        expand_image_tokens([5, 9, 6], grids, 9, 2)


def test_chat_errors(vlm, tmp_path):
    img = {"type": "image", "image": str(IMAGES / "vis_a.png")}
    with pytest.raises(ocria_rt.InvalidArgumentError, match="video"):
        build_multimodal_prompt(vlm, [{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="not fetched"):
        build_multimodal_prompt(vlm, [{"role": "user", "content": [{"type": "image", "url": "https://x.org/a.png"}]}])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="'role' and 'content'"):
        apply_chat_template(vlm, [{"content": "hi"}])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="list of"):
        apply_chat_template(vlm, "hi")
    with pytest.raises(ocria_rt.FileError, match="does not exist"):
        build_multimodal_prompt(vlm, [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "no.png")}]}])
    # a literal placeholder typed in the text does not match the number of images
    with pytest.raises(ocria_rt.InvalidArgumentError, match="placeholder"):
        build_multimodal_prompt(vlm, [{"role": "user", "content": [img, {"type": "text", "text": "<|image_pad|>"}]}])
    # a text-only model takes no images
    text_only = ocria_rt.Engine(TINY_RANDOM)
    assert not text_only.config.get("has_vision")
    with pytest.raises(ocria_rt.InvalidArgumentError, match="no vision encoder"):
        build_multimodal_prompt(text_only, [{"role": "user", "content": [img]}])


def test_template_lookup_order(tmp_path):
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((TINY_VLM / name).read_text())
    msgs = [{"role": "user", "content": "hi"}]
    assert apply_chat_template(tmp_path, msgs).startswith("<|im_start|>user\nhi")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J{{ messages[0]['content'] }}"}))
    assert apply_chat_template(tmp_path, msgs) == "Jhi"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token or '' }}{{ eos_token }}:{{ messages | length }}")
    assert apply_chat_template(tmp_path, msgs) == "<|im_end|>:1"  # special tokens are template variables
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(ocria_rt.InvalidArgumentError, match="no system role"):
        apply_chat_template(tmp_path, msgs)
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ocria_rt.ModelError, match="does not parse"):
        apply_chat_template(tmp_path, msgs)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "chat_template.json").unlink()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path)[0] == "D"
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ocria_rt.ModelError, match="no chat template"):
        apply_chat_template(tmp_path, msgs)


def test_vision_token_ids():
    v = vision_token_ids(TINY_VLM)
    cfg = json.loads((TINY_VLM / "config.json").read_text())
    assert v == {"merge_size": 2, "image_token_id": cfg["image_token_id"],
                 "vision_start_token_id": cfg["vision_start_token_id"], "vision_end_token_id": cfg["vision_end_token_id"]}

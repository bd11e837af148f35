"""The vision encoder (CPU) against transformers, and its input checks."""

from __future__ import annotations

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES, relerr

REF = dict(np.load(FIXTURES / "vision_reference.npz"))


@pytest.fixture(scope="module")
def vlm():
    return ocria_rt.Engine(FIXTURES / "vlm_untied")


def test_merged_output_matches_transformers(vlm):
    out = vlm.encode_images(REF["pixel_values"], REF["image_grid_thw"])
    assert out.shape == REF["vis_merged"].shape
    assert relerr(out, REF["vis_merged"]) <= 1e-4


def test_images_encode_independently(vlm):
    """Two images in one call give what each gives alone: attention stays inside an image."""
    grids = REF["image_grid_thw"]
    n0 = int(np.prod(grids[0]))
    both = vlm.encode_images(REF["pixel_values"], grids)
    first = vlm.encode_images(REF["pixel_values"][:n0], grids[:1])
    second = vlm.encode_images(REF["pixel_values"][n0:], grids[1:])
    assert relerr(np.concatenate([first, second]), both) <= 1e-6


def test_preprocess_then_encode_matches_reference(vlm):
    from PIL import Image

    from ocria_rt.preprocess import preprocess_images

    paths = [FIXTURES / "images" / "vis_a.png", FIXTURES / "images" / "vis_b.png"]
    # the reference was made by transformers' PIL image processor (no torchvision in the oracle)
    pv, grid = preprocess_images([Image.open(p) for p in paths], FIXTURES / "vlm_untied", backend="pil")
    np.testing.assert_array_equal(pv, REF["pixel_values"])
    np.testing.assert_array_equal(grid, REF["image_grid_thw"])
    assert relerr(vlm.encode_images(pv, grid), REF["vis_merged"]) <= 1e-4


def test_bad_image_inputs(vlm):
    pv, grid = REF["pixel_values"], REF["image_grid_thw"]
    with pytest.raises(ocria_rt.InvalidArgumentError, match="pixel_values holds"):
        vlm.encode_images(pv[:-1], grid)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="multiples of 2"):
        vlm.encode_images(pv, np.array([[1, 3, 8], [1, 4, 4]]))
    with pytest.raises(ocria_rt.InvalidArgumentError, match=r"\[images, 3\]"):
        vlm.encode_images(pv, grid[:, :2])
    small = ocria_rt.Engine(FIXTURES / "vlm_untied", max_image_patches=16)
    with pytest.raises(ocria_rt.ResourceError, match="max_image_patches"):
        small.encode_images(pv, grid)
    text_only = ocria_rt.Engine(FIXTURES / "text_tied")
    with pytest.raises(ocria_rt.InvalidArgumentError, match="no vision encoder"):
        text_only.encode_images(pv, grid)


@pytest.mark.parametrize("prompt,images", [("p1", 1), ("p2", 2)])
def test_multimodal_logits_match_transformers(vlm, prompt, images):
    grids = REF["image_grid_thw"][:images]
    pv = REF["pixel_values"][: int(np.prod(grids, axis=1).sum())]
    ids, want = REF[f"{prompt}_input_ids"], REF[f"{prompt}_logits"]
    assert relerr(vlm.score(ids, pixel_values=pv, image_grid_thw=grids), want) <= 1e-4
    # token by token: image features enter one row at a time, M-RoPE positions the same
    assert relerr(vlm.score(ids, chunk=1, pixel_values=pv, image_grid_thw=grids), want) <= 1e-4


def test_generation_after_images_continues_the_positions(vlm):
    """Decode steps after an image use position index + rope delta: greedy generate must equal the
    argmax of scoring prompt + generated tokens in one pass (where M-RoPE positions are exact)."""
    grids = REF["image_grid_thw"]
    pv, ids = REF["pixel_values"], list(REF["p2_input_ids"])
    res = vlm.generate(ids, max_new_tokens=12, stop_token_ids=[], pixel_values=pv, image_grid_thw=grids)
    logits = vlm.score(ids + res.token_ids[:-1], pixel_values=pv, image_grid_thw=grids)
    np.testing.assert_array_equal(logits[len(ids) - 1 :].argmax(-1), res.token_ids)


def test_image_token_mismatches(vlm):
    grids = REF["image_grid_thw"]
    ids = REF["p2_input_ids"]
    with pytest.raises(ocria_rt.InvalidArgumentError, match="no images were given"):
        vlm.score(ids)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="image-token runs"):
        vlm.score(ids, pixel_values=REF["pixel_values"][: int(np.prod(grids[0]))], image_grid_thw=grids[:1])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="together"):
        vlm.score(ids, pixel_values=REF["pixel_values"])

"""ocria_rt.vision_positions (and the vision fixture's pixel_values) against transformers 5.17.

Reference: tests/fixtures/vision_reference.npz (tests/fixtures/make_vision_fixtures.py), for the tiny
VLM checkpoint tests/fixtures/vlm_untied (vision: patch 16, merge 2, 4x4 learned positions, head_dim 16).
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

import vision_cases as vc
from ocria_rt import InvalidArgumentError
from ocria_rt import vision_positions as vp
from support import FIXTURES

VLM = FIXTURES / "vlm_untied"


@functools.lru_cache(maxsize=None)
def ref() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "vision_reference.npz"))


@functools.lru_cache(maxsize=None)
def config() -> dict:
    return json.loads((VLM / "config.json").read_text())


def read_f32_tensor(path, name: str) -> np.ndarray:
    """One F32 tensor from a safetensors file (8-byte header length, JSON header, raw data)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + n])[name]
    assert meta["dtype"] == "F32"
    a, b = meta["data_offsets"]
    return np.frombuffer(raw[8 + n + a : 8 + n + b], dtype="<f4").reshape(meta["shape"])


def vision_config() -> dict:
    return config()["vision_config"]


def test_pixel_values_match_fixture():
    from ocria_rt import preprocess as pp
    paths = [FIXTURES / vc.IMAGES_DIR_NAME / f"{n}.png" for n in vc.VISION_CASES]
    pv, grid = pp.preprocess_images(paths, VLM, backend="pil")  # the fixture used the PIL backend
    np.testing.assert_array_equal(grid, ref()["image_grid_thw"])
    np.testing.assert_array_equal(pv, ref()["pixel_values"])


def test_rotary_position_ids():
    r = ref()
    got = vp.vision_rotary_position_ids(r["image_grid_thw"], vision_config()["spatial_merge_size"])
    np.testing.assert_array_equal(got, r["vis_rot_pos_ids"])
    # merge-window-major order: the first 4 patches are the top-left 2x2 window
    assert got[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_rotary_cos_sin():
    r = ref()
    vc_ = vision_config()
    head_dim = vc_["hidden_size"] // vc_["num_heads"]
    cos, sin = vp.vision_rotary_cos_sin(r["vis_rot_pos_ids"], head_dim, vc_["rope_parameters"]["rope_theta"])
    assert cos.shape == r["vis_rot_cos"].shape == (r["pixel_values"].shape[0], head_dim)
    np.testing.assert_allclose(cos, r["vis_rot_cos"], rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, r["vis_rot_sin"], rtol=0, atol=2e-6)


def test_pos_embed_interpolation():
    r = ref()
    side = int(vision_config()["num_position_embeddings"] ** 0.5)
    idx, w = vp.vision_pos_embed_interpolation(r["image_grid_thw"], side, vision_config()["spatial_merge_size"])
    np.testing.assert_array_equal(idx, r["vis_interp_idx"])
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, r["vis_interp_w"])  # same float32 operations: exact
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-6)


def test_pos_embed_applied():
    """sum_k w_k * table[idx_k] with the checkpoint's table reproduces transformers' position embedding."""
    table = read_f32_tensor(VLM / "model.safetensors", "model.visual.pos_embed.weight")
    r = ref()
    got = (table[r["vis_interp_idx"]] * r["vis_interp_w"][:, :, None]).sum(axis=1)
    np.testing.assert_allclose(got, r["vis_pos_embed"], rtol=0, atol=1e-6)


def test_cu_seqlens():
    r = ref()
    np.testing.assert_array_equal(vp.vision_cu_seqlens(r["image_grid_thw"]), r["vis_cu_seqlens"])
    counts = vp.merged_token_counts(r["image_grid_thw"], 2)
    assert counts.sum() == r["vis_merged"].shape[0]


@pytest.mark.parametrize("tag,n_images", [("p1", 1), ("p2", 2)])
def test_mrope_position_ids(tag, n_images):
    r = ref()
    ids = r[f"{tag}_input_ids"]
    pos, delta = vp.mrope_position_ids(ids, r["image_grid_thw"][:n_images], config()["image_token_id"], 2)
    np.testing.assert_array_equal(pos, r[f"{tag}_position_ids"])
    assert delta == int(r[f"{tag}_rope_delta"])
    # text after each image continues one past the image's largest position
    assert pos.dtype == np.int64 and pos.shape == (3, len(ids))


@pytest.mark.parametrize("tag,n_images", [("p1", 1), ("p2", 2)])
def test_expand_image_tokens(tag, n_images):
    r = ref()
    image_id = config()["image_token_id"]
    full = r[f"{tag}_input_ids"].tolist()
    compact = [t for i, t in enumerate(full) if t != image_id or full[i - 1] != image_id]
    assert vp.expand_image_tokens(compact, r["image_grid_thw"][:n_images], image_id, 2) == full


def test_mrope_errors():
    grid = np.array([[1, 4, 6]])
    with pytest.raises(InvalidArgumentError, match="image tokens"):
        vp.mrope_position_ids([1, 592, 592, 2], grid, 592, 2)
    with pytest.raises(InvalidArgumentError, match="merge_size"):
        vp.vision_rotary_position_ids([[1, 3, 4]], 2)
    with pytest.raises(InvalidArgumentError, match="grid_thw"):
        vp.vision_cu_seqlens([[1, 0, 4]])
    # text-only prompt: plain positions on all three axes
    pos, delta = vp.mrope_position_ids([5, 6, 7], None, 592, 2)
    assert pos.tolist() == [[0, 1, 2]] * 3 and delta == 0

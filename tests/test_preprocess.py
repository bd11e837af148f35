"""ocria_rt.preprocess against transformers 5.17's Qwen2-VL image processors (both backends).

References: tests/fixtures/preprocess_reference.npz, made by tests/fixtures/make_vision_fixtures.py
from the synthetic images of tests/vision_cases.py (small ones stored as PNG under
tests/fixtures/images/, large ones drawn again here from the same integer recipe).
Both backends are reproduced bit for bit, so the bounds below are tight.
"""

from __future__ import annotations

import functools
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from PIL import Image  # Pillow is a runtime dependency of ocria_rt's image input

import vision_cases as vc
from ocria_rt import FileError, InvalidArgumentError, ModelError
from ocria_rt import preprocess as pp
from support import FIXTURES

IMAGES = FIXTURES / vc.IMAGES_DIR_NAME
VLM = FIXTURES / "vlm_untied"
BACKENDS = ("torchvision", "pil")
# The "pil" backend calls Pillow's own resize, whose rounding changed between Pillow releases: its
# stored references (made by make_vision_fixtures.py) hold for this Pillow major version only.
REFERENCE_PILLOW_MAJOR = 13


@functools.lru_cache(maxsize=None)
def reference() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURES / "preprocess_reference.npz"))


@functools.lru_cache(maxsize=None)
def case_input(name: str):
    case = vc.PREPROCESS_CASES[name]
    if case["stored"]:
        return str(IMAGES / f"{name}.png")
    return vc.make_pil(case)


def check_against_reference(pv: np.ndarray, grid: np.ndarray, key: str, seed: int) -> float:
    """Compare with the stored output (full or summary); return the max abs difference seen."""
    ref = reference()
    np.testing.assert_array_equal(grid, ref[f"{key}/grid"], err_msg=key)
    assert pv.dtype == np.float32 and grid.dtype == np.int64
    if f"{key}/pixel_values" in ref:
        full = ref[f"{key}/pixel_values"]
        assert pv.shape == full.shape, key
        diff = float(np.abs(pv - full).max())
        assert diff <= 1e-6, f"{key}: max |ours - transformers| = {diff}"
        return diff
    mine = vc.summarize(pv, seed)
    np.testing.assert_array_equal(mine["shape"], ref[f"{key}/shape"], err_msg=key)
    np.testing.assert_array_equal(mine["sample_idx"], ref[f"{key}/sample_idx"], err_msg=key)
    diff = float(np.abs(mine["sample_val"] - ref[f"{key}/sample_val"]).max())
    assert diff <= 1e-6, f"{key}: sampled elements differ by {diff}"
    for k in ("mean", "std", "chunk_sums"):
        np.testing.assert_allclose(mine[k], ref[f"{key}/{k}"], rtol=1e-9, atol=1e-9, err_msg=f"{key}/{k}")
    return diff


CASES = [
    (cfg, name, backend)
    for cfg in vc.PREPROCESS_CONFIGS
    for name in vc.PREPROCESS_CASES
    for backend in BACKENDS
]


@pytest.mark.parametrize("cfg_name,name,backend", CASES, ids=["/".join(c) for c in CASES])
def test_matches_transformers(cfg_name, name, backend):
    if backend == "pil":
        import PIL

        if int(PIL.__version__.split(".")[0]) != REFERENCE_PILLOW_MAJOR:
            pytest.skip(f"PIL references were made with Pillow {REFERENCE_PILLOW_MAJOR}.x, this is {PIL.__version__}")
    seed = list(vc.PREPROCESS_CASES).index(name)
    pv, grid = pp.preprocess_image(case_input(name), vc.PREPROCESS_CONFIGS[cfg_name], backend=backend)
    check_against_reference(pv, grid, f"{cfg_name}/{name}/{backend}", seed)


def test_default_backend_is_torchvision():
    """With no backend named, the output is transformers' default (torchvision) backend's."""
    cfg = vc.PREPROCESS_CONFIGS["qwen35"]
    pv, grid = pp.preprocess_image(case_input("mixed"), cfg)
    check_against_reference(pv, grid, "qwen35/mixed/torchvision", list(vc.PREPROCESS_CASES).index("mixed"))
    assert pp.ImageProcessorConfig.from_dict(cfg).backend == "torchvision"


@pytest.mark.parametrize("name", [n for n, c in vc.PREPROCESS_CASES.items() if c["stored"]])
def test_path_pil_and_numpy_inputs_agree(name):
    cfg = vc.PREPROCESS_CONFIGS["tiny"]
    from_path, g1 = pp.preprocess_image(IMAGES / f"{name}.png", cfg)  # a pathlib.Path works too
    with Image.open(IMAGES / f"{name}.png") as im:
        from_pil, g2 = pp.preprocess_image(im, cfg)
        rgb = np.array(im.convert("RGB"))
    from_np, g3 = pp.preprocess_image(rgb, cfg)
    np.testing.assert_array_equal(from_path, from_pil)
    np.testing.assert_array_equal(from_path, from_np)
    np.testing.assert_array_equal(g1, g2)
    np.testing.assert_array_equal(g1, g3)


def test_numpy_gray_and_rgba_arrays():
    """HxW and HxWx4 uint8 arrays are converted like the PIL images of the same mode."""
    cfg = vc.PREPROCESS_CONFIGS["tiny"]
    for name in ("gray", "rgba"):
        with Image.open(IMAGES / f"{name}.png") as im:
            arr = np.array(im)
            a, ga = pp.preprocess_image(im, cfg)
        b, gb = pp.preprocess_image(arr, cfg)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ga, gb)
    arr = np.array(Image.open(IMAGES / "gray.png"))
    np.testing.assert_array_equal(pp.preprocess_image(arr[:, :, None], cfg)[0], pp.preprocess_image(arr, cfg)[0])


def test_preprocess_images_concatenates():
    cfg = vc.PREPROCESS_CONFIGS["tiny"]
    names = ["tiny_rgb", "gray", "palette"]
    pv, grids = pp.preprocess_images([case_input(n) for n in names], cfg, backend="pil")
    singles = [pp.preprocess_image(case_input(n), cfg, backend="pil") for n in names]
    np.testing.assert_array_equal(pv, np.concatenate([s[0] for s in singles]))
    np.testing.assert_array_equal(grids, np.concatenate([s[1] for s in singles]))
    assert grids.shape == (3, 3) and grids.dtype == np.int64
    assert pv.shape == (int(grids.prod(axis=1).sum()), 3 * 2 * 16 * 16)


def test_model_dir_config():
    cfg = pp.ImageProcessorConfig.from_model_dir(VLM)
    assert cfg == pp.ImageProcessorConfig.from_dict(vc.PREPROCESS_CONFIGS["tiny"])
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (16, 2, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (64 * 64, 128 * 128)
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.patch_dim == 1536
    a = pp.preprocess_image(case_input("tiny_rgb"), VLM)
    b = pp.preprocess_image(case_input("tiny_rgb"), str(VLM / "preprocessor_config.json"))
    np.testing.assert_array_equal(a[0], b[0])
    # the number of image tokens the prompt needs
    assert pp.num_image_tokens(a[1][0], cfg.merge_size) == a[0].shape[0] // 4
    assert pp.image_grid_thw_for_size(15, 20, cfg) == tuple(a[1][0].tolist())


def test_config_defaults_and_precedence(tmp_path):
    d = pp.ImageProcessorConfig()
    assert (d.patch_size, d.min_pixels, d.max_pixels) == (14, 56 * 56, 28 * 28 * 1280)
    assert d.image_mean == pp.OPENAI_CLIP_MEAN
    # top-level min/max_pixels win over size (transformers' backward-compatibility rule)
    c = pp.ImageProcessorConfig.from_dict(
        {"size": {"shortest_edge": 100, "longest_edge": 200000}, "min_pixels": 300, "max_pixels": 40000}
    )
    assert (c.min_pixels, c.max_pixels) == (300, 40000)
    c = pp.ImageProcessorConfig.from_dict({"size": {"min_pixels": 500, "max_pixels": 60000}})
    assert (c.min_pixels, c.max_pixels) == (500, 60000)
    # processor_config.json["image_processor"] wins over preprocessor_config.json
    model = tmp_path / "m"
    model.mkdir()
    (model / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    (model / "processor_config.json").write_text(json.dumps({"image_processor": {"patch_size": 8, "merge_size": 4}}))
    c = pp.ImageProcessorConfig.from_model_dir(model)
    assert (c.patch_size, c.merge_size) == (8, 4)
    assert pp.ImageProcessorConfig.from_model_dir(tmp_path) == pp.ImageProcessorConfig()  # no file: defaults


def test_config_errors(tmp_path):
    model = tmp_path / "m"
    shutil.copytree(VLM, model, ignore=shutil.ignore_patterns("*.safetensors", "*.npz"))
    cfg = json.loads((model / "preprocessor_config.json").read_text())
    cfg["patch_size"] = 14
    (model / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="patch_size"):
        pp.ImageProcessorConfig.from_model_dir(model)
    (model / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(FileError, match="not valid JSON"):
        pp.ImageProcessorConfig.from_model_dir(model)
    with pytest.raises(FileError, match="does not exist"):
        pp.ImageProcessorConfig.from_model_dir(tmp_path / "nope")
    for bad in ({"patch_size": 0}, {"patch_size": "16"}, {"image_mean": [0.5, 0.5]}, {"image_std": 0},
                {"min_pixels": 5000, "max_pixels": 4000}, {"resample": 2}, {"backend": "cv2"}):
        with pytest.raises(InvalidArgumentError):
            pp.ImageProcessorConfig.from_dict(bad)
    with pytest.raises(InvalidArgumentError, match="backend"):
        pp.preprocess_image(np.zeros((32, 32, 3), np.uint8), backend="opencv")


def test_smart_resize():
    assert pp.smart_resize(15, 20, 32, 4096, 16384) == (64, 96)
    assert pp.smart_resize(64, 96, 32, 4096, 16384) == (64, 96)
    assert pp.smart_resize(2200, 3000, 32, 4096, 16384) == (96, 128)
    assert pp.smart_resize(1000, 700, 28, 3136, 1003520) == (1008, 700)
    # values from transformers' smart_resize
    assert pp.smart_resize(1, 199, 32, 4096, 16384) == (32, 928)  # the min branch may exceed max_pixels
    assert pp.smart_resize(5000, 30, 32, 4096, 16384) == (1632, 32)
    assert pp.smart_resize(80, 80, 32, 4096, 16384) == (64, 64)  # round(2.5) == 2: half to even


def test_resizers_agree_up_to_rounding():
    """The two resamplers use the same filter: away from sharp edges they differ by rounding only."""
    y, x = np.mgrid[0:97, 0:133]
    smooth = np.stack([x * 255 // 132, y * 255 // 96, (x + y) * 255 // 228], -1).astype(np.uint8)
    for size in [(64, 96), (200, 160), (48, 300)]:
        a = pp.resize_bicubic_torch(smooth, *size).astype(int)
        b = pp.resize_bicubic_pil(smooth, *size).astype(int)
        assert a.shape == b.shape == size + (3,)
        assert np.abs(a - b).max() <= 2


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def png_with_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose IHDR claims width x height but that has no pixel data (no decoding happens)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def test_nonexistent_path(tmp_path):
    with pytest.raises(FileError, match="does not exist"):
        pp.preprocess_image(tmp_path / "missing.png")


def test_directory_path(tmp_path):
    with pytest.raises(FileError, match="directory"):
        pp.preprocess_image(tmp_path)


def test_not_an_image(tmp_path):
    p = tmp_path / "page.png"
    p.write_text("this is not an image\n")
    with pytest.raises(FileError, match="not an image"):
        pp.preprocess_image(p)


def test_truncated_image(tmp_path):
    data = (IMAGES / "vis_a.png").read_bytes()
    p = tmp_path / "cut.png"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(FileError, match="cut.png"):
        pp.preprocess_image(p)


def test_too_large(tmp_path):
    # a header claiming 3e4 x 3e4 = 9e8 pixels: refused before any decoding
    p = tmp_path / "bomb.png"
    png_with_header_only(p, 30000, 30000)
    with pytest.raises(InvalidArgumentError, match="too large"):
        pp.preprocess_image(p)
    # a configurable limit, for files, PIL images and arrays
    with pytest.raises(InvalidArgumentError, match="too large.*max_image_pixels"):
        pp.preprocess_image(IMAGES / "vis_a.png", max_image_pixels=5000)
    with pytest.raises(InvalidArgumentError, match="too large"):
        pp.preprocess_image(np.zeros((100, 100, 3), np.uint8), max_image_pixels=9999)
    with pytest.raises(InvalidArgumentError, match="too large"):
        pp.preprocess_image(Image.new("RGB", (100, 100)), max_image_pixels=9999)
    assert pp.preprocess_image(np.zeros((100, 100, 3), np.uint8), max_image_pixels=10000)[0].size > 0


def test_zero_size():
    for arr in (np.zeros((0, 10, 3), np.uint8), np.zeros((10, 0), np.uint8)):
        with pytest.raises(InvalidArgumentError, match="zero size"):
            pp.preprocess_image(arr)
    with pytest.raises(InvalidArgumentError, match="zero size"):
        pp.preprocess_image(Image.new("RGB", (0, 7)))


def test_bad_arrays_and_types():
    with pytest.raises(InvalidArgumentError, match="uint8"):
        pp.preprocess_image(np.zeros((32, 32, 3), np.float32))
    with pytest.raises(InvalidArgumentError, match="shape"):
        pp.preprocess_image(np.zeros((32, 32, 2), np.uint8))
    with pytest.raises(InvalidArgumentError, match="file path, a PIL.Image"):
        pp.preprocess_image(12345)
    with pytest.raises(InvalidArgumentError, match="aspect ratio"):
        pp.preprocess_image(np.zeros((2, 500, 3), np.uint8))
    with pytest.raises(InvalidArgumentError, match="list"):
        pp.preprocess_images(np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(InvalidArgumentError, match="empty"):
        pp.preprocess_images([])

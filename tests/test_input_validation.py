"""Wrong types and impossible values in the files of a checkpoint are OcriaErrors naming the file, the
key path and what was expected (the loaders read every value through json::Field / typed checks)."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import ocria_rt
from ocria_rt import _core
from ocria_rt import preprocess as pp
from ocria_rt.chat import vision_token_ids
from support import FIXTURES

TEXT = FIXTURES / "text_tied"
VLM = FIXTURES / "vlm_untied"


def model_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.npz"))
    return dst


def set_key(doc: dict, path: str, value) -> None:
    """doc[a][b]... = value for path 'a.b' (value DELETE removes the key)."""
    *parents, last = path.split(".")
    for p in parents:
        doc = doc[p]
    if value is DELETE:
        del doc[last]
    else:
        doc[last] = value


class _Delete:
    """The value that removes a key (its repr names the test case the same in every process, as
    pytest-xdist requires)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()


def edited_config(src: Path, tmp_path: Path, path: str, value, name: str = "config.json") -> Path:
    d = model_copy(src, tmp_path)
    doc = json.loads((d / name).read_text())
    set_key(doc, path, value)
    (d / name).write_text(json.dumps(doc))  # NaN and Infinity written as Python does
    return d


TEXT_CASES = [
    # the examples: wrong JSON types
    ("eos_token_id", 3.5, r"key 'eos_token_id' must be an integer in \[0, 511\], got 3.5"),
    ("eos_token_id", math.nan, r"key 'eos_token_id' must be an integer in \[0, 511\], got NaN"),
    ("eos_token_id", "x", r"key 'eos_token_id' must be a token id or a list of token ids in \[0, 511\], got the string 'x'"),
    ("eos_token_id", [1, math.nan], r"key 'eos_token_id\[1\]' must be an integer in \[0, 511\], got NaN"),
    ("eos_token_id", 512, r"key 'eos_token_id' must be an integer in \[0, 511\], got 512"),
    ("rope_parameters.mrope_section", 0, r"key 'rope_parameters.mrope_section' must be an array \(each element an integer in \[0, 4\]\), got 0"),
    ("rope_parameters.mrope_section", "x", r"key 'rope_parameters.mrope_section' must be an array"),
    ("rope_parameters.mrope_section", [math.nan, 1, 1], r"key 'rope_parameters.mrope_section\[0\]' must be an integer in \[0, 4\], got NaN"),
    ("rope_parameters.mrope_section", [2, 1], r"key 'rope_parameters.mrope_section' must hold 3 sizes \(t, h, w\) adding up to rotary_dim / 2 = 4"),
    ("rope_parameters.mrope_section", [2, 1, 2], r"key 'rope_parameters.mrope_section' .* rotary_dim / 2 = 4, got 3 adding up to 5"),
    # right type, impossible meaning
    ("rms_norm_eps", -1, r"key 'rms_norm_eps' must be a positive number in the normal float32 range \(1.2e-38 to 3.4e38\), got -1"),
    ("rms_norm_eps", 0, r"key 'rms_norm_eps' must be a positive number in the normal float32 range .*, got 0"),
    ("rms_norm_eps", math.inf, r"key 'rms_norm_eps' must be a positive number .*got Infinity"),
    ("rope_parameters.rope_theta", 0.5, r"key 'rope_parameters.rope_theta' must be a number in \[1, 3.4e38\] \(finite in float32\), got 0.5"),
    ("rope_parameters.rope_theta", -math.inf, r"key 'rope_parameters.rope_theta' .*got -Infinity"),
    ("rope_parameters.partial_rotary_factor", 1.5, r"key 'rope_parameters.partial_rotary_factor' must be a number in \(0, 1\], got 1.5"),
    ("rope_parameters.partial_rotary_factor", 0, r"key 'rope_parameters.partial_rotary_factor' must be a number in \(0, 1\], got 0"),
    ("rope_parameters.partial_rotary_factor", 0.02, r"key 'rope_parameters.partial_rotary_factor' gives a rotary dimension of 0 for head_dim 32"),
    ("num_attention_heads", 3, r"key 'num_attention_heads' must be a multiple of num_key_value_heads \(2\), got 3"),
    ("linear_num_value_heads", 3, r"key 'linear_num_value_heads' must be a multiple of linear_num_key_heads"),
    ("head_dim", -32, r"key 'head_dim' must be an integer in \[1, 16777216\], got -32"),
    ("vocab_size", 2**63, r"key 'vocab_size' must be an integer in \[1, 16777216\], got 9223372036854775808"),
    ("vocab_size", DELETE, r"key 'vocab_size' is missing \(expected an integer in \[1, 16777216\]\)"),
    ("max_position_embeddings", 2**40, r"key 'max_position_embeddings' must be an integer in \[1, 2147483647\]"),
    ("num_hidden_layers", True, r"key 'num_hidden_layers' must be an integer in \[1, 16777216\], got true"),
    ("layer_types", "linear_attention", r"key 'layer_types' must be an array, got the string 'linear_attention'"),
    ("hidden_act", 7, r"key 'hidden_act' must be a string, got 7"),
    ("tie_word_embeddings", "yes", r"key 'tie_word_embeddings' must be true or false, got the string 'yes'"),
    ("rope_parameters", [1], r"key 'rope_parameters' must be an object, got an array of 1"),
    ("model_type", None, r"key 'model_type' must be a string, got null"),
]


@pytest.mark.parametrize("path,value,message", TEXT_CASES, ids=[f"{c[0]}={c[1]!r}" for c in TEXT_CASES])
def test_text_config_values(tmp_path, path, value, message):
    d = edited_config(TEXT, tmp_path, path, value)
    with pytest.raises(ocria_rt.ModelError, match=rf"config '{d / 'config.json'}': {message}"):
        _core.load_config(str(d))


VISION_CASES = [
    ("vision_config", 5, r"key 'vision_config' must be an object, got 5"),
    ("vision_config.num_heads", 3, r"key 'vision_config.num_heads' must divide hidden_size 32 into heads"),
    ("vision_config.spatial_merge_size", 0, r"key 'vision_config.spatial_merge_size' must be an integer in \[1, 1024\], got 0"),
    ("vision_config.patch_size", 16.5, r"key 'vision_config.patch_size' must be an integer in \[1, 1024\], got 16.5"),
    ("vision_config.num_position_embeddings", 15, r"key 'vision_config.num_position_embeddings' must be a perfect square"),
    ("vision_config.out_hidden_size", 32, r"key 'vision_config.out_hidden_size' must equal the text hidden_size 64"),
    ("vision_config.rope_parameters.rope_theta", -1, r"key 'vision_config.rope_parameters.rope_theta' must be a number in \[1, 3.4e38\]"),
    ("image_token_id", 600, r"key 'image_token_id' must be an integer in \[0, 599\], got 600"),
    ("vision_start_token_id", -1, r"key 'vision_start_token_id' must be an integer in \[0, 599\], got -1"),
    ("text_config.rope_parameters.mrope_section", [4, 0, "1"], r"key 'text_config.rope_parameters.mrope_section\[2\]' must be an integer"),
    ("text_config.eos_token_id", [599, 600], r"key 'text_config.eos_token_id\[1\]' must be an integer in \[0, 599\], got 600"),
    ("text_config", [], r"key 'text_config' must be an object, got an array of 0"),
]


@pytest.mark.parametrize("path,value,message", VISION_CASES, ids=[f"{c[0]}={c[1]!r}" for c in VISION_CASES])
def test_vlm_config_values(tmp_path, path, value, message):
    d = edited_config(VLM, tmp_path, path, value)
    with pytest.raises(ocria_rt.ModelError, match=rf"config '{d / 'config.json'}': {message}"):
        _core.load_config(str(d))


def test_negative_eps_no_longer_scores_nan(tmp_path):
    d = edited_config(TEXT, tmp_path, "rms_norm_eps", -1)
    with pytest.raises(ocria_rt.ModelError, match="rms_norm_eps"):
        ocria_rt.Engine(d)


def test_null_means_absent(tmp_path):
    """null is JSON for "not set": the default applies (as transformers reads None)."""
    d = edited_config(TEXT, tmp_path, "rope_parameters.mrope_section", None)
    assert _core.load_config(str(d))["mrope_section"] == []
    d = edited_config(VLM, tmp_path / "v", "vision_config.patch_size", None)
    assert _core.load_config(str(d))["vision"]["patch_size"] == 16


def test_vision_values_come_from_the_checked_config():
    c = _core.load_config(str(VLM))
    assert (c["image_token_id"], c["vision_start_token_id"], c["vision_end_token_id"]) == (592, 590, 591)
    assert c["vision"]["spatial_merge_size"] == 2 and c["mrope_section"] == [2, 1, 1]
    assert vision_token_ids(VLM) == {"merge_size": 2, "image_token_id": 592, "vision_start_token_id": 590,
                                     "vision_end_token_id": 591}
    with pytest.raises(ocria_rt.InvalidArgumentError, match="no vision encoder"):
        vision_token_ids(TEXT)


@pytest.mark.parametrize("text,message", [
    ('{"model_type": "qwen3_5_text", "vocab_size": 01}', r"invalid JSON at byte \d+: malformed number \(leading zero\)"),
    ('{"model_type": "qwen3_5_text", "vocab_size": 1e999}', "number out of the range of a double"),
    ('{"model_type": "qwen3_5\\ud800"}', "lone high surrogate"),
    ('{"model_type": "qwen3_5\\udc00"}', "lone low surrogate"),
    ('{"model_type": "a\tb"}', "control character in a string"),
    ('[1, 2]', "must be an object, got an array of 2"),
])
def test_malformed_json(tmp_path, text, message):
    d = model_copy(TEXT, tmp_path)
    (d / "config.json").write_text(text)
    with pytest.raises(ocria_rt.OcriaError, match=f"'{d / 'config.json'}'.*{message}"):
        _core.load_config(str(d))


def test_invalid_utf8_in_config(tmp_path):
    d = model_copy(TEXT, tmp_path)
    (d / "config.json").write_bytes(b'{"model_type": "qwen3_5_text\xff\xfe"}')
    with pytest.raises(ocria_rt.FileError, match="invalid JSON at byte 28: invalid UTF-8 in a string"):
        _core.load_config(str(d))


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_safetensors_header_with_invalid_utf8(tmp_path):
    """The issue's case: bytes that are not UTF-8 in a header are a FileError with a printable message."""
    d = model_copy(TEXT, tmp_path)
    header, data = read_safetensors(d / "model.safetensors")
    text = json.dumps(header).encode().replace(b"model.norm.weight", b"model.norm.\xc3\x28eight")
    write_safetensors(d / "model.safetensors", text, data)
    with pytest.raises(ocria_rt.FileError, match=r"safetensors file '.*model.safetensors': bad header: invalid JSON "
                                                 r"at byte \d+: invalid UTF-8 in a string") as e:
        ocria_rt.Engine(d)
    str(e.value).encode("utf-8")  # printable


def test_safetensors_names_escaped_in_messages(tmp_path):
    d = model_copy(TEXT, tmp_path)
    header, data = read_safetensors(d / "model.safetensors")
    header["model.norm\u0001weight"] = header.pop("model.norm.weight")
    header["model.norm\u0001weight"]["dtype"] = ["F32"]
    write_safetensors(d / "model.safetensors", json.dumps(header).encode(), data)
    with pytest.raises(ocria_rt.FileError, match=r"tensor 'model.norm\\x01weight': key 'dtype' must be a string, "
                                                 r"got an array of 1"):
        ocria_rt.Engine(d)


@pytest.mark.parametrize("edit,message", [
    (lambda h, n: h[n].update(data_offsets=[h[n]["data_offsets"][0] + 4, h[n]["data_offsets"][1] + 4]),
     r"data_offsets \[\d+, \d+\] (overlap|leave a gap after) the tensor before it"),
    (lambda h, n: h[n].update(data_offsets=[0, 2**63]), r"key 'data_offsets\[1\]' must be an integer >= 0"),
    (lambda h, n: h[n].update(shape=[2**40, 2**40, 2**40]), r"needs more than 2\^64"),
    (lambda h, n: h[n].update(shape=[64, -1]), r"key 'shape\[1\]' must be an integer >= 0, got -1"),
    (lambda h, n: h[n].update(dtype="F4"), r"key 'dtype' is 'F4', not a safetensors dtype"),
    (lambda h, n: h.update({n: "x"}), r"tensor '[^']+' must be an object, got the string 'x'"),
])
def test_safetensors_entries(tmp_path, edit, message):
    d = model_copy(TEXT, tmp_path)
    header, data = read_safetensors(d / "model.safetensors")
    name = sorted(k for k in header if k != "__metadata__")[3]
    edit(header, name)
    write_safetensors(d / "model.safetensors", json.dumps(header).encode(), data)
    with pytest.raises(ocria_rt.FileError, match=rf"safetensors file '{d / 'model.safetensors'}': .*{message}"):
        ocria_rt.Engine(d)


def test_safetensors_trailing_bytes(tmp_path):
    d = model_copy(TEXT, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes() + b"\0" * 8)
    with pytest.raises(ocria_rt.FileError, match=r"the tensors' data ends at byte \d+ of the \d+ data bytes"):
        ocria_rt.Engine(d)


@pytest.mark.parametrize("value,message", [
    ("x", r"key 'eos_token_id' must be a token id in \[0, 511\], got 'x'"),
    (3.5, r"key 'eos_token_id' must be a token id in \[0, 511\], got 3.5"),
    ([1, True], r"key 'eos_token_id\[1\]' must be a token id in \[0, 511\], got True"),
    ([1, 600], r"key 'eos_token_id\[1\]' must be a token id in \[0, 511\], got 600"),
])
def test_generation_config_eos(tmp_path, value, message):
    d = edited_config(TEXT, tmp_path, "eos_token_id", value, name="generation_config.json")
    with pytest.raises(ocria_rt.ModelError, match=rf"'{d / 'generation_config.json'}': {message}"):
        ocria_rt.Engine(d)


@pytest.mark.parametrize("edit,message", [
    ({"rescale_factor": math.nan}, r"key 'rescale_factor' must be a finite number > 0, got nan"),
    ({"rescale_factor": 0}, r"key 'rescale_factor' must be a finite number > 0, got 0"),
    ({"rescale_factor": "1/255"}, r"key 'rescale_factor' must be a finite number > 0"),
    ({"rescale_factor": 1e-300}, r"rescale_factor 1e-300, .* turn some pixel values into inf or NaN in float32"),
    ({"image_std": [0.5, 1e-45, 0.5]}, r"rescale_factor .* image_std \[0.5, 1e-45, 0.5\] turn some pixel values into inf or NaN"),
    ({"image_mean": [0.5, math.inf, 0.5]}, r"key 'image_mean' must be a finite number or a list of 3"),
    ({"patch_size": 2**40}, r"key 'patch_size' must be an integer in \[1, 1024\]"),
    ({"temporal_patch_size": 1000}, r"key 'temporal_patch_size' must be an integer in \[1, 16\]"),
    ({"merge_size": 2.5}, r"key 'merge_size' must be an integer in \[1, 64\], got 2.5"),
    ({"size": {"shortest_edge": math.nan, "longest_edge": 4096}}, r"key 'size.shortest_edge' must be a positive integer"),
    ({"min_pixels": 10**400}, r"key 'min_pixels' must be a positive integer below 2\*\*62"),
    ({"do_resize": "false"}, r"key 'do_resize' must be true or false, got 'false'"),
    ({"resample": True}, r"resample=True is not supported"),
])
def test_preprocessor_config_values(tmp_path, edit, message):
    d = model_copy(VLM, tmp_path)
    doc = json.loads((d / "preprocessor_config.json").read_text())
    doc.update(edit)
    (d / "preprocessor_config.json").write_text(json.dumps(doc))
    with pytest.raises(ocria_rt.InvalidArgumentError, match=rf"'{d / 'preprocessor_config.json'}': {message}"):
        pp.ImageProcessorConfig.from_model_dir(d)


def test_preprocessor_huge_max_pixels_means_no_limit():
    cfg = pp.ImageProcessorConfig.from_dict({"max_pixels": 1e300})
    assert cfg.max_pixels == 2**62


def test_preprocess_refuses_a_huge_upscale():
    cfg = pp.ImageProcessorConfig.from_dict({"min_pixels": 2**40, "max_pixels": 2**41})
    with pytest.raises(ocria_rt.InvalidArgumentError, match=r"resizes a 8x8 image to \d+x\d+ = \d+ pixels, over the limit"):
        pp.preprocess_image(np.zeros((8, 8, 3), np.uint8), cfg)


def test_vision_config_beside_the_preprocessor_config(tmp_path):
    d = edited_config(VLM, tmp_path, "vision_config.patch_size", "16")
    with pytest.raises(ocria_rt.ModelError, match=r"key 'vision_config.patch_size' must be an integer, got '16'"):
        pp.ImageProcessorConfig.from_model_dir(d)
    (d / "config.json").write_text("[]")
    with pytest.raises(ocria_rt.ModelError, match="must hold a JSON object, got list"):
        pp.ImageProcessorConfig.from_model_dir(d)


@pytest.mark.parametrize("exc,cls,message", [
    (TypeError("Missing dimensions"), ocria_rt.FileError, "cannot decode x: TypeError: Missing dimensions"),
    (struct.error("unpack requires a buffer of 4 bytes"), ocria_rt.FileError, "cannot decode x: error: unpack"),
    (OSError(5, "Input/output error"), ocria_rt.FileError, "cannot decode x: Input/output error"),
    (MemoryError(), ocria_rt.ResourceError, "cannot decode x: out of memory"),
    (ocria_rt.InvalidArgumentError("mine"), ocria_rt.InvalidArgumentError, "mine"),
])
def test_decoder_errors(exc, cls, message):
    """Pillow reports corrupt data with many exception types; at the decoder boundary they become OcriaErrors."""
    e = pp.decoder_error(exc, "cannot decode x")
    assert type(e) is cls and str(e).startswith(message)

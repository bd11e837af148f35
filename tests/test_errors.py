"""Bad input raises ocria_rt.OcriaError (or a subclass) whose message names the problem."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import ocria_rt
from support import FIXTURES

SRC = FIXTURES / "text_tied"


def copy_model(tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(SRC, dst)
    return dst


def rewrite_tensor_header(path: Path, edit) -> None:
    """Apply `edit` to the parsed safetensors header and write the file back (data unchanged)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def rewrite_tensors(path: Path, edit) -> None:
    """Apply `edit` to {name: [dtype, shape, data bytes]} and write a well-formed safetensors file back
    (the data laid out again, one tensor after the other)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    tensors = {k: [v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]]
               for k, v in header.items()}
    edit(tensors)
    new_header, data, offset = {}, b"", 0
    for name, (dtype, shape, blob) in tensors.items():
        new_header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        data += blob
        offset += len(blob)
    text = json.dumps(new_header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture(scope="module")
def engine():
    return ocria_rt.Engine(SRC)


def test_missing_directory(tmp_path):
    with pytest.raises(ocria_rt.FileError, match="does not exist"):
        ocria_rt.Engine(tmp_path / "nope")


def test_missing_weights(tmp_path):
    d = copy_model(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ocria_rt.FileError, match="model.safetensors"):
        ocria_rt.Engine(d)


def test_missing_config(tmp_path):
    d = copy_model(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ocria_rt.FileError, match="config.json"):
        ocria_rt.Engine(d)


def test_truncated_safetensors(tmp_path):
    d = copy_model(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ocria_rt.FileError, match=r"model\.safetensors.*(outside|truncated)"):
        ocria_rt.Engine(d)


def test_absurd_header_length(tmp_path):
    d = copy_model(tmp_path)
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", 1 << 60) + raw[8:])
    with pytest.raises(ocria_rt.FileError, match="header length"):
        ocria_rt.Engine(d)


def test_wrong_shape(tmp_path):
    d = copy_model(tmp_path)
    name = "model.layers.0.mlp.down_proj.weight"

    def edit(h):  # same byte count, transposed shape
        h[name]["shape"] = h[name]["shape"][::-1]

    rewrite_tensor_header(d / "model.safetensors", edit)
    with pytest.raises(ocria_rt.ModelError, match=rf"{name}.*shape \[128, 64\].*expected \[64, 128\]"):
        ocria_rt.Engine(d)


def test_wrong_dtype(tmp_path):
    d = copy_model(tmp_path)
    name = "model.norm.weight"

    def edit(h):  # F32 [64] has the bytes of I32 [64]
        h[name]["dtype"] = "I32"

    rewrite_tensor_header(d / "model.safetensors", edit)
    with pytest.raises(ocria_rt.ModelError, match=rf"{name}.*dtype I32"):
        ocria_rt.Engine(d)


def test_missing_tensor(tmp_path):
    d = copy_model(tmp_path)
    rewrite_tensors(d / "model.safetensors", lambda t: t.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(ocria_rt.ModelError, match="lacks tensor 'model.layers.3.self_attn.k_norm.weight'"):
        ocria_rt.Engine(d)


def test_intermediate_size_not_a_multiple_of_8(tmp_path):
    """The MLP's gate and up rows are interleaved in groups of 8 (the GLU layout, ops.h)."""
    d = copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    I, H = cfg["intermediate_size"] - 4, cfg["hidden_size"]
    cfg["intermediate_size"] = I
    (d / "config.json").write_text(json.dumps(cfg))

    def edit(tensors):  # every MLP weight narrowed to I (its leading bytes)
        for name, rec in tensors.items():
            if ".mlp." in name:
                rec[1] = [H, I] if "down_proj" in name else [I, H]
                rec[2] = rec[2][: 4 * I * H]

    rewrite_tensors(d / "model.safetensors", edit)
    with pytest.raises(ocria_rt.ModelError, match=rf"mlp.gate_proj.weight' has {I} rows.*multiple of 8"):
        ocria_rt.Engine(d)


def test_unknown_model_type(tmp_path):
    d = copy_model(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ocria_rt.ModelError, match="unsupported model_type 'llama'"):
        ocria_rt.Engine(d)


def test_malformed_config(tmp_path):
    d = copy_model(tmp_path)
    (d / "config.json").write_text('{"model_type": "qwen3_5_text", "hidden_size": ')
    with pytest.raises(ocria_rt.FileError, match="config.json.*invalid JSON"):
        ocria_rt.Engine(d)


def test_token_out_of_vocab(engine):
    with pytest.raises(ocria_rt.InvalidArgumentError, match="token id 512 at index 1 is outside the vocabulary"):
        engine.score([1, 512, 3])
    with pytest.raises(ocria_rt.InvalidArgumentError, match="token id -1"):
        engine.generate([5, -1], max_new_tokens=2)


def test_prompt_longer_than_context():
    eng = ocria_rt.Engine(SRC, max_context=32)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="context limit of 32"):
        eng.score(list(range(40)))
    with pytest.raises(ocria_rt.InvalidArgumentError, match="exceeds the context limit of 32"):
        eng.generate(list(range(30)), max_new_tokens=8)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_not_positive(engine, n):
    with pytest.raises(ocria_rt.InvalidArgumentError, match="max_new_tokens must be positive"):
        engine.generate([1, 2, 3], max_new_tokens=n)


@pytest.mark.parametrize("kw,msg", [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                    ({"top_k": -2}, "top_k"), ({"seed": -1}, "seed")])
def test_bad_sampling_arguments(engine, kw, msg):
    with pytest.raises(ocria_rt.InvalidArgumentError, match=msg):
        engine.generate([1, 2, 3], max_new_tokens=2, **kw)


def test_empty_prompt_and_bad_device(engine):
    with pytest.raises(ocria_rt.InvalidArgumentError, match="empty"):
        engine.generate([], max_new_tokens=2)
    with pytest.raises(ocria_rt.InvalidArgumentError, match="device 'tpu'"):
        ocria_rt.Engine(SRC, device="tpu")


def test_engine_usable_after_errors(engine):
    with pytest.raises(ocria_rt.OcriaError):
        engine.score([10**6])
    logits = engine.score([1, 2, 3])
    assert np.all(np.isfinite(logits))


def test_cuda_unavailable_is_a_device_error():
    if ocria_rt.build_info()["cuda_devices"]:
        pytest.skip("a CUDA device is present (tests/gpu covers it)")
    with pytest.raises(ocria_rt.DeviceError, match="cuda|CUDA"):
        ocria_rt.Engine(SRC, device="cuda")

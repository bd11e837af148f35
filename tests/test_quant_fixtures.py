"""The quantized fixtures of tests/fixtures/quant/ (make_quant_fixtures.py, written by nvidia-modelopt and
llm-compressor) are self-consistent, with numpy alone (no torch).

Each fixture's manifest.json records the tensors as written and a checksum of every dequantized weight;
these tests re-read the safetensors, dequantize them (tests/quant_numpy.py) and compare, check that the
configs parse and name the same quantized linears, and pin the facts the loader relies on (nibble order,
the reciprocal global scale of compressed-tensors, which global scales fused projections share). One test
runs the engine on the dequantized weights, written as a dense checkpoint, against the references."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import numpy as np
import pytest

from quant_numpy import (
    checksum, decode_e2m1, dense_equivalent, dequant_linear, quantized_linears, read_checkpoint, relerr,
    write_safetensors_f32,
)

QUANT = Path(__file__).resolve().parent / "fixtures" / "quant"
MODELOPT = ["modelopt_nvfp4", "modelopt_w4a16_nvfp4", "modelopt_fp8", "modelopt_fp8_per_channel", "modelopt_mixed"]
LLMC = ["llmc_nvfp4", "llmc_nvfp4a16", "llmc_fp8", "llmc_fp8_dynamic"]
NVFP4_FIXTURES = ["modelopt_nvfp4", "modelopt_w4a16_nvfp4", "llmc_nvfp4", "llmc_nvfp4a16"]
MAX_FIXTURE_BYTES = 1 << 20


def load(name: str):
    d = QUANT / name
    return d, read_checkpoint(d), json.loads((d / "manifest.json").read_text())


def test_every_fixture_is_there():
    assert sorted(p.name for p in QUANT.iterdir() if p.is_dir()) == sorted(MODELOPT + LLMC)


@pytest.mark.parametrize("name", MODELOPT + LLMC)
def test_tensors_and_checksums_match_manifest(name):
    d, tensors, manifest = load(name)
    entries = manifest["quantized_linears"]
    formats = quantized_linears(tensors)
    assert formats == {m: e["format"] for m, e in entries.items()}
    for module, e in entries.items():
        written = {n: [t.dtype, list(t.shape)] for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}
        assert written == e["tensors"], module
        w = dequant_linear(tensors, module, e["format"])
        assert np.all(np.isfinite(w)), module
        np.testing.assert_allclose(checksum(w), e["checksum"], rtol=1e-9, err_msg=module)
    size = sum(f.stat().st_size for f in d.iterdir())
    assert size < MAX_FIXTURE_BYTES, f"{name}: {size} bytes"


@pytest.mark.parametrize("name", MODELOPT + LLMC)
def test_configs_name_the_quantized_linears(name):
    d, tensors, manifest = load(name)
    formats = quantized_linears(tensors)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["hidden_size"] % 16 == 0 and cfg["intermediate_size"] % 16 == 0
    assert set(cfg["layer_types"]) == {"linear_attention", "full_attention"}
    qc = cfg["quantization_config"]
    linears = [m for m in formats] + [n[: -len(".weight")] for n, t in tensors.items()
                                      if n.endswith("proj_a.weight") or n.endswith("proj_b.weight")
                                      or n == "lm_head.weight"]
    assert len(linears) == len(set(linears)) == len(formats) + 1 + 2 * cfg["layer_types"].count("linear_attention")
    if name in MODELOPT:
        assert all(m.startswith("model.language_model.layers.") for m in formats)
        hq = json.loads((d / "hf_quant_config.json").read_text())
        q = hq["quantization"]
        assert hq["producer"] == {"name": "modelopt", "version": manifest["versions"]["nvidia-modelopt"]}
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == q["quant_algo"]
        if q["quant_algo"] == "MIXED_PRECISION":
            algo = {"nvfp4": "NVFP4", "fp8": "FP8"}
            assert {m: v["quant_algo"] for m, v in q["quantized_layers"].items()} == {
                m: algo[f] for m, f in formats.items()}
            assert {m for m, f in formats.items() if f == "fp8"} == {
                m for m in formats if m.endswith("down_proj") or ".self_attn." in m}
        else:
            excluded = {m for m in linears if any(fnmatch.fnmatchcase(m, p) for p in q["exclude_modules"])}
            assert set(linears) - excluded == set(formats)
            assert qc["ignore"] == q["exclude_modules"]
            want = "fp8" if q["quant_algo"].startswith("FP8") else "nvfp4"
            assert set(formats.values()) == {want}
            assert (q.get("group_size") == 16) == (want == "nvfp4")
    else:
        assert all(m.startswith("model.layers.") for m in formats)
        assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
        assert qc["version"] == manifest["versions"]["compressed-tensors"]
        assert set(linears) - set(qc["ignore"]) == set(formats)
        group = qc["config_groups"]["group_0"]
        assert group["targets"] == ["Linear"]
        want = {"nvfp4-pack-quantized": "ct_nvfp4", "float-quantized": "fp8"}[qc["format"]]
        assert set(formats.values()) == {want}
        assert group["weights"]["num_bits"] == (4 if want == "ct_nvfp4" else 8)


@pytest.mark.parametrize("name", MODELOPT + LLMC)
def test_reference_shapes(name):
    d = QUANT / name
    cfg = json.loads((d / "config.json").read_text())
    ref = dict(np.load(d / "reference.npz"))
    vocab = cfg["vocab_size"]
    assert ref["logits"].shape == (len(ref["input_ids"]), vocab) and ref["logits"].dtype == np.float32
    assert np.all(np.isfinite(ref["logits"]))
    for key in ("input_ids", "greedy_prompt", "greedy_tokens"):
        assert ref[key].dtype == np.int32 and ref[key].min() >= 0 and ref[key].max() < vocab, key
    assert len(ref["greedy_tokens"]) == 32 and ref["greedy_min_margin"] >= 1e-4


@pytest.mark.parametrize("name", NVFP4_FIXTURES)
def test_nvfp4_nibble_order_against_fp8(name):
    """The per-channel FP8 export of the same base model has no element order to get wrong: each NVFP4
    weight, decoded low nibble first, is ~0.1 from it; high nibble first would be ~1.4. A compressed-tensors
    global scale used like ModelOpt's (not inverted) would be off by a factor of ~10^7."""
    _, fp8, _ = load("modelopt_fp8_per_channel")
    fp8_formats = quantized_linears(fp8)
    _, tensors, _ = load(name)
    formats = quantized_linears(tensors)
    for module, fmt in formats.items():
        fp8_module = "model.language_model." + module[len("model."):] if name.startswith("llmc") else module
        w_fp8 = dequant_linear(fp8, fp8_module, fp8_formats[fp8_module])
        assert relerr(dequant_linear(tensors, module, fmt), w_fp8) < 0.15, module
        assert relerr(dequant_linear(tensors, module, fmt, low_first=False), w_fp8) > 1.0, module


@pytest.mark.parametrize("w4a4, w4a16", [("modelopt_nvfp4", "modelopt_w4a16_nvfp4"), ("llmc_nvfp4", "llmc_nvfp4a16")])
def test_activation_scheme_does_not_change_weights(w4a4, w4a16):
    """W4A4 and W4A16 exports differ only in the input scales; with weight-only semantics they are the
    same model, and their references are identical."""
    _, a, _ = load(w4a4)
    _, b, _ = load(w4a16)
    extra = {n for n in a if n.endswith(("input_scale", "input_global_scale"))}
    assert extra and set(a) - extra == set(b)
    for n in b:
        assert a[n].dtype == b[n].dtype and np.array_equal(a[n].raw, b[n].raw), n
    ra, rb = np.load(QUANT / w4a4 / "reference.npz"), np.load(QUANT / w4a16 / "reference.npz")
    np.testing.assert_array_equal(ra["logits"], rb["logits"])


def global_scale(tensors, module):
    if module + ".weight_scale_2" in tensors:
        return float(tensors[module + ".weight_scale_2"].f32())
    return 1.0 / float(tensors[module + ".weight_global_scale"].f32().reshape(()))


FUSED = [("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")),
         ("linear_attn", ("in_proj_qkv", "in_proj_z"))]


@pytest.mark.parametrize("name", NVFP4_FIXTURES)
def test_fused_projection_global_scales(name):
    """ModelOpt writes one NVFP4 global scale per fused group; llm-compressor shares q/k/v and gate/up but
    not in_proj_qkv / in_proj_z, so a loader fusing those must keep a scale per part."""
    _, tensors, _ = load(name)
    formats = quantized_linears(tensors)
    layers = sorted({m.rsplit(".", 2)[0] for m in formats})
    checked = set()
    for layer in layers:
        for block, parts in FUSED:
            modules = [f"{layer}.{block}.{p}" for p in parts]
            if modules[0] not in formats:
                continue
            scales = {global_scale(tensors, m) for m in modules}
            shared = name.startswith("modelopt") or block != "linear_attn"
            assert (len(scales) == 1) == shared, (modules, scales)
            checked.add(block)
    assert checked == {"self_attn", "mlp", "linear_attn"}


@pytest.mark.parametrize("name", MODELOPT + LLMC)
def test_engine_on_dequantized_weights_reproduces_reference(name, tmp_path):
    """The references are what weight-only loading must give: the engine, handed the numpy-dequantized
    weights as a plain fp32 checkpoint (the tensor names as the tool wrote them), reproduces them."""
    import ocria_rt

    d, tensors, _ = load(name)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_safetensors_f32(tmp_path / "model.safetensors", dense_equivalent(tensors))
    ref = np.load(d / "reference.npz")
    eng = ocria_rt.Engine(tmp_path)
    assert relerr(eng.score(ref["input_ids"]), ref["logits"]) <= 1e-4
    res = eng.generate(ref["greedy_prompt"], max_new_tokens=len(ref["greedy_tokens"]), stop_token_ids=[])
    np.testing.assert_array_equal(np.array(res.token_ids), ref["greedy_tokens"])


def test_e2m1_decoding():
    """Byte 0x2F holds element 0 = code 0xF (-6) in its low nibble and element 1 = code 0x2 (1.0)."""
    np.testing.assert_array_equal(decode_e2m1(np.array([[0x2F, 0x90]], dtype=np.uint8)),
                                  [[-6.0, 1.0, 0.0, -0.5]])

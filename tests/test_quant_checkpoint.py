"""bench/quant_checkpoint.py: random-weight checkpoints in ModelOpt's FP8 / NVFP4 / mixed format,
written with torch on the CPU for a tiny shape (bench/decode.py --quant writes the real shapes on the GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import common  # noqa: E402
from quant_checkpoint import (NVFP4_BLOCK, dequantize_fp8, dequantize_nvfp4, module_format,  # noqa: E402
                              quantize_fp8, quantize_nvfp4, write_quantized_checkpoint)

TINY = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, vocab_size=256, tie_word_embeddings=True)
QUANTIZED = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "linear_attn.in_proj_qkv",
             "linear_attn.in_proj_z", "linear_attn.out_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    common.SHAPES["tiny-test"] = TINY
    try:
        return common.make_random_checkpoint("tiny-test", tmp_path_factory.mktemp("bf16"), device="cpu")
    finally:
        del common.SHAPES["tiny-test"]


def test_nvfp4_codes_round_half_to_even_and_pack_low_nibble_first():
    # amax 6 makes the global scale 1/448 and the block scale 448: the values are their own codes
    grid = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    packed, block_scale, global_scale = quantize_nvfp4(torch.tensor([grid]))
    assert float(global_scale) == pytest.approx(6 / (6 * 448)) and float(block_scale.float()) == 448.0
    codes = [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 15]  # ties to the even code; bit 3 = sign
    assert packed.tolist() == [[codes[i] | codes[i + 1] << 4 for i in range(0, 16, 2)]]
    assert dequantize_nvfp4(packed, block_scale, global_scale)[0].tolist() == pytest.approx(
        [0, 1, 1, 2, 2, 4, 4, 6, 0, -1, -1, -2, -2, -4, -4, -6], rel=1e-6)


def test_quantizers_round_trip_within_their_error():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    packed, bs, gs = quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (128, 128)
    assert bs.dtype == torch.float8_e4m3fn and bs.shape == (128, 256 // NVFP4_BLOCK) and gs.dtype == torch.float32
    rel = lambda a: float((a - w).norm() / w.norm())  # noqa: E731
    assert 0.05 < rel(dequantize_nvfp4(packed, bs, gs)) < 0.12  # E2M1 with E4M3 block scales: ~0.09
    # the nibble order matters: reading the high nibble first is far off
    swapped = (packed >> 4) | (packed << 4)
    assert rel(dequantize_nvfp4(swapped, bs, gs)) > 1.0
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == () and rel(dequantize_fp8(q, s)) < 0.04
    # a shared amax (fused projections) sets the scale; an all-zero block gets block scale 1
    _, bs0, gs0 = quantize_nvfp4(torch.zeros(2, 32), amax=torch.tensor(6.0))
    assert float(gs0) == pytest.approx(1 / 448) and bs0.float().tolist() == [[1.0, 1.0], [1.0, 1.0]]


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mixed"])
def test_checkpoint_in_modelopt_format(bf16_dir, tmp_path, fmt):
    out = write_quantized_checkpoint(bf16_dir, tmp_path / fmt, fmt, device="cpu")
    src = safetensors_torch.load_file(str(bf16_dir / "model.safetensors"))
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    hf = json.loads((out / "hf_quant_config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and hf["producer"]["name"] == qc["producer"]["name"] == "modelopt"

    quantized = [k.removesuffix(".weight") for k in src if k.removesuffix(".weight").endswith(tuple(QUANTIZED))]
    assert len(quantized) == 3 * (3 + 3) + (4 + 3)  # 3 DeltaNet layers, 1 attention layer; each with its MLP
    nvfp4 = fmt in ("nvfp4", "mixed")
    for m in quantized:
        w = src[m + ".weight"].float()
        N, K = w.shape
        assert got[m + ".input_scale"].dtype == torch.float32 and got[m + ".input_scale"].shape == ()
        if nvfp4:
            assert got[m + ".weight"].dtype == torch.uint8 and got[m + ".weight"].shape == (N, K // 2)
            assert got[m + ".weight_scale"].dtype == torch.float8_e4m3fn
            assert got[m + ".weight_scale"].shape == (N, K // NVFP4_BLOCK)
            assert got[m + ".weight_scale_2"].dtype == torch.float32 and got[m + ".weight_scale_2"].shape == ()
            back = dequantize_nvfp4(got[m + ".weight"], got[m + ".weight_scale"], got[m + ".weight_scale_2"])
            assert float((back - w).norm() / w.norm()) < 0.15, m
        else:
            assert got[m + ".weight"].dtype == torch.float8_e4m3fn and got[m + ".weight"].shape == (N, K)
            assert got[m + ".weight_scale"].dtype == torch.float32 and got[m + ".weight_scale"].shape == ()
            assert m + ".weight_scale_2" not in got
            back = dequantize_fp8(got[m + ".weight"], got[m + ".weight_scale"])
            assert float((back - w).norm() / w.norm()) < 0.05, m
    # the parts of a fused projection share one global scale
    scale = "weight_scale_2" if nvfp4 else "weight_scale"
    for group in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"],
                  ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"]):
        layer = "model.layers.3." if group[0].startswith("self_attn") else "model.layers.0."
        assert len({float(got[f"{layer}{p}.{scale}"]) for p in group}) == 1, group
    # everything else stays as it was, bit for bit
    for k, v in src.items():
        if k.removesuffix(".weight") not in quantized:
            assert torch.equal(got[k], v), k
    assert not any(k.startswith("model.layers.0.linear_attn.in_proj_a.weight_") for k in got)

    if fmt == "mixed":
        layers = hf["quantization"]["quantized_layers"]
        assert hf["quantization"]["quant_algo"] == qc["quant_algo"] == "MIXED_PRECISION"
        assert layers["lm_head"] == {"quant_algo": "FP8"} and qc["quantized_layers"] == layers
        assert all(layers[m] == {"quant_algo": "NVFP4", "group_size": 16} for m in quantized)
        assert sorted(layers) == sorted(quantized + ["lm_head"]) and qc["ignore"] == []
        assert config["tie_word_embeddings"] is False
        assert got["lm_head.weight"].dtype == torch.float8_e4m3fn and got["lm_head.weight_scale"].shape == ()
        assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
        targets = sorted(t for g in qc["config_groups"].values() for t in g["targets"])
        assert targets == sorted(layers)
    else:
        q = hf["quantization"]
        assert q["quant_algo"] == qc["quant_algo"] == ("NVFP4" if nvfp4 else "FP8")
        assert q.get("group_size") == (16 if nvfp4 else None) and q["kv_cache_quant_algo"] is None
        assert "lm_head" in q["exclude_modules"] and q["exclude_modules"] == qc["ignore"]
        assert "model.layers.*.linear_attn.in_proj_a" in q["exclude_modules"]
        assert "lm_head.weight" not in got and config["tie_word_embeddings"] is True


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mixed"])
def test_roofline_counts_the_quantized_bytes(bf16_dir, tmp_path, fmt):
    """bytes_per_decode_step(quant=fmt) is the BF16 figure less each quantized linear's BF16 bytes plus
    what the written checkpoint stores for it (values and block scales) and a fp32 scale per row."""
    out = write_quantized_checkpoint(bf16_dir, tmp_path / fmt, fmt, device="cpu")
    got = safetensors_torch.load_file(str(out / "model.safetensors"))
    c = json.loads((bf16_dir / "config.json").read_text())
    change = 0
    for k, v in got.items():
        if v.dtype in (torch.uint8, torch.float8_e4m3fn) and k.endswith(".weight"):
            m = k.removesuffix(".weight")
            n, k_in = v.shape[0], (2 if v.dtype == torch.uint8 else 1) * v.shape[1]
            block = got[m + ".weight_scale"].numel() if v.dtype == torch.uint8 else 0
            change += v.numel() + block + 4 * n - 2 * n * k_in
    base, quant = common.bytes_per_decode_step(c, 100), common.bytes_per_decode_step(c, 100, quant=fmt)
    assert quant["weights"] == base["weights"] + change and change < 0
    assert quant["kv_cache"] == base["kv_cache"] and quant["total"] == quant["weights"] + quant["kv_cache"] + quant["gdn_state"]
    assert module_format("lm_head", fmt) == ("FP8" if fmt == "mixed" else "BF16")
